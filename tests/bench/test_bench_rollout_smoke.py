"""`nemo-tlt bench rollout` (both workloads) end to end on tiny cached assets."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import nemo_tlt.bench.longtail as longtail
import nemo_tlt.bench.rollout as rollout
from nemo_tlt.demo.assets import AssetConfig
from nemo_tlt.drafter.train import DrafterTrainConfig
from nemo_tlt.model.config import LMConfig
from nemo_tlt.demo.sft import SFTConfig
from nemo_tlt.demo.tasks import TaskConfig

pytest.importorskip("transformers")


def tiny_assets() -> AssetConfig:
    lm = dict(vocab_size=57, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
              max_position_embeddings=160)
    return AssetConfig(target=LMConfig(num_layers=2, **lm), assistant=LMConfig(num_layers=1, **lm),
                       task=TaskConfig(name="arith", max_solution_chars=100),
                       sft=SFTConfig(steps=4, batch_size=4, warmup_steps=1, seq_len=160), sft_examples=16,
                       drafter_prompts=4, drafter_max_new_tokens=24,
                       drafter_train=DrafterTrainConfig(steps=3, batch_size=4, warmup_steps=1))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One asset cache for the module: the assets' folders are named by their configs, so the
    tests that ask for the same assets train them once."""
    return tmp_path_factory.mktemp("bench_rollout_cache")


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    monkeypatch.setattr(rollout, "AssetConfig", tiny_assets)
    monkeypatch.setattr(longtail, "AssetConfig", tiny_assets)
    return tmp_path


def test_default_workload(tiny, cache):
    out = tiny / "r.json"
    assert rollout.main(["--out", str(out), "--num-prompts", "2", "--max-new-tokens", "12", "--shape", "3_2_4",
                         "--cache-dir", str(cache)]) == 0
    payload = json.loads(out.read_text())
    assert set(payload["results"]) == {"plain", "sd_greedy", "sd_rejection", "sd_coupled", "hf_generate",
                                       "hf_assisted", "plain_rejection", "plain_coupled"}
    assert payload["coupled_outputs_identical"] is True
    for r in payload["results"].values():
        assert {"tokens_per_s", "target_forwards_per_token", "mean_accept_len", "wall_s"} <= set(r)
    assert payload["greedy_outputs_identical"] is True
    assert payload["results"]["sd_greedy"]["target_forwards_per_token"] < 1.0
    assert_accept_len_matches_forward_counts(payload["results"], num_prompts=2)


def assert_accept_len_matches_forward_counts(results: dict, num_prompts: int) -> None:
    """At batch size 1 every target forward holds one sequence, so for every method
    mean_accept_len = (tokens - P) / (target_forwards - P), P the prefill-only forwards:
    one per prompt, except HF assisted generation, whose first forward also verifies."""
    for name, r in results.items():
        prefill_only = 0 if name == "hf_assisted" else num_prompts
        forwards = round(r["target_forwards_per_token"] * r["tokens"])
        assert r["mean_accept_len"] == pytest.approx((r["tokens"] - prefill_only) / (forwards - prefill_only),
                                                     rel=1e-12), name
        assert r["prefill_only_rows"] == prefill_only and r["target_forwards"] == forwards, name
        if name.startswith(("plain", "hf_generate")):
            assert r["mean_accept_len"] == 1.0, name  # one token per decode forward
        else:
            assert r["mean_accept_len"] >= 1.0, name  # a verification keeps at least the target's own token


def test_longtail_workload(tiny, cache):
    out = tiny / "lt.json"
    torch.set_num_threads(2)  # the conftest fixture sets 1 again after the test
    threads = 1  # differs from the current count, so --threads must act; 1 keeps the run cheap
    assert rollout.main(["--workload", "longtail", "--out", str(out), "--num-prompts", "3", "--group-size", "2",
                         "--max-new-tokens", "16", "--arms", "2_1_2,3_2_4", "--threshold-on", "3",
                         "--threshold-off", "4", "--bucket-edges", "2", "--threads", str(threads),
                         "--cache-dir", str(cache)]) == 0
    payload = json.loads(out.read_text())
    assert payload["machine"]["torch_threads"] == threads
    assert {"longtail_plain", "longtail_fixed_2_1_2", "longtail_fixed_3_2_4", "longtail_control",
            "longtail_adaptive"} == set(payload["results"])
    assert payload["outputs_identical"] is True
    assert payload["trace"] and (tiny / "lt.png").is_file()
    assert all(len(r["wall_s_rounds"]) == 5 for r in payload["results"].values())
    assert 0.0 <= payload["step_time_exponent"] <= 1.0 and payload["headroom"]["oracle_vs_best_fixed"] <= 1.0


