"""Cluster launchers by name: tools that start one process per rank (srun's tasks, torchrun's
workers), this process being one of them.

``LAUNCHERS`` holds the built-in ``torchrun`` and ``slurm`` (in the order ``workers.launcher:
auto`` tries them), any registered name, or an import path ``package.module:LAUNCHER``: a
launcher of another tool is one file defining a `ClusterLauncher`. ``local`` (this process
starts the ranks) and ``auto`` are not launchers of this kind; ``nemo_tlt.rl.workers`` chooses.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nemo_tlt.dist.slurm import SlurmEnvError, SlurmTask, in_srun_step, launch_slurm
from nemo_tlt.dist.torchrun import TorchrunEnvError, TorchrunTask, in_torchrun, launch_torchrun
from nemo_tlt.registry import Registry

Env = Mapping[str, str]


@dataclass(frozen=True)
class ClusterLauncher:
    """``claims(env)``: under ``auto``, this environment is this launcher's. ``task(env)``: this
    process's task (``rank``, ``world``, ``local_rank``), or ``env_error`` naming what is missing.
    ``local_refusal(env, num_workers)``: why ``launcher=local`` cannot run here (this process is
    one of several of this launcher's: each would start its own run), or None.
    ``launch(fn, world_size, *args, collective_timeout_s, threads, device)``: run ``fn(ctx, *args)``
    as this process's rank; returns its value."""

    name: str
    claims: Callable[[Env], bool]
    task: Callable[[Env], Any]
    local_refusal: Callable[[Env, int], str | None]
    launch: Callable[..., Any]
    env_error: type[Exception] = ValueError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.launch(*args, **kwargs)


def _srun_tasks(env: Env) -> int:
    if not in_srun_step(env):
        return 0
    try:
        return int(env.get("SLURM_NTASKS", "1"))
    except ValueError:
        raise SlurmEnvError(f"SLURM_NTASKS={env['SLURM_NTASKS']!r} is not an integer") from None


def _slurm_refusal(env: Env, num_workers: int) -> str | None:
    tasks = _srun_tasks(env)
    if tasks <= 1:
        return None
    return (f"workers.launcher=local, but this process is task {env.get('SLURM_PROCID')} of SLURM_NTASKS={tasks} "
            f"srun tasks: each would start its own run of {num_workers} workers; set workers.launcher=slurm "
            "(or auto), or start one task")


def _torchrun_refusal(env: Env, num_workers: int) -> str | None:
    if not in_torchrun(env) or TorchrunTask.from_env(env).world <= 1:
        return None
    return (f"workers.launcher=local, but this process is torchrun worker {env['RANK']} of "
            f"WORLD_SIZE={env['WORLD_SIZE']}: each would start its own run of {num_workers} workers; set "
            "workers.launcher=torchrun (or auto), or start one torchrun worker")


TORCHRUN = ClusterLauncher("torchrun", in_torchrun, TorchrunTask.from_env, _torchrun_refusal, launch_torchrun,
                           TorchrunEnvError)
SLURM = ClusterLauncher("slurm", lambda env: _srun_tasks(env) > 1, SlurmTask.from_env, _slurm_refusal, launch_slurm,
                        SlurmEnvError)

LAUNCHERS = Registry("launcher", "workers.launcher", {
    "torchrun": "nemo_tlt.dist.launchers:TORCHRUN",
    "slurm": "nemo_tlt.dist.launchers:SLURM",
})
BUILT_IN_MODES = ("auto", "local")  # not launchers of this kind: workers.launcher also takes these


def launcher_named(name: str) -> ClusterLauncher:
    """The ``ClusterLauncher`` ``name`` stands for (a ValueError naming ``workers.launcher`` otherwise)."""
    launcher = LAUNCHERS.get(name)
    if not isinstance(launcher, ClusterLauncher):
        raise ValueError(f"workers.launcher={name!r} is a {type(launcher).__name__}, not a ClusterLauncher")
    return launcher


def choose_launcher(launcher: str, num_workers: int, env: Env | None = None) -> ClusterLauncher | None:
    """The cluster launcher this process runs under (None: ``local``): the one named, or under
    ``auto`` the first whose environment this is; ``local`` where a launcher's environment says
    this process is one of several is refused with that launcher's error."""
    env = os.environ if env is None else env
    names = list(LAUNCHERS.names())
    if launcher not in BUILT_IN_MODES and launcher not in names:
        names.append(launcher)  # named by import path
    for name in names:
        found = launcher_named(name)
        if launcher == name or (launcher == "auto" and found.claims(env)):
            found.task(env)  # names what is missing
            return found
    for name in reversed(names):  # (srun's refusal first, as it wraps any torchrun inside it)
        found = launcher_named(name)
        refusal = found.local_refusal(env, num_workers)
        if refusal is not None:
            raise found.env_error(refusal)
    return None
