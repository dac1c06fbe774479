"""Memory terms against hand-computed small cases; refusals name the phase, term and overflow."""
from __future__ import annotations

import json

import pytest

from nemo_tlt.model.config import LMConfig
from nemo_tlt.plan.cluster import GIB
from nemo_tlt.plan.memory import (
    PlanDoesNotFit, RolloutShape, TrainingShape, check_fit, parameter_count, rollout_memory, training_memory,
)
from nemo_tlt.weights.layout import ParallelLayout

# h 64, q 64 (4 heads x 16), kv 32 (2 heads x 16), ffn 128, 2 layers, vocab 64 (padded to 128).
CFG = LMConfig(family="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2)
LAYER = 2 * 64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # 36992


def test_parameter_count_by_hand():
    assert parameter_count(CFG) == 2 * LAYER + 2 * 64 * 64 + 64 == 82240


def test_training_terms_by_hand():
    shape = TrainingShape(layout=ParallelLayout(1, 1), dp=2, micro_batch=1, seq_len=10, num_micro_batches=4,
                          reserve_gib=0.0)
    got = training_memory(CFG, shape)
    p_rank = 2 * LAYER + 2 * 128 * 64 + 64  # padded vocab rows in embedding and output layer
    assert got == {"weights": 2 * p_rank, "gradients": 4 * p_rank, "optimizer": 12 * p_rank / 2,
                   "activations": 2 * (2 * 10 * (4 * 64 + 2 * 64 + 2 * 32 + 3 * 128)),
                   "logits": 8 * 10 * 128, "reserve": 0.0}


def test_training_terms_split_by_tp_and_pp():
    one = training_memory(CFG, TrainingShape(ParallelLayout(1, 1), dp=1, micro_batch=1, seq_len=10,
                                             num_micro_batches=4, distributed_optimizer=False, reserve_gib=0.0))
    split = training_memory(CFG, TrainingShape(ParallelLayout(2, 2), dp=1, micro_batch=1, seq_len=10,
                                               num_micro_batches=4, distributed_optimizer=False, reserve_gib=0.0))
    # The fullest of TP2 x PP2 is the last stage: one layer's TP half (norms whole), half the
    # (padded, 256-row) output layer and the final norm; it holds one micro-batch in flight,
    # its activations split by TP (sequence parallel), plus the bf16 logits and their fp32 copy,
    # and, the vocabulary being padded, the padding mask's second fp32 gradient.
    last = (LAYER - 128) // 2 + 128 + 256 // 2 * 64 + 64
    assert split["weights"] == 2 * last and split["optimizer"] == 12 * last
    assert split["activations"] == 2 * 10 * (4 * 64 + 2 * 64 + 2 * 32 + 3 * 128) // 2
    assert split["logits"] == 8 * 10 * 256 // 2
    assert one["weights"] > split["weights"]


def test_logits_count_a_second_fp32_gradient_where_the_vocabulary_is_padded():
    unpadded = LMConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2)
    shape = TrainingShape(ParallelLayout(1, 1), dp=1, micro_batch=1, seq_len=10, num_micro_batches=1, reserve_gib=0.0)
    assert training_memory(unpadded, shape)["logits"] == 6 * 10 * 128
    assert training_memory(CFG, shape)["logits"] == 8 * 10 * 128  # 64 rows padded to 128


def test_every_stage_holds_one_micro_batch():
    """The policy runs megatron's schedule once per micro-batch: the first of two stages holds one
    micro-batch's activations, not two (what 1F1B over several micro-batches would hold)."""
    from nemo_tlt.plan.memory import stage_training_memory

    shape = TrainingShape(ParallelLayout(1, 2), dp=1, micro_batch=1, seq_len=10, num_micro_batches=4,
                          sequence_parallel=False, reserve_gib=0.0)
    first, last = stage_training_memory(CFG, shape, 0), stage_training_memory(CFG, shape, 1)
    assert first["activations"] == last["activations"] == 2 * 10 * (4 * 64 + 2 * 64 + 2 * 32 + 3 * 128)
    assert first["logits"] == 0


def test_local_spec_activations_by_hand():
    """megatron-core's local spec (torch ops) keeps per token and layer: 10 h per RMSNorm (fp32
    input, fp32 normalised, bf16 output), 2 q each for the roped query, the repeated key and
    value and the context, 6 n_h s for the scores (fp32 softmax, bf16 copy), 10 f for the MLP and
    8 s head_dim per layer for the rotary tables (cos, sin for q and k, whatever b); the last stage
    also the final norm's 10 h."""
    def terms(tp: int, sp: bool) -> dict:
        return training_memory(CFG, TrainingShape(ParallelLayout(tp, 1), dp=1, micro_batch=2, seq_len=10,
                                                  num_micro_batches=4, sequence_parallel=sp, reserve_gib=0.0,
                                                  layer_spec="local"))

    tokens, s = 2 * 10, 10
    rope = 8 * s * 16
    one = 20 * 64 + 8 * 64 + 6 * 4 * s + 10 * 128
    assert terms(1, False)["activations"] == 2 * (tokens * one + rope) + tokens * 10 * 64
    split = 20 * 64 + (8 * 64 + 6 * 4 * s + 10 * 128) // 2
    assert terms(2, False)["activations"] == 2 * (tokens * split + rope) + tokens * 10 * 64
    assert terms(2, False)["logits"] == 8 * tokens * 256 // 2  # vocab 64 padded to 256
    with pytest.raises(ValueError, match="training.layer_spec must be one of"):
        TrainingShape(ParallelLayout(1, 1), dp=1, micro_batch=1, seq_len=10, num_micro_batches=1, layer_spec="te")
    with pytest.raises(ValueError, match="layer_spec=local cannot run with training.sequence_parallel"):
        terms(2, True)


