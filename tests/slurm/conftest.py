"""`slurm_cluster`: one real SLURM cluster per test session (tests/slurm/cluster.py).

Eight emulated nodes on this host, each declaring 64 CPUs and 8 GPUs (count-only), so
the 4- and 8-node H100 scripts pass ``sbatch --test-only`` and the CPU jobs run.
Missing Debian packages are installed (apt-get, as root). A cluster that cannot start
skips the tests with the reason, except under ``CI=true``, where it fails them: CI
must not turn green by skipping the cluster.
"""
from __future__ import annotations

import os

import pytest

from .cluster import ClusterUnavailable, SlurmCluster, ensure_packages

NODES = 8


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"SLURM test cluster unavailable under CI=true: {reason}", pytrace=False)
    pytest.skip(f"SLURM test cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def slurm_cluster():
    cluster, reason = None, ""
    try:
        ensure_packages()
        cluster = SlurmCluster(nodes=NODES).start()
    except ClusterUnavailable as err:
        reason = str(err)
    if cluster is None:
        _unavailable(reason)
    try:
        yield cluster
    finally:
        cluster.stop()
