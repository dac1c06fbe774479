"""Process groups for nemo-tlt: one launcher, one flat all-reduce, the loop's typed collectives.

launch      -- ``launch_local``: N local processes joined over a TCPStore rendezvous (gloo on CPU,
               "cpu:gloo,cuda:nccl" on CUDA), each bound to its device
slurm       -- ``launch_slurm``: this srun task is one rank (rendezvous from SLURM's variables)
torchrun    -- ``launch_torchrun``: this torchrun worker is one rank (torchrun's variables and store)
comm        -- ``Comm`` (typed collectives, trivial for one rank) and ``StopFlag`` (SIGINT/SIGTERM)
allreduce   -- ``allreduce_flat``: many tensors reduced through one flat float32 buffer
topology    -- ``NodeTopology`` (which ranks share a node) and the node / leaders groups of a
               hierarchical all-reduce (``build_node_groups``)

Imports only torch and the bottom layer's ``nemo_tlt.device`` (which device a rank binds).
"""
from nemo_tlt.dist.allreduce import allreduce_flat
from nemo_tlt.dist.comm import Comm, StopFlag
from nemo_tlt.dist.launch import RankContext, Rendezvous, free_port, launch_local
from nemo_tlt.dist.slurm import SlurmEnvError, in_srun_step, launch_slurm
from nemo_tlt.dist.torchrun import TorchrunEnvError, in_torchrun, launch_torchrun
from nemo_tlt.dist.topology import NodeGroups, NodeTopology, build_node_groups, gather_topology

__all__ = ["Comm", "NodeGroups",
           "NodeTopology", "RankContext", "Rendezvous", "SlurmEnvError", "StopFlag", "TorchrunEnvError",
           "allreduce_flat", "build_node_groups", "free_port", "gather_topology", "in_srun_step", "in_torchrun",
           "launch_local", "launch_slurm", "launch_torchrun"]
