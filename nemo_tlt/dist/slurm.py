"""SLURM launch mode: this process is one ``srun`` task, and one task is one rank.

Contract
--------
* ``in_srun_step(env)``: True inside a job step started by ``srun`` (``SLURM_STEP_ID``
  and ``SLURM_PROCID`` set). A batch script's own shell has ``SLURM_PROCID=0`` but no
  ``SLURM_STEP_ID``: it is not a rank.
* ``SlurmTask.from_env(env)``: rank ``SLURM_PROCID``, world ``SLURM_NTASKS``, local rank
  ``SLURM_LOCALID``, node ``SLURM_NODEID`` of ``SLURM_NNODES``, job ``SLURM_JOB_ID``,
  step ``SLURM_STEP_ID``, nodes ``SLURM_JOB_NODELIST`` (``SLURM_STEP_NODELIST`` when the
  step runs on a subset). A missing or malformed variable raises ``SlurmEnvError``
  naming every missing variable and saying to start the job with ``srun``.
* ``expand_nodelist(text)``: SLURM's host-list syntax (``gpu-a[01-03,07],b5``) expanded
  here, in the order ``scontrol show hostnames`` prints (no subprocess, so a task needs
  no SLURM client to find its peers).
* Rendezvous address: ``TLT_RDZV_HOST`` when set; else the first host of the node list,
  translated to its ``NodeAddr`` by ``scontrol show node`` (a node's name need not
  resolve: emulated or renamed nodes), or used as is when ``scontrol`` is not there or
  does not know it. SLURM's block distribution puts task 0 on that host, and rank 0
  hosts the store.
* Rendezvous port: ``TLT_RDZV_PORT`` when set; else derived from the job id,
  ``15000 + 16 * (job_id % 900)``, so concurrent jobs sharing a node use different
  ports. The k-th launch of a process uses ``port + k`` (k < 16): every rank launches in
  the same order, and a rank that finished launch k-1 early can never join the store
  of launch k-1 still held by rank 0. Two concurrent steps of one job on one node need
  ``TLT_RDZV_PORT`` set apart.
* ``slurm_rendezvous(expected_world, env, launch_index)``: the ``Rendezvous`` of this
  task; a task count that differs from ``expected_world`` is refused naming both.
* ``launch_slurm(fn, world_size, *args, device=kind, ...)``: runs ``fn(ctx, *args)`` as
  this task's rank through ``run_rank`` on ``resolve_device(kind, SLURM_LOCALID)`` (one GPU
  per task by local rank; every GPU of the node stays visible to every task, so NCCL can
  use NVLink peer-to-peer) (SIGINT / SIGTERM, which ``srun`` forwards to its tasks, set
  ``ctx.stop``) and returns this rank's value. Peers that fail are not reported here:
  ``srun --kill-on-bad-exit=1`` ends the step when one task fails.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nemo_tlt.dist.launch import Rendezvous, run_rank

HOST_ENV = "TLT_RDZV_HOST"
PORT_ENV = "TLT_RDZV_PORT"
PORT_BASE, PORT_SLOTS, PORTS_PER_JOB = 15000, 900, 16
_REQUIRED = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_ID",
             "SLURM_STEP_ID")
_launches = itertools.count()  # launches made by this process (see the port rule)


class SlurmEnvError(ValueError):
    """The environment is not that of an srun task (or is inconsistent)."""


def in_srun_step(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env


@dataclass(frozen=True)
class SlurmTask:
    rank: int
    world: int
    local_rank: int
    node: int
    num_nodes: int
    job_id: int
    step_id: int
    nodes: tuple[str, ...]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "SlurmTask":
        env = os.environ if env is None else env
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        missing = [k for k in _REQUIRED if not env.get(k)] + ([] if nodelist else ["SLURM_JOB_NODELIST"])
        if missing:
            raise SlurmEnvError(f"SLURM launch mode (workers.launcher): {', '.join(missing)} not set; this "
                                "process must be a task started by srun inside a SLURM job")
        ints = {}
        for key in _REQUIRED:
            try:
                ints[key] = int(env[key])
            except ValueError:
                raise SlurmEnvError(f"SLURM launch mode: {key}={env[key]!r} is not an integer") from None
        task = cls(ints["SLURM_PROCID"], ints["SLURM_NTASKS"], ints["SLURM_LOCALID"], ints["SLURM_NODEID"],
                   ints["SLURM_NNODES"], ints["SLURM_JOB_ID"], ints["SLURM_STEP_ID"], tuple(expand_nodelist(nodelist)))
        if not 0 <= task.rank < task.world:
            raise SlurmEnvError(f"SLURM launch mode: SLURM_PROCID={task.rank} is outside SLURM_NTASKS={task.world}")
        if not 0 <= task.node < task.num_nodes:
            raise SlurmEnvError(f"SLURM launch mode: SLURM_NODEID={task.node} is outside SLURM_NNODES={task.num_nodes}")
        return task


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_brackets(body: str, text: str) -> list[str]:
    out = []
    for part in body.split(","):
        m = _RANGE.match(part)
        if m is None:
            raise SlurmEnvError(f"SLURM node list {text!r}: cannot read the range {part!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise SlurmEnvError(f"SLURM node list {text!r}: range {part!r} runs backwards")
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]  # keep zero padding (node01)
    return out


def _expand_host(pattern: str, text: str) -> list[str]:
    """One comma-free host pattern; several bracket groups multiply (rack[1-2]-n[1-2])."""
    names = [""]
    rest = pattern
    while rest:
        open_ = rest.find("[")
        if open_ < 0:
            names = [n + rest for n in names]
            break
        close = rest.find("]", open_)
        if close < 0:
            raise SlurmEnvError(f"SLURM node list {text!r}: unclosed '['")
        prefix, body, rest = rest[:open_], rest[open_ + 1:close], rest[close + 1:]
        names = [n + prefix + x for n in names for x in _expand_brackets(body, text)]
    return names


def expand_nodelist(text: str) -> list[str]:
    """Host names of a SLURM host list, in its order."""
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if i > start:
                hosts += _expand_host(text[start:i], text)
            start = i + 1
    if depth != 0 or not hosts:
        raise SlurmEnvError(f"SLURM node list {text!r}: not a host list")
    return hosts


def node_address(name: str) -> str:
    """``NodeAddr`` of node `name` as SLURM knows it; `name` itself without scontrol."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return name
    out = subprocess.run([scontrol, "show", "node", "-o", name], capture_output=True, text=True, timeout=30)
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", out.stdout) if out.returncode == 0 else None
    return m.group(1) if m else name


