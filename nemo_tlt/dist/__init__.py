"""Process groups for nemo-tlt: one launcher, one flat all-reduce, the loop's typed collectives.

launch      -- ``launch_local``: N local processes joined by gloo over a TCPStore rendezvous
slurm       -- ``launch_slurm``: this srun task is one rank (rendezvous from SLURM's variables)
device      -- ``resolve_device`` (cpu / cuda:LOCAL_RANK from workers.device), ``Placement``
comm        -- ``Comm`` (typed collectives, trivial for one rank) and ``StopFlag`` (SIGINT/SIGTERM)
allreduce   -- ``allreduce_flat``: many tensors reduced through one flat float32 buffer
topology    -- ``NodeTopology`` (which ranks share a node) and the node / leaders groups of a
               hierarchical all-reduce (``build_node_groups``)

A bottom layer: imports only torch (never another nemo_tlt package).
"""
from nemo_tlt.dist.allreduce import allreduce_flat
from nemo_tlt.dist.comm import Comm, StopFlag
from nemo_tlt.dist.device import DEVICES, DTYPES, Placement, resolve_device, torch_dtype
from nemo_tlt.dist.launch import RankContext, Rendezvous, free_port, launch_local
from nemo_tlt.dist.slurm import SlurmEnvError, in_srun_step, launch_slurm
from nemo_tlt.dist.topology import NodeGroups, NodeTopology, build_node_groups, gather_topology

__all__ = ["DEVICES", "DTYPES", "Placement", "resolve_device", "torch_dtype", "Comm", "NodeGroups", "NodeTopology", "RankContext", "Rendezvous", "SlurmEnvError", "StopFlag",
           "allreduce_flat", "build_node_groups", "free_port", "gather_topology", "in_srun_step", "launch_local",
           "launch_slurm"]