def test_recomputed_activations_by_hand():
    """Full recompute stores each layer's input (split by TP only under sequence parallelism) plus
    one layer's activations; selective stores what none does (flash attention keeps no scores)."""
    def acts(recompute: str, sp: bool) -> float:
        return training_memory(CFG, TrainingShape(ParallelLayout(2, 1), dp=1, micro_batch=1, seq_len=10,
                                                  num_micro_batches=4, sequence_parallel=sp, recompute=recompute,
                                                  reserve_gib=0.0))["activations"]

    split = 2 * 64 + 2 * 32 + 3 * 128
    layer_sp, layer_no_sp = 2 * 10 * (4 * 64 + split) // 2, 2 * 10 * (4 * 64 + split // 2)
    assert acts("none", True) == acts("selective", True) == 2 * layer_sp
    assert acts("none", False) == acts("selective", False) == 2 * layer_no_sp
    assert acts("full", True) == 2 * (2 * 10 * 64 // 2) + layer_sp
    assert acts("full", False) == 2 * (2 * 10 * 64) + layer_no_sp


def test_rollout_terms_by_hand():
    shape = RolloutShape(tp=1, concurrency=4, context=10, sd=True, sd_rows=2, max_num_verify=3,
                         drafter_training=True, harvest_bytes=1000, workspace_gib=0.0, reserve_gib=0.0)
    training = {"weights": 5.0, "gradients": 7.0, "optimizer": 11.0}
    drafter = 2 * 64 * 64 + 64 + LAYER + 64
    assert rollout_memory(CFG, shape, training) == {
        "weights": 2.0 * 82240, "kv_cache": 2 * 2 * 2 * 16 * 2 * 4 * 10, "drafter": 2 * drafter,
        "drafter_training": 16 * drafter + 1000, "logits": 4 * 64 * max(4, 2 * 4), "workspace": 0.0,
        "training_state": 0.0, "reserve": 0.0}
    keep = rollout_memory(CFG, RolloutShape(tp=1, concurrency=4, context=10, training_state="all",
                                            kv_tokens=7, sd=False), training)
    assert keep["training_state"] == 23.0 and keep["kv_cache"] == 2 * 2 * 2 * 16 * 2 * 7 and keep["drafter"] == 0


def test_refusal_names_phase_term_and_overflow():
    memory = {"training": {"weights": 10 * GIB, "optimizer": 30 * GIB},
              "rollout": {"weights": 5 * GIB, "kv_cache": 50 * GIB}}
    check_fit(memory, 55.0)
    with pytest.raises(PlanDoesNotFit, match=r"rollout needs 55\.0 GiB per GPU, 15\.0 GiB more than the GPU's "
                                             r"40\.0 GiB; largest term rollout\.kv_cache = 50\.0 GiB") as err:
        check_fit(memory, 40.0)
    assert "training" not in str(err.value)


def test_cli_refuses_a_layout_that_does_not_fit(tmp_path, capsys):
    from nemo_tlt.plan.cli import main

    out = tmp_path / "plan.json"
    rc = main(["model_config=conf/models/llama3.3-70b-instruct", "cluster.nodes=1", "training.tensor_parallel=8",
               "rollout.tensor_parallel=8", "batch.prompts=8", "batch.group_size=1", "--out", str(out)])
    plan = json.loads(out.read_text())
    assert rc == 1 and plan["fits"] is False
    assert "training needs" in plan["refusal"] and "largest term training." in plan["refusal"]
    assert set(plan["memory_gib"]) == {"training", "rollout"} and plan["gpu_memory_gib"] == 79.6
    assert set(plan["reshard"]) >= {"peak_extra_bytes_per_rank", "largest_layer_bytes", "bytes_moved_per_rank"}
    assert "plan does not fit" in capsys.readouterr().err


def test_cli_takes_overrides_after_the_options(tmp_path):
    from nemo_tlt.plan.cli import main

    outs = [tmp_path / "before.json", tmp_path / "after.json"]
    keys = ["model_config=conf/models/llama3.3-70b-instruct", "cluster.nodes=1", "training.tensor_parallel=8",
            "rollout.tensor_parallel=8", "batch.prompts=8", "batch.group_size=1"]
    assert main([*keys, "--out", str(outs[0])]) == 1
    assert main(["--out", str(outs[1]), *keys[:3], "--out", str(outs[1]), *keys[3:]]) == 1
    before, after = (json.loads(o.read_text()) for o in outs)
    assert before == after and after["fits"] is False