@pytest.mark.parametrize("policy", ["learned", "threshold"])
def test_longtail_untrained_drafter_size_seed_temperature_and_policy(tiny, cache, policy):
    out = tiny / f"lt_{policy}.json"
    assert rollout.main(["--workload", "longtail", "--out", str(out), "--num-prompts", "2", "--group-size", "3",
                         "--max-new-tokens", "12", "--arms", "2_1_2,3_2_4", "--drafter", "untrained",
                         "--policy", policy, "--seed", "7", "--temperature", "0.7", "--repeats", "3",
                         "--cache-dir", str(cache)]) == 0
    payload = json.loads(out.read_text())
    assert payload["outputs_identical"] is True
    cfg = payload["config"]
    assert (cfg["drafter"], cfg["policy"], cfg["seed"], cfg["temperature"]) == ("untrained", policy, 7, 0.7)
    assert cfg["bucket_edges"] == ("2,4,8,16,32,64,128" if policy == "learned" else "2,4,8,16")
    assert sum(1 for t in payload["trace"]) and len(payload["ratios_rounds"]["adaptive_vs_plain"]) == 3
    ada = payload["results"]["longtail_adaptive"]["wall_s_rounds"]
    plain = payload["results"]["longtail_plain"]["wall_s_rounds"]
    assert payload["ratios_rounds"]["adaptive_vs_plain"] == pytest.approx([a / b for a, b in zip(ada, plain)])
    assert set(payload["noise"]) == set(payload["results"]) and all(v >= 0 for v in payload["noise"].values())
    assert payload["headroom"]["oracle_with_plain_vs_best_fixed"] <= payload["headroom"]["oracle_vs_best_fixed"]
    seconds = payload["headroom"]["bucket_seconds"]
    assert set(seconds) == {"plain", "adaptive", "2_1_2", "3_2_4"}
    assert sum(seconds["adaptive"].values()) == pytest.approx(payload["headroom"]["adaptive_steps_s"])
    assert payload["bandit"]
    if policy == "learned":  # the same run with the demo drafter drafts differently
        trained = tiny / "lt_trained.json"
        assert rollout.main(["--workload", "longtail", "--out", str(trained), "--num-prompts", "2", "--group-size",
                             "3", "--max-new-tokens", "12", "--arms", "2_1_2,3_2_4", "--seed", "7", "--temperature",
                             "0.7", "--repeats", "1", "--cache-dir", str(cache)]) == 0
        accept = {n: r["mean_accept_len"] for n, r in json.loads(trained.read_text())["results"].items()}
        assert accept["longtail_fixed_2_1_2"] != payload["results"]["longtail_fixed_2_1_2"]["mean_accept_len"]


def test_longtail_warm_keeps_one_policy_across_rounds_and_reports_both(tiny, cache, monkeypatch):
    made = []
    make = longtail.make_adaptive
    monkeypatch.setattr(longtail, "make_adaptive", lambda args: made.append(make(args)) or made[-1])
    out = tiny / "warm.json"
    assert rollout.main(["--workload", "longtail", "--out", str(out), "--num-prompts", "2", "--group-size", "2",
                         "--max-new-tokens", "12", "--arms", "2_1_2,3_2_4", "--warm", "--warm-up", "2",
                         "--repeats", "3", "--cache-dir", str(cache)]) == 0
    payload = json.loads(out.read_text())
    assert len(made) == 3 + 1  # a fresh policy per cold round, one kept for the warm rounds
    warm = made[0]  # made before the rounds; it decoded 2 warm-up rollouts and 3 rounds
    assert warm.state_dict() != type(warm)(warm.config).state_dict()
    assert set(payload["ratios_warm"]) == {"adaptive_vs_best_fixed", "adaptive_vs_plain"}
    assert {"adaptive_vs_best_fixed", "adaptive_vs_plain"} <= set(payload["ratios"])
    res = payload["results"]
    best = res[payload["ratios"]["best_fixed"]]["wall_s"]
    assert payload["ratios_warm"]["adaptive_vs_best_fixed"] == pytest.approx(
        res["longtail_adaptive_warm"]["wall_s"] / best)
    assert payload["ratios_warm"]["adaptive_vs_plain"] == pytest.approx(
        res["longtail_adaptive_warm"]["wall_s"] / res["longtail_plain"]["wall_s"])
    assert len(payload["ratios_warm_rounds"]["adaptive_vs_plain"]) == 3 and payload["trace_warm"]
    cpu = {n: sorted(r["cpu_s_rounds"])[1] for n, r in res.items()}  # the median of 3
    assert payload["ratios_warm_cpu"]["adaptive_vs_plain"] == pytest.approx(
        cpu["longtail_adaptive_warm"] / cpu["longtail_plain"])
    assert payload["ratios_cpu"]["adaptive_vs_best_fixed"] == pytest.approx(
        cpu["longtail_adaptive"] / cpu[payload["ratios_cpu"]["best_fixed"]])
    assert payload["control_of"] == "longtail_fixed_2_1_2"
    assert payload["ratios_warm_cpu"]["control"] == pytest.approx(cpu["longtail_control"] / cpu["longtail_fixed_2_1_2"])
    for key in ("ratios_cpu", "ratios_warm_cpu"):
        spans = payload[f"{key}_interval"]
        assert set(spans) == {"adaptive_vs_best_fixed", "adaptive_vs_plain", "control"}
        assert all(lo <= payload[key][k] <= hi for k, (lo, hi) in spans.items())
    assert payload["outputs_identical"] is True


