"""torchrun launch mode: this process is one rank started by ``torchrun`` (or any launcher
that sets torch's ``env://`` variables).

Contract
--------
* ``in_torchrun(env)``: True when ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
  and ``MASTER_PORT`` are all set.
* ``TorchrunTask.from_env(env)``: rank ``RANK`` of ``WORLD_SIZE``, local rank
  ``LOCAL_RANK``, node ``GROUP_RANK`` (torchrun's node index; without it
  ``RANK // LOCAL_WORLD_SIZE``, else 0), the store at ``MASTER_ADDR:MASTER_PORT``.
  A missing variable raises ``TorchrunEnvError`` naming every missing one; a value that
  is not an integer, or a rank outside the world, is refused naming the variable.
* ``torchrun_rendezvous(expected_world, env, launch_index)``: this rank's ``Rendezvous``;
  a ``WORLD_SIZE`` other than ``expected_world`` (``workers.num_workers``) is refused
  naming both.
* Store: with ``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun's static and c10d
  rendezvous) torchrun's agent hosts a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` for the
  whole job and every rank is a client; otherwise rank 0 hosts it there, as torch's
  ``env://`` does. Either way the process connects once and keeps that store for its
  whole life: one ``nemo-tlt train --compare-baseline`` process launches several runs
  one after another, and each launch k works under its own key prefix ``tlt/launch<k>/``
  (every rank launches in the same order), so a launch never reads keys an earlier one
  left in the store (the agent's store outlives every launch), and no port is needed
  per launch (SLURM mode needs one because its store dies with each launch).
* ``launch_torchrun(fn, world_size, *args, device=kind, ...)``: runs ``fn(ctx, *args)``
  as this rank through ``run_rank`` on ``resolve_device(kind, LOCAL_RANK)`` (SIGINT /
  SIGTERM, which torchrun forwards to its workers, set ``ctx.stop``) and returns this
  rank's value. A failing peer is not reported here: torchrun stops the other workers
  when one fails.
"""
from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch.distributed as dist

from nemo_tlt.dist.launch import Rendezvous, run_rank

REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_launches = itertools.count()  # launches made by this process (one key prefix each)
_stores: dict[tuple[str, int], dist.Store] = {}  # the process's connection to the job's store


class TorchrunEnvError(ValueError):
    """The environment is not that of a torchrun worker (or is inconsistent)."""


def in_torchrun(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return all(env.get(k) for k in REQUIRED)


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise TorchrunEnvError(f"torchrun launch mode: {key}={env[key]!r} is not an integer") from None


@dataclass(frozen=True)
class TorchrunTask:
    rank: int
    world: int
    local_rank: int
    node: int
    host: str
    port: int
    agent_store: bool  # torchrun's agent hosts the store (else rank 0 does)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TorchrunTask":
        env = os.environ if env is None else env
        missing = [k for k in REQUIRED if not env.get(k)]
        if missing:
            raise TorchrunEnvError(f"torchrun launch mode (workers.launcher): {', '.join(missing)} not set; this "
                                   "process must be a worker started by torchrun (or set torch's env:// variables)")
        rank, world, local_rank, port = (_int(env, k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
        if not 0 <= rank < world:
            raise TorchrunEnvError(f"torchrun launch mode: RANK={rank} is outside WORLD_SIZE={world}")
        if env.get("GROUP_RANK"):
            node = _int(env, "GROUP_RANK")
        elif env.get("LOCAL_WORLD_SIZE"):
            node = rank // max(1, _int(env, "LOCAL_WORLD_SIZE"))
        else:
            node = 0
        return cls(rank, world, local_rank, node, env["MASTER_ADDR"], port,
                   env.get(AGENT_STORE_ENV, "").lower() == "true")


def torchrun_rendezvous(expected_world: int, env: Mapping[str, str] | None = None, launch_index: int = 0
                        ) -> tuple[Rendezvous, str]:
    """This rank's ``Rendezvous`` and the key prefix of launch `launch_index`."""
    task = TorchrunTask.from_env(env)
    if task.world != expected_world:
        raise TorchrunEnvError(f"torchrun started WORLD_SIZE={task.world} workers but workers.num_workers="
                               f"{expected_world}: each torchrun worker is one worker; start torchrun with "
                               f"{expected_world} processes in all (--nnodes x --nproc-per-node), or set "
                               f"workers.num_workers={task.world}")
    hosts = not task.agent_store and task.rank == 0
    return (Rendezvous(task.host, task.port, task.rank, task.world, task.local_rank, host_store=hosts,
                       node=task.node), f"tlt/launch{launch_index}/")


def _job_store(rdzv: Rendezvous, timeout_s: float) -> dist.Store:
    """The job's store, connected (or hosted) once per process and kept for its life."""
    key = (rdzv.host, rdzv.port)
    if key not in _stores:
        _stores[key] = dist.TCPStore(rdzv.host, rdzv.port, rdzv.world, rdzv.host_store,
                                     datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    store = _stores[key]
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def launch_torchrun(fn: Callable, world_size: int, *args: Any, collective_timeout_s: float = 300.0,
                    threads: int = 1, env: Mapping[str, str] | None = None, device: str = "cpu") -> Any:
    """Run ``fn(ctx, *args)`` as this torchrun worker's rank; returns this rank's value."""
    rdzv, prefix = torchrun_rendezvous(world_size, env, next(_launches))
    store = dist.PrefixStore(prefix, _job_store(rdzv, collective_timeout_s))
    return run_rank(fn, rdzv, args, timeout_s=collective_timeout_s, threads=threads, device=device,
                    install_signals=True, store=store)
