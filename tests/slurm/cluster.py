"""A real SLURM cluster on this host for the tests: munged, slurmctld and one slurmd per
emulated node, all in one temporary folder, stopped and removed afterwards.

* ``ensure_packages()``: Debian's ``slurmctld``, ``slurmd``, ``munge`` and
  ``slurm-client``; installed with apt-get when missing and running as root, else
  ``ClusterUnavailable`` says what is missing.
* ``SlurmCluster(nodes, cpus, gpus)``: ``nodes`` emulated nodes (``node1`` ..) on this
  host (``NodeAddr=127.0.0.1``, one slurmd each on its own port, ``slurmd -N``), each
  declaring ``cpus`` CPUs and ``gpus`` GPUs. GPUs are count-only: slurm 22.05 drops a
  GPU without a device file, so gres.conf names symlinks to /dev/null. The node's
  real hardware is not checked (``SlurmdParameters=config_overrides``); no cgroups, no
  accounting. Every daemon gets a port the OS found free, so several clusters (and the
  machine's own SLURM, if any) can coexist.
* ``env``: the environment for client commands and jobs (``SLURM_CONF`` set, any
  ``SLURM_*`` of an enclosing job removed); ``run``, ``sbatch``, ``wait`` and
  ``requeue`` use it.
"""
from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "munge", "slurm-client")
BINARIES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "munged": "munge", "sbatch": "slurm-client",
            "sinfo": "slurm-client", "scontrol": "slurm-client"}
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be installed or started here (the message says why)."""


def _missing() -> list[str]:
    return sorted({pkg for binary, pkg in BINARIES.items() if shutil.which(binary) is None})


def ensure_packages() -> str:
    """Install the missing packages (as root, with apt-get); returns what was done."""
    missing = _missing()
    if not missing:
        return "packages present"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"SLURM packages missing ({', '.join(missing)}); install them as root: "
                                 f"apt-get install -y {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    t0 = time.monotonic()
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if out.returncode != 0:
            raise ClusterUnavailable(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    if _missing():
        raise ClusterUnavailable(f"still missing after apt-get install: {', '.join(_missing())}")
    return f"installed {' '.join(PACKAGES)} with apt-get in {time.monotonic() - t0:.0f}s"


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    def __init__(self, nodes: int = 2, cpus: int = 64, gpus: int = 8, memory_mb: int = 64000) -> None:
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.cpus, self.gpus, self.memory_mb = cpus, gpus, memory_mb
        self.root = Path(tempfile.mkdtemp(prefix="tlt-slurm-"))  # short: munge's socket path has a length limit
        self.conf = self.root / "slurm.conf"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env["SLURM_CONF"] = str(self.conf)
        self._pid_files: list[Path] = []

    # ---- life ---------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        self._write_config()
        self._daemon(["munged", "--force", f"--socket={self.root / 'munge.sock'}",
                      f"--key-file={self.root / 'munge.key'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                      f"--pid-file={self.root / 'munged.pid'}", f"--seed-file={self.root / 'munged.seed'}"],
                     self.root / "munged.pid")
        self._daemon(["slurmctld", "-f", str(self.conf), "-i"], self.root / "slurmctld.pid")
        for node in self.nodes:
            self._daemon(["slurmd", "-f", str(self.conf), "-N", node], self.root / f"slurmd.{node}.pid")
        self._wait_idle(timeout_s)
        return self

    def stop(self) -> None:
        self.run(["scancel", "-u", getpass.getuser()], check=False)
        deadline = time.monotonic() + 20.0  # let the slurmds end their jobs' processes
        while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
            time.sleep(0.2)
        for pid_file in reversed(self._pid_files):  # slurmds, then slurmctld, then munged
            pid = self._pid(pid_file)
            if pid is not None:
                _terminate(pid)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- clients --------------------------------------------------------------
    def run(self, cmd: list[str], check: bool = True, timeout: float = 60.0, **kw) -> subprocess.CompletedProcess:
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout, **kw)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def sbatch(self, script: str | Path, *args: str, options: list[str] = (), cwd: str | Path | None = None) -> int:
        out = self.run(["sbatch", "--parsable", *options, str(script), *args], cwd=cwd)
        return int(out.stdout.strip().split(";")[0])

    def requeue(self, job: int) -> None:
        """Requeue `job` and make it eligible at once (SLURM delays a requeued job's start
        by about two minutes)."""
        self.run(["scontrol", "requeue", str(job)])
        self.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])

    def state(self, job: int) -> str:
        out = self.run(["scontrol", "show", "job", "-o", str(job)])
        m = re.search(r"JobState=(\S+)", out.stdout)
        return m.group(1) if m else "UNKNOWN"

    def wait(self, job: int, timeout_s: float) -> str:
        """The job's final state; TimeoutError (after cancelling it) if it does not end in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in FINAL_STATES:
                return state
            time.sleep(0.5)
        self.run(["scancel", str(job)], check=False)
        raise TimeoutError(f"job {job} did not end within {timeout_s:.0f}s (state {self.state(job)})")

    def log(self, name: str, tail: int | None = 4000) -> str:
        """A daemon's log (munged, slurmctld, slurmd.node1, ...): its last `tail` characters
        (for failure messages), or all of it (``tail=None``)."""
        path = self.root / "log" / f"{name}.log"
        if not path.is_file():
            return f"(no {path.name})"
        text = path.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    # ---- internals -------------------------------------------------------------
    def _write_config(self) -> None:
        (self.root / "log").mkdir()
        (self.root / "state").mkdir()
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        dev = self.root / "dev"
        dev.mkdir()
        for i in range(self.gpus):
            (dev / f"gpu{i}").symlink_to("/dev/null")  # a character device: 22.05 keeps the GPU
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True)
        host, user = socket.gethostname().split(".")[0], getpass.getuser()
        ports = _free_ports(1 + len(self.nodes))
        r = self.root
        lines = [
            "ClusterName=tlttest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ports[0]}",
            f"SlurmUser={user}", f"SlurmdUser={user}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={r / 'munge.sock'}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd'}.%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd'}.%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none",
            "MpiDefault=none", "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "ReturnToService=2", "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none", "GresTypes=gpu", "SlurmctldTimeout=30", "SlurmdTimeout=30",
            "InactiveLimit=0", "KillWait=10", "MinJobAge=600", "SchedulerParameters=sched_interval=2",
        ]
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        for node, port in zip(self.nodes, ports[1:]):
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                         f"RealMemory={self.memory_mb}{gres} State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        gres_conf = f"Name=gpu File={dev}/gpu[0-{self.gpus - 1}]\n" if self.gpus else ""
        (self.root / "gres.conf").write_text(gres_conf)

    def _daemon(self, cmd: list[str], pid_file: Path) -> None:
        """Start a daemon that forks into the background and writes `pid_file`."""
        self._pid_files.append(pid_file)
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60)
        if out.returncode != 0:
            raise ClusterUnavailable(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = f"idle {len(self.nodes)}"
        seen = ""
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-o", "%T %D"], check=False)
            seen = out.stdout.strip() or out.stderr.strip()
            if seen == want:
                return
            time.sleep(0.2)
        raise ClusterUnavailable(f"the nodes did not become idle within {timeout_s:.0f}s (sinfo: {seen!r})\n"
                                 f"slurmctld log:\n{self.log('slurmctld')}\nslurmd log:\n{self.log('slurmd.node1')}")

    @staticmethod
    def _pid(pid_file: Path) -> int | None:
        try:
            return int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return None


def _terminate(pid: int, grace_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not re.search(r"^State:\s+Z", status, re.M)
