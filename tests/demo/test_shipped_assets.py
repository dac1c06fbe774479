"""The demo models shipped as package data: they match the code's configuration, load
without training, and the drafter accepts what the manifest states on the target."""
from __future__ import annotations

import shutil

import pytest
import torch

from nemo_tlt.demo.prepare import PROBE
from nemo_tlt.model.config import LMConfig
from nemo_tlt.demo import assets as assets_mod
from nemo_tlt.demo.assets import AssetConfig, Assets, drafter_name, load_assets, measure_acceptance, prepare_assets
from nemo_tlt.demo.sft import SFTConfig, warm_start_name
from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, read_manifest, shipped_folder, write_shipped
from nemo_tlt.demo.tasks import TaskConfig
from nemo_tlt.drafter.train import DrafterTrainConfig
from nemo_tlt.speculative.tree_shape import TreeShape

# What the README promises of the shipped drafter: greedy SD with the tree 6_2_12
# accepts at least this many tokens per verify step on held-out task prompts.
STATED_MIN_ACCEPT_LEN = 4.0


@pytest.fixture(scope="module")
def manifest():
    found = read_manifest()
    assert found is not None, f"no shipped demo assets at {SHIPPED_DIR}; run `nemo-tlt prepare --rebuild --ship`"
    return found


def test_shipped_names_match_the_code_configuration(manifest):
    """A change to AssetConfig, the SFT recipe or LMConfig's fields changes these names:
    the shipped models must then be rebuilt rather than silently disagree."""
    config = AssetConfig()
    target = warm_start_name(config.target, config.task, config.sft, config.sft_examples)
    assert manifest["assets"]["target"]["name"] == target
    assert manifest["assets"]["assistant"]["name"] == warm_start_name(
        config.assistant, config.task, config.sft, config.sft_examples)
    assert manifest["assets"]["drafter"]["name"] == drafter_name(target, config)


def test_shipped_assets_load_without_training(tmp_path, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("prepare_assets trained although the shipped models match")

    monkeypatch.setattr(assets_mod, "cached_warm_start", no_training)
    monkeypatch.setattr(assets_mod, "_train_drafter_on_target", no_training)
    found = prepare_assets(AssetConfig(), tmp_path, progress=False)
    assert found.target_dir == SHIPPED_DIR / "target"
    assert found.drafter_dir == SHIPPED_DIR / "drafter"
    assert found.assistant_dir == SHIPPED_DIR / "assistant"
    target, _ = load_assets(found)
    assert target.config == AssetConfig().target
    assert not any(tmp_path.iterdir())


def test_shipped_drafter_accepts_the_stated_length(manifest):
    recorded = manifest["acceptance"]
    assert {k: recorded[k] for k in PROBE} == PROBE
    assert recorded["mean_accept_len"] >= STATED_MIN_ACCEPT_LEN
    target, drafter = load_assets(Assets(SHIPPED_DIR / "target", SHIPPED_DIR / "drafter", SHIPPED_DIR / "assistant"))
    measured = measure_acceptance(target, drafter, AssetConfig().task, TreeShape.parse(PROBE["shape"]),
                                  PROBE["num_prompts"], PROBE["max_new_tokens"], PROBE["seed"])
    # greedy and deterministic: only float rounding across thread counts can move it
    assert measured["mean_accept_len"] == pytest.approx(recorded["mean_accept_len"], rel=0.05)


def test_damaged_shipped_file_is_refused(tmp_path, manifest):
    root = tmp_path / "assets"
    shutil.copytree(SHIPPED_DIR, root)
    path = root / "drafter" / "drafter.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="drafter.safetensors: contents differ"):
        shipped_folder("drafter", manifest["assets"]["drafter"]["name"], root)
    assert shipped_folder("target", manifest["assets"]["target"]["name"], root) == root / "target"


def _tiny_config() -> AssetConfig:
    lm = dict(vocab_size=AssetConfig().target.vocab_size, hidden_size=32, intermediate_size=64, num_heads=4,
              num_kv_heads=2, max_position_embeddings=160)
    return AssetConfig(target=LMConfig(num_layers=2, **lm), assistant=LMConfig(num_layers=1, **lm),
                       task=TaskConfig(name="arith", max_solution_chars=60),
                       sft=SFTConfig(steps=3, batch_size=4, warmup_steps=1, seq_len=128), sft_examples=16,
                       drafter_prompts=4, drafter_max_new_tokens=8, drafter_data=(("greedy", 1.0, 0),),
                       drafter_train=DrafterTrainConfig(steps=2, batch_size=2, warmup_steps=0))


def test_rebuilt_assets_ship_and_are_found_again(tmp_path, monkeypatch):
    """`prepare --rebuild --ship` in small: trained assets written as package data are
    picked up for the same configuration only."""
    config = _tiny_config()
    built = prepare_assets(config, tmp_path / "cache", progress=False, shipped=False)
    assert built.target_dir.parent == tmp_path / "cache"
    out = write_shipped({"target": built.target_dir, "assistant": built.assistant_dir,
                         "drafter": built.drafter_dir}, tmp_path / "ship", {"note": "tiny"})
    monkeypatch.setattr(assets_mod, "shipped_folder", lambda role, name: shipped_folder(role, name, out))
    found = prepare_assets(config, tmp_path / "empty", progress=False)
    assert (found.target_dir, found.drafter_dir) == (out / "target", out / "drafter")
    assert not (tmp_path / "empty").exists()
    t1, d1 = load_assets(built)
    t2, d2 = load_assets(found)
    for a, b in zip(list(t1.state_dict().values()) + list(d1.state_dict().values()),
                    list(t2.state_dict().values()) + list(d2.state_dict().values())):
        assert torch.equal(a, b)
    other = AssetConfig(**{**config.__dict__, "sft_examples": 17})
    assert shipped_folder("target", warm_start_name(other.target, other.task, other.sft, other.sft_examples),
                          out) is None


def test_the_shipped_eagle3_drafter_is_checked_against_its_record(tmp_path):
    from nemo_tlt.demo.shipped_assets import EAGLE3_DIR, shipped_eagle3_drafter
    from nemo_tlt.drafter.io import load_drafter

    folder = shipped_eagle3_drafter()
    assert load_drafter(folder).kind == "eagle3"
    shutil.copytree(SHIPPED_DIR / EAGLE3_DIR, tmp_path / EAGLE3_DIR)
    damaged = tmp_path / EAGLE3_DIR / "drafter.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match="drafter.safetensors"):
        shipped_eagle3_drafter(tmp_path)