def _rounds(**walls):
    return {name: [({"cpu_s": w}, None) for w in ws] for name, ws in walls.items()}


def test_median_ratios_choose_the_best_fixed_arm_on_the_rounds_given_and_carry_the_control():
    rounds = _rounds(longtail_plain=[4.0, 4.0, 4.0], longtail_fixed_a=[2.0, 2.2, 1.0],
                     longtail_fixed_b=[2.1, 2.1, 2.1], longtail_control=[2.2, 2.4, 1.2],
                     longtail_adaptive=[2.0, 2.0, 2.0])
    r = longtail.median_ratios(rounds, "cpu_s", "longtail_adaptive")
    assert r["best_fixed"] == "longtail_fixed_a" and r["adaptive_vs_best_fixed"] == pytest.approx(1.0)
    assert r["control"] == pytest.approx(2.2 / 2.0) and r["adaptive_vs_plain"] == pytest.approx(0.5)
    r = longtail.median_ratios(rounds, "cpu_s", "longtail_adaptive", idx=np.array([0, 1, 1]))
    assert r["best_fixed"] == "longtail_fixed_b" and r["adaptive_vs_best_fixed"] == pytest.approx(2.0 / 2.1)
    spans = longtail.ratio_intervals(rounds, "cpu_s", "longtail_adaptive", seed=0)
    assert spans["adaptive_vs_plain"] == [0.5, 0.5]  # the same in every round
    lo, hi = spans["adaptive_vs_best_fixed"]
    assert lo == pytest.approx(2.0 / 2.1) and hi == pytest.approx(2.0)  # resamples with round 3 twice: a at 1.0


def test_untrained_drafter_differs_from_the_trained_one_and_is_seeded():
    from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
    from nemo_tlt.model.config import LMConfig as C
    trained = EagleDrafter(EagleConfig(C(vocab_size=57, hidden_size=32, intermediate_size=64, num_heads=2,
                                         num_kv_heads=1, num_layers=1)))
    with torch.no_grad():
        trained.fc.weight.add_(1.0)
    a, b = longtail.untrained_like(trained, 3), longtail.untrained_like(trained, 3)
    assert torch.equal(a.fc.weight, b.fc.weight) and not torch.equal(a.fc.weight, trained.fc.weight)
    assert not torch.equal(longtail.untrained_like(trained, 4).fc.weight, a.fc.weight)


def test_median_round_is_the_middle_wall_time():
    rounds = [({"wall_s": w}, f"trace{w}") for w in (3.0, 1.0, 5.0, 2.0)]
    assert longtail.median_round(rounds) == ({"wall_s": 2.0}, "trace2.0")   # lower middle of 4
    assert longtail.median_round(rounds[:3]) == ({"wall_s": 3.0}, "trace3.0")


@pytest.mark.parametrize("option", [["--shape", "3_2_4"], ["--batch-size", "4"], ["--no-hf"]],
                         ids=lambda o: o[0])
