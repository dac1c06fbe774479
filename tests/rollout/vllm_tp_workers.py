"""Rank functions of `test_vllm_tensor_parallel.py` (a module of their own: spawned ranks import it)."""
from __future__ import annotations

from nemo_tlt.adaptive.learned_policy import LearnedSDConfig, LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.model.hf_io import read_state_dict
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape


def tp_replica(ctx, target: str, drafter: str, prompts: list, depth: int) -> dict:
    """One of vLLM's TP workers (``external_launcher``) over the launch's world: the same calls on
    every rank; returns what each call gave this rank."""
    engine = VLLMRolloutEngine.from_hf_folder(target, drafter_dir=drafter, num_speculative_tokens=2 * depth,
                                              max_num_seqs=len(prompts), kv_cache_gib=0.1, dtype="float32",
                                              tensor_parallel_size=ctx.world, external_launcher=True)
    greedy = SamplingParams(max_new_tokens=64)
    sampled = SamplingParams("rejection", temperature=0.7, max_new_tokens=64, seed=3)
    chain = FixedSDPolicy(TreeShape(depth, 1, depth))
    out: dict = {"tp": (engine.tp.rank, engine.tp.size)}
    try:
        out["plain"] = engine.generate(prompts, greedy)
        out["sd"] = engine.generate(prompts, greedy, policy=chain)
        # each rank's own policy would choose by its own clock: only TP rank 0's may decide
        learned = LearnedSDPolicy(LearnedSDConfig(arms=[f"{depth}_1_{depth}", f"{2 * depth}_1_{2 * depth}"],
                                                  min_pulls=1))
        out["learned"] = engine.generate(prompts, sampled, policy=learned)
        out["learned_pulls"] = learned.costs.pulls()
        weights = read_state_dict(target)
        engine.load_policy_weights(dict(weights, **{"lm_head.weight": -weights["lm_head.weight"]}))
        out["flipped"] = engine.generate(prompts, greedy)
        engine.load_policy_weights(iter(weights.items()))
        out["restored"] = engine.generate(prompts, greedy, policy=chain)
        # a call that one member refuses (a prompt past the context) stops both, and so does a
        # call whose inputs differ between the members
        long = [Request(prompts[0].prompt * 64, seq_id=0), *prompts[1:]]
        out["refused"] = _error(engine, long if ctx.rank == 1 else prompts, greedy)
        other = [Request(prompts[0].prompt[:-1], seq_id=0), *prompts[1:]]
        out["other_inputs"] = _error(engine, other if ctx.rank == 1 else prompts, greedy)
        out["after"] = engine.generate(prompts, greedy)
    finally:
        engine.close()
    return {k: [r.tokens for r in v.results] if hasattr(v, "results") else v for k, v in out.items()} | {
        "sd_steps": out["sd"].stats.sd_steps, "accept": out["sd"].stats.mean_accept_len,
        "plain_logprobs": [r.logprobs for r in out["plain"].results]}


def _error(engine: VLLMRolloutEngine, prompts: list, sampling: SamplingParams) -> str:
    """The error type ``generate`` raised (``"none"`` when it returned)."""
    try:
        engine.generate(prompts, sampling)
    except (ValueError, RuntimeError) as err:
        return type(err).__name__
    return "none"
