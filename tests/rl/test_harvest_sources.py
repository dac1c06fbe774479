"""Drafter data "for free" from the policy's own forward: with `drafter.harvest_from=policy`
a megatron-core (TP=2) run fills the harvest buffer from its log-prob / update pass
through the hidden-state capture, and holds the same (tokens, hidden states) as a torch
run that harvests from the rollout engine, on the same rollout: the final hidden states
for an EAGLE-2 drafter, the captured layers and the final state for an EAGLE-3 one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_tlt.config import load_config
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.io import save_drafter
from nemo_tlt.model.hf_io import load_hf_folder
from nemo_tlt.rl.loop import RLWorker
from nemo_tlt.rl.run import RunSpec, prepare_run_dir
from nemo_tlt.rl.workers import launch

from tiny_rl import tiny_overrides

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(180)
DEMO = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"


def first_step_harvest(spec, comm, stop, on_step):
    """Run RL step 0 on every rank and return what each rank's harvest buffer holds."""
    worker = RLWorker(spec, comm, stop)
    worker.t0 = worker.coord.now()
    try:
        worker.step(0)
        mine = {"tokens": [s.token_ids.tolist() for s in worker.drafter.buffer.samples()],
                "hidden": [s.hidden.float() for s in worker.drafter.buffer.samples()]}
        return comm.gather(mine)
    finally:
        worker.drafter.close()
        worker.saver.close()


def _harvest(tmp_path: Path, target: Path, drafter: Path, name: str, extra: list[str]) -> dict:
    cfg = load_config(DEMO, tiny_overrides(target, drafter, tmp_path / name, steps=1) + extra)
    spec = RunSpec(cfg, "tlt", str(tmp_path / name), str(target), str(drafter))
    prepare_run_dir(spec)
    return launch(spec, first_step_harvest)


@pytest.fixture(scope="module")
def tiny_eagle3(tiny_models):
    """A randomly initialised EAGLE-3 drafter for the tiny target (2 layers: captures 0, 0, 1)."""
    target, drafter = tiny_models
    folder = drafter.parent / "drafter_eagle3"
    if not (folder / "drafter.json").is_file():
        torch.manual_seed(0)
        save_drafter(Eagle3Drafter(Eagle3Config.from_target(load_hf_folder(target).config)), folder)
    return target, folder


def _same_harvest(tmp_path: Path, target: Path, drafter: Path, width: int) -> None:
    from_rollout = _harvest(tmp_path, target, drafter, "torch", [])
    from_policy = _harvest(tmp_path, target, drafter, "megatron", [
        "policy.backend=megatron", "policy.tensor_parallel=2", "drafter.harvest_from=policy",
        "policy.pipelined_update=false", "policy.micro_batch_tokens=0"])
    # every rank holds its own rollout's sequences (rank 1's start past rank 0's in the
    # model-parallel group's union batch); the policy's forward visits them in
    # length-sorted micro-batches, so compare by sequence
    assert len(from_rollout) == len(from_policy) == 2
    for rank, (mine_r, mine_p) in enumerate(zip(from_rollout, from_policy)):
        rollout = sorted(zip(mine_r["tokens"], mine_r["hidden"]), key=lambda x: x[0])
        policy = sorted(zip(mine_p["tokens"], mine_p["hidden"]), key=lambda x: x[0])
        assert rollout and [t for t, _ in policy] == [t for t, _ in rollout], f"rank {rank}"
        for (_, a), (_, b) in zip(policy, rollout):
            assert a.shape == b.shape and a.shape[-1] == width
            # both stored in the buffer's bfloat16: equal up to one rounding step
            torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)


def test_megatron_logprob_pass_feeds_the_buffer_like_the_torch_rollout(tiny_models, tmp_path):
    target, drafter = tiny_models
    _same_harvest(tmp_path, target, drafter, load_hf_folder(target).config.hidden_size)


def test_megatron_update_pass_feeds_an_eagle3_drafter_like_the_torch_rollout(tiny_eagle3, tmp_path):
    """The EAGLE-3 features (captured layers, then the final state) from the megatron policy's
    forward equal the torch rollout engine's, on every rank."""
    target, drafter = tiny_eagle3
    config = Eagle3Config.from_target(load_hf_folder(target).config)
    _same_harvest(tmp_path, target, drafter, (len(config.capture_layers) + 1) * config.layer.hidden_size)