def test_longtail_refuses_the_default_workloads_options(tiny, capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        rollout.main(["--workload", "longtail", "--out", str(tiny / "x.json"), "--cache-dir", str(tiny / "cache"),
                      *option])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{option[0]} is an option of the default workload" in err and "the longtail workload" in err
    assert not (tiny / "x.json").exists() and not (tiny / "cache").exists()  # refused before any work


def test_bad_shape_is_refused(tiny):
    with pytest.raises(ValueError, match="--shape"):
        rollout.main(["--out", str(tiny / "x.json"), "--shape", "8_4"])


def test_two_drafters_in_one_run_trained_with_the_same_budget(tiny, cache):
    """The kinds by their one name (`eagle2` is accepted for `eagle`, and names it)."""
    out = tiny / "r.json"
    assert rollout.main(["--out", str(out), "--num-prompts", "2", "--max-new-tokens", "12", "--shape", "3_2_4",
                         "--cache-dir", str(cache), "--no-hf", "--drafters", "eagle2,eagle3",
                         "--drafter-steps", "2"]) == 0
    payload = json.loads(out.read_text())
    assert set(payload["results"]) == {"plain", "plain_rejection", "plain_coupled",
                                       *(f"sd_{m}_{d}" for m in ("greedy", "rejection", "coupled")
                                         for d in ("eagle", "eagle3"))}
    for d in ("eagle", "eagle3"):
        assert {"tokens_per_s", "mean_accept_len"} <= set(payload["results"][f"sd_greedy_{d}"])
    assert payload["greedy_outputs_identical"] is True and payload["coupled_outputs_identical"] is True
    drafters = payload["config"]["drafters"]
    assert drafters["eagle"].startswith("drafter-eagle-") and drafters["eagle3"].startswith("drafter-eagle3-")
    for d in ("eagle", "eagle3"):  # both trained here for the same number of steps, saved under their kind
        assert json.loads((cache / drafters[d] / "drafter.json").read_text())["kind"] == d
    with pytest.raises(SystemExit):
        rollout.main(["--out", str(out), "--drafters", "eagle,eagle2"])  # the same kind twice
    assert payload["config"]["drafter_train"]["steps"] == 2


def test_eagle3_layers_choose_the_fused_layers_and_name_their_own_cache(tiny, cache):
    out = tiny / "r3.json"
    args = ["--out", str(out), "--num-prompts", "2", "--max-new-tokens", "12", "--shape", "3_2_4", "--cache-dir",
            str(cache), "--no-hf", "--drafters", "eagle3", "--drafter-steps", "2"]
    assert rollout.main(args + ["--eagle3-layers", "1,0,1"]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["eagle3_capture_layers"] == [1, 0, 1]
    saved = json.loads((cache / config["drafters"]["eagle3"] / "drafter.json").read_text())
    assert saved["capture_layers"] == [1, 0, 1]
    assert rollout.main(args) == 0  # the default layers: another drafter, not the cached one
    assert json.loads(out.read_text())["config"]["drafters"]["eagle3"] != config["drafters"]["eagle3"]
    with pytest.raises(SystemExit):
        rollout.main(["--out", str(out), "--eagle3-layers", "1,2"])  # no eagle3 drafter
    with pytest.raises(SystemExit):
        rollout.main(["--out", str(out), "--drafters", "eagle3", "--eagle3-layers", "1;2"])


def test_unknown_drafter_is_refused(tiny):
    with pytest.raises(SystemExit):
        rollout.main(["--out", str(tiny / "r.json"), "--drafters", "eagle2,medusa"])


def test_longtail_engine_defaults_mode_and_arms():
    torch_args = longtail.parse_args(["--out", "x.json"])
    assert (torch_args.engine, torch_args.mode, torch_args.arms) == ("torch", "coupled", "4_1_4,6_1_6,8_2_16")
    assert torch_args.kv_cache_gib is None
    vllm_args = longtail.parse_args(["--out", "x.json", "--engine", "vllm", "--drafter", "untrained"])
    assert (vllm_args.mode, vllm_args.arms, vllm_args.kv_cache_gib) == ("greedy", "4_1_4,8_1_8,12_1_12", 0.5)
    assert longtail.parse_args(["--out", "x.json", "--engine", "vllm", "--mode", "rejection"]).mode == "rejection"


@pytest.mark.parametrize("flags, message", [
    (["--engine", "vllm", "--mode", "coupled"], "vLLM has no coupled sampling"),
    (["--engine", "vllm", "--arms", "4_1_4,8_2_16"], "8_2_16: vLLM's EAGLE-3 drafts a chain"),
    (["--engine", "vllm", "--kv-cache-gib", "0"], "--kv-cache-gib must be > 0"),
    (["--kv-cache-gib", "0.5"], "--kv-cache-gib is an option of --engine vllm"),
    (["--plain-engine"], "--plain-engine is an option of --engine vllm"),
    (["--arms", "4_1_4,4_1_4"], "--arms lists an arm twice"),
])
def test_longtail_refuses_what_the_engine_cannot_run(tmp_path, capsys, flags, message):
    """Refused by argparse, before any engine (or vLLM) is touched."""
    with pytest.raises(SystemExit):
        rollout.main(["--workload", "longtail", "--out", str(tmp_path / "x.json")] + flags)
    assert message in capsys.readouterr().err
