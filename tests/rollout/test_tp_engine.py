"""The torch rollout engine at tensor parallel size 2 on two CPU ranks (gloo).

One launch runs every scenario on both ranks (a launch costs seconds); the tests read
its results. The demo target (16 layers, a vocabulary of 57: uneven at TP 2) with its
trained EAGLE-2 drafter checks decoding; a transformers ``save_pretrained`` folder checks
loading."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_tlt.demo.shipped_assets import SHIPPED_DIR
from nemo_tlt.demo.tokenizer import CharTokenizer
from ranks import launch_forked
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.drafter.medusa import MedusaConfig, MedusaDrafter
from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.device import Placement
from nemo_tlt.model.hf_io import load_hf_folder, read_config
from nemo_tlt.model.safetensors_folder import SafetensorsFolder
from nemo_tlt.model.tensor_parallel import TensorParallel
from nemo_tlt.model.tp_layout import rollout_slice
from nemo_tlt.rollout.config import RolloutConfig
from nemo_tlt.rollout.factory import build_rollout_engine
from nemo_tlt.rollout.kv_admission import engine_slot_bytes
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.rollout.weight_load import load_tp_source
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape

PROMPTS = ("3+5-2+7=", "sort:3,1,2=", "a:baac=", "8+1+1-5+3-2=")
SHAPE, OTHER = TreeShape(4, 2, 6), TreeShape(2, 2, 3)
GREEDY = SamplingParams(max_new_tokens=32)
SHORT = SamplingParams(max_new_tokens=10)  # greedy: a prefix of GREEDY's tokens
COUPLED = SamplingParams(mode="coupled", temperature=1.0, max_new_tokens=32, seed=7)


def _requests() -> list[Request]:
    tok = CharTokenizer()
    return [Request(tuple(tok.encode(p, add_bos=True))) for p in PROMPTS]


def _tokens(engine, sampling, policy=None, **kw) -> tuple[list[list[int]], object]:
    out = engine.generate(_requests(), sampling, policy=policy, **kw)
    return [r.tokens for r in out.results], out.stats


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _loading(tp: TensorParallel, hf: str) -> dict:
    engine = TorchRolloutEngine.from_hf_folder(hf, tp=tp)
    full = load_hf_folder(hf).state_dict()
    local = engine.target.state_dict()
    source = SafetensorsFolder(hf)
    load_tp_source(source, read_config(hf), tp, "cpu", torch.float32)
    out = dict(equal=all(torch.equal(v, rollout_slice(k, full[k], tp.size, tp.rank)) for k, v in local.items()),
               keys=sorted(local) == sorted(full), numel=sum(v.numel() for v in local.values()),
               bytes_read=source.bytes_read, full_numel=sum(v.numel() for v in full.values()))
    # policy weights: whole tensors and this rank's slices give the same model
    new = {k: v * 1.5 for k, v in full.items()}
    engine.load_policy_weights(new)
    from_full = {k: v.clone() for k, v in engine.target.state_dict().items()}
    engine.load_policy_weights([(k, rollout_slice(k, v, tp.size, tp.rank)) for k, v in new.items()])
    out["weights_same"] = all(torch.equal(from_full[k], v) for k, v in engine.target.state_dict().items())
    out["weights_new"] = all(torch.equal(v, rollout_slice(k, new[k], tp.size, tp.rank)) for k, v in from_full.items())
    out["wrong_shape"] = _error(lambda: engine.load_policy_weights({"model.layers.0.mlp.up_proj.weight":
                                                                    torch.zeros(3, 3)}))
    # the factory: a bf16 TP engine computing in fp32; TensorRT-LLM with TP refused
    bf16 = build_rollout_engine(RolloutConfig(compute_dtype="float32"), hf, Placement.cpu(torch.bfloat16), tp)
    bf16.generate([Request((1, 5, 7))], SamplingParams(max_new_tokens=4))
    out["factory"] = (bf16.tp is tp, bf16.weights_dtype, bf16.compute_dtype, bf16.target.tp is tp,
                      torch.equal(bf16.target.model.norm.weight, full["model.norm.weight"].bfloat16().float()))
    out["trtllm"] = _error(lambda: build_rollout_engine(RolloutConfig(engine="trtllm"), hf, Placement(), tp))
    return out


def _decoding(tp: TensorParallel, target: str, drafter: str) -> dict:
    engine = TorchRolloutEngine.from_hf_folder(target, load_drafter(drafter), tp=tp)
    out = {"plain": _tokens(engine, GREEDY)[0]}
    out["sd"], stats = _tokens(engine, GREEDY, FixedSDPolicy(SHAPE))
    out["sd_steps"], out["accept"] = stats.sd_steps, stats.mean_accept_len
    out["coupled_plain"] = _tokens(engine, COUPLED)[0]
    out["coupled_sd"], stats = _tokens(engine, COUPLED, FixedSDPolicy(SHAPE))
    out["coupled_sd_steps"] = stats.sd_steps
    # rank 1's policy would choose another tree: rank 0's choice runs on both
    policy = FixedSDPolicy(SHAPE if tp.rank == 0 else OTHER)
    out["lead"], stats = _tokens(engine, SHORT, policy)
    out["lead_shapes"] = [t.shape for t in stats.trace]
    # rank 1 tampers with a finished result: every rank raises
    def tamper(i, result):
        if tp.rank == 1 and i == 2:
            result.tokens[-1] += 1
    out["tampered"] = _error(lambda: engine.generate(_requests(), SHORT, on_finish=tamper))
    # rollout.kv_cache_fraction: each rank reads its own free memory (rank 1 more), both take rank 0's
    import nemo_tlt.rollout.kv_limit as kv_limit
    row = (max(len(r.prompt) for r in _requests()) + GREEDY.max_new_tokens) * engine_slot_bytes(engine.target,
                                                                                                 engine.drafter)
    read, kv_limit.free_bytes = kv_limit.free_bytes, lambda device: 2 * (2 + tp.rank) * row  # 2 rows / 3 rows
    engine.kv_limit = kv_limit.KVLimit(fraction=0.5)
    try:
        out["fraction"], stats = _tokens(engine, GREEDY, FixedSDPolicy(SHAPE))
    finally:
        kv_limit.free_bytes, engine.kv_limit = read, kv_limit.KVLimit()
    out["fraction_budget"], out["fraction_prefills"] = engine.last_kv_budget.bytes // row, stats.prefill_forwards
    # the other drafters, replicated on every rank
    cfg = engine.model_config
    torch.manual_seed(0)
    for name, d in (("eagle3", Eagle3Drafter(Eagle3Config.from_target(cfg))),
                    ("medusa", MedusaDrafter(MedusaConfig(cfg.hidden_size, cfg.vocab_size)))):
        engine.load_drafter(d)
        out[name], stats = _tokens(engine, SHORT, FixedSDPolicy(TreeShape(3, 2, 4)))
        out[name + "_steps"] = stats.sd_steps
    # a rank whose last weight load failed midway stops every rank
    if tp.rank == 1:
        _error(lambda: engine.load_policy_weights([("model.norm.weight", torch.ones(cfg.hidden_size)),
                                                   ("nope", torch.ones(1))]))
    out["half_loaded"] = _error(lambda: engine.generate(_requests(), SHORT))
    return out


def _worker(ctx, hf: str, target: str, drafter: str) -> dict:
    tp = TensorParallel.of_group(dist.group.WORLD)
    out = {"loading": _loading(tp, hf), "decoding": _decoding(tp, target, drafter)}
    if tp.rank == 0:  # the reference: the whole model in one process
        engine = TorchRolloutEngine.from_hf_folder(target)
        out["tp1"] = _tokens(engine, GREEDY)[0]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    transformers = pytest.importorskip("transformers")  # here: the ranks import this module without it
    hf_cfg = transformers.LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    folder = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(folder)
    return launch_forked(_worker, 2, str(folder), str(SHIPPED_DIR / "target"), str(SHIPPED_DIR / "drafter"),
                        timeout_s=150)


@pytest.mark.timeout(180)
def test_from_hf_folder_reads_only_this_ranks_slices(ranks):
    full_numel = ranks[0]["loading"]["full_numel"]
    norms = (2 * 2 + 1) * 32
    for r in ranks:
        assert r["loading"]["equal"] and r["loading"]["keys"]
        assert r["loading"]["bytes_read"] == 4 * r["loading"]["numel"]  # fp32 file: its slices, once
    assert ranks[0]["loading"]["numel"] + ranks[1]["loading"]["numel"] == full_numel + norms
    assert ranks[0]["loading"]["numel"] < full_numel * 0.6


@pytest.mark.timeout(180)
def test_policy_weights_whole_or_sliced_give_the_same_model(ranks):
    for r in ranks:
        assert r["loading"]["weights_new"] and r["loading"]["weights_same"]
        assert "model.layers.0.mlp.up_proj.weight" in r["loading"]["wrong_shape"]
        assert "(3, 3)" in r["loading"]["wrong_shape"]


@pytest.mark.timeout(180)
def test_the_factory_passes_tp_and_refuses_trtllm_with_tp(ranks):
    for r in ranks:
        assert r["loading"]["factory"] == (True, torch.bfloat16, torch.float32, True, True)
        assert "rollout.tensor_parallel > 1 with rollout.engine=trtllm is not built" in r["loading"]["trtllm"]


@pytest.mark.timeout(180)
def test_tp2_greedy_equals_tp1_plain_and_sd(ranks):
    d0, d1 = ranks[0]["decoding"], ranks[1]["decoding"]
    assert d0["sd_steps"] > 0 and d0["accept"] > 1.5  # the trained drafter speculated
    assert d0["plain"] == ranks[0]["tp1"]
    for d in (d0, d1):
        assert d["plain"] == d0["plain"] and d["sd"] == d0["plain"]


@pytest.mark.timeout(180)
def test_tp2_coupled_sd_equals_tp2_coupled_plain(ranks):
    d0, d1 = ranks[0]["decoding"], ranks[1]["decoding"]
    assert d0["coupled_sd_steps"] > 0
    assert d0["coupled_sd"] == d0["coupled_plain"] == d1["coupled_sd"] == d1["coupled_plain"]
    assert d0["coupled_plain"] != d0["plain"]  # sampling did sample


@pytest.mark.timeout(180)
def test_the_sd_choice_is_tp_rank_0s_and_divergence_raises(ranks):
    d0, d1 = ranks[0]["decoding"], ranks[1]["decoding"]
    assert d0["lead"] == d1["lead"] == [t[:SHORT.max_new_tokens] for t in d0["plain"]]
    assert d1["lead_shapes"] == d0["lead_shapes"] and set(d0["lead_shapes"]) == {SHAPE.name}
    for d in (d0, d1):
        assert "TP ranks [1]" in d["tampered"] and "diverged" in d["tampered"]


@pytest.mark.timeout(180)
def test_a_kv_fraction_gives_every_rank_the_smallest_free_memorys_budget(ranks):
    d0, d1 = ranks[0]["decoding"], ranks[1]["decoding"]
    assert d0["fraction_budget"] == d1["fraction_budget"] == 2  # rows of the longest request: rank 0's
    assert d0["fraction_prefills"] == d1["fraction_prefills"] == 2  # 4 requests in waves of 2
    assert d0["fraction"] == d1["fraction"] == d0["plain"]


@pytest.mark.timeout(180)
def test_eagle3_and_medusa_draft_in_lockstep(ranks):
    d0, d1 = ranks[0]["decoding"], ranks[1]["decoding"]
    for name in ("eagle3", "medusa"):
        assert d0[name + "_steps"] > 0
        assert d0[name] == d1[name] == [t[:SHORT.max_new_tokens] for t in d0["plain"]]


@pytest.mark.timeout(180)
def test_a_half_loaded_rank_stops_every_rank(ranks):
    assert "half-written" in ranks[1]["decoding"]["half_loaded"]
    assert "TP ranks [1]" in ranks[0]["decoding"]["half_loaded"]
