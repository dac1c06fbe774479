"""Entry points that need megatron-core say so, with the install step, before spawning anything."""
from __future__ import annotations

import importlib.util

import pytest

from nemo_tlt.bench import reshard
from nemo_tlt import convert as convert_cli


@pytest.fixture
def no_megatron(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "megatron" else real(name, *a))


def test_convert_to_torch_dist_names_the_missing_package(no_megatron, tmp_path, capsys):
    rc = convert_cli.main(["--from", "hf", "--to", "torch_dist", "--input", str(tmp_path / "in"),
                           "--output", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "needs megatron-core" in err and '.[megatron]' in err
    assert not (tmp_path / "out").exists()


def test_bench_reshard_names_the_missing_package(no_megatron, tmp_path, capsys):
    assert reshard.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "nemo-tlt bench reshard needs megatron-core" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