def _by_sequence(ranks: list[dict]) -> list[tuple[list[int], torch.Tensor]]:
    return sorted(((t, h) for r in ranks for t, h in zip(r["tokens"], r["hidden"])), key=lambda x: x[0])


def _split_once(split: list[dict], whole: list[dict]) -> None:
    """``split``'s two ranks hold disjoint halves-or-so of the sequences, together each sequence
    of ``whole`` once, with its features (bf16 in the buffer: one rounding step apart)."""
    assert all(r["tokens"] for r in split), "a member harvested nothing"
    assert not {tuple(t) for t in split[0]["tokens"]} & {tuple(t) for t in split[1]["tokens"]}
    got, want = _by_sequence(split), _by_sequence(whole)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)


def test_a_tensor_parallel_replicas_members_split_its_rows(tiny_models, tmp_path):
    """Rollout TP 2 (one replica over both ranks, each decoding every row): member j keeps rows
    i with i % 2 == j, so the two buffers hold each sequence once, as two TP-1 replicas do."""
    target, drafter = tiny_models
    whole = _harvest(tmp_path, target, drafter, "tp1", [])
    _split_once(_harvest(tmp_path, target, drafter, "tp2", ["rollout.tensor_parallel=2"]), whole)


def test_megatron_ranks_of_one_rollout_replica_split_the_policy_forwards_rows(tiny_models, tmp_path):
    """Policy TP 2 over rollout TP 2: both ranks run the forward of the one replica's batch;
    each keeps its half of the rows from it."""
    target, drafter = tiny_models
    whole = _harvest(tmp_path, target, drafter, "tp1", [])
    _split_once(_harvest(tmp_path, target, drafter, "megatron_tp2", [
        "policy.backend=megatron", "policy.tensor_parallel=2", "drafter.harvest_from=policy",
        "policy.pipelined_update=false", "policy.micro_batch_tokens=0", "rollout.tensor_parallel=2"]), whole)


def test_policy_replicas_inside_one_rollout_replica_keep_their_own_part(tiny_models, tmp_path):
    """Policy TP 1 under rollout TP 2: each rank's forward runs its own part of the replica's
    groups (no row twice), and it keeps every row of it."""
    target, drafter = tiny_models
    whole = _harvest(tmp_path, target, drafter, "tp1", [])
    _split_once(_harvest(tmp_path, target, drafter, "megatron_tp1", [
        "policy.backend=megatron", "drafter.harvest_from=policy", "policy.pipelined_update=false",
        "policy.micro_batch_tokens=0", "rollout.tensor_parallel=2"]), whole)


@pytest.fixture(scope="module")
def four_kv_heads(tmp_path_factory):
    """A random 2-layer target with 4 KV heads (rollout TP 4 divides them) and an EAGLE drafter."""
    from nemo_tlt.demo.tokenizer import CharTokenizer
    from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
    from nemo_tlt.model.config import LMConfig
    from nemo_tlt.model.hf_io import save_hf_folder
    from nemo_tlt.model.lm import DecoderLM

    root = tmp_path_factory.mktemp("four_kv_heads")
    lm = LMConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=4, max_position_embeddings=256)
    save_hf_folder(DecoderLM(lm).init_weights_(torch.Generator().manual_seed(0)), root / "target")
    torch.manual_seed(0)
    save_drafter(EagleDrafter(EagleConfig.from_target(lm)), root / "drafter")
    return root / "target", root / "drafter"


def test_the_policy_tp_ranks_of_a_part_of_a_rollout_replica_split_it(four_kv_heads, tmp_path):
    """Policy TP 2 under rollout TP 4 (4 ranks): two training groups inside the one replica, each
    running its part's forward on both of its ranks, which split that part's rows."""
    target, drafter = four_kv_heads
    whole = _harvest(tmp_path, target, drafter, "tp1_4", ["workers.num_workers=4"])
    split = _harvest(tmp_path, target, drafter, "megatron_tp2_rollout_tp4", [
        "workers.num_workers=4", "policy.backend=megatron", "policy.tensor_parallel=2",
        "drafter.harvest_from=policy", "policy.pipelined_update=false", "policy.micro_batch_tokens=0",
        "rollout.tensor_parallel=4"])
    tokens = [tuple(t) for r in split for t in r["tokens"]]
    assert len(tokens) == len(set(tokens)) and all(r["tokens"] for r in split)  # each row once, every rank some
    got, want = _by_sequence(split), _by_sequence(whole)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)