def rendezvous_host(task: SlurmTask, env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get(HOST_ENV) or node_address(task.nodes[0])


def rendezvous_port(task: SlurmTask, env: Mapping[str, str] | None = None, launch_index: int = 0) -> int:
    env = os.environ if env is None else env
    if not 0 <= launch_index < PORTS_PER_JOB:
        raise SlurmEnvError(f"SLURM launch mode: at most {PORTS_PER_JOB} launches per process "
                            f"(this is launch {launch_index})")
    if env.get(PORT_ENV):
        try:
            base = int(env[PORT_ENV])
        except ValueError:
            raise SlurmEnvError(f"{PORT_ENV}={env[PORT_ENV]!r} is not a port number") from None
        if not 1024 <= base <= 65535 - PORTS_PER_JOB:
            raise SlurmEnvError(f"{PORT_ENV}={base} must lie in [1024, {65535 - PORTS_PER_JOB}]")
    else:
        base = PORT_BASE + PORTS_PER_JOB * (task.job_id % PORT_SLOTS)
    return base + launch_index


def slurm_rendezvous(expected_world: int, env: Mapping[str, str] | None = None, launch_index: int = 0
                     ) -> Rendezvous:
    """This task's ``Rendezvous``; refuses a task count other than `expected_world`."""
    task = SlurmTask.from_env(env)
    if task.world != expected_world:
        raise SlurmEnvError(f"SLURM started SLURM_NTASKS={task.world} tasks but workers.num_workers="
                            f"{expected_world}: each srun task is one worker; submit with --ntasks={expected_world} "
                            f"(or --nodes x --ntasks-per-node = {expected_world}), or set "
                            f"workers.num_workers={task.world}")
    return Rendezvous(rendezvous_host(task, env), rendezvous_port(task, env, launch_index), task.rank, task.world,
                      task.local_rank, host_store=task.rank == 0, node=task.node)


def launch_slurm(fn: Callable, world_size: int, *args: Any, collective_timeout_s: float = 300.0,
                 threads: int = 1, env: Mapping[str, str] | None = None, device: str = "cpu") -> Any:
    """Run ``fn(ctx, *args)`` as this srun task's rank; returns this rank's value."""
    rdzv = slurm_rendezvous(world_size, env, next(_launches))
    return run_rank(fn, rdzv, args, timeout_s=collective_timeout_s, threads=threads, device=device,
                    install_signals=True)
