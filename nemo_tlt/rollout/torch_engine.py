"""The embedded PyTorch rollout engine: the default backend and the test oracle.

One `generate` call decodes a batch of requests with a batched KV cache. Every
decode step is either *plain* (one target forward over the running rows' root
tokens) or *speculative* (the drafter proposes a tree per row, one target forward
verifies all trees, each row keeps its own accepted path). A `SpecPolicy` decides
per step from the number of running rows; switching needs no re-prefill because
the target's final hidden states are kept for every committed position and the
drafter catches up from them. Finished rows are dropped from the batch at once,
so the long tail runs at its true (small) batch size.

Fixed costs per rollout are kept small, because every method pays them alike:
prompts are prefilled in length-sorted chunks (little padding), a finished row's
place is taken by the last running row (one row moves, not all), and the caches
start at the longest prompt + `initial_slots` and double only as rows lengthen.
With a KV budget (``kv_cache_gib``, ``rollout.kv_cache_gib``, or ``kv_cache_fraction``,
``rollout.kv_cache_fraction``: a fraction of the device's free memory at each call,
nemo_tlt.rollout.kv_limit) the caches never grow past it: the requests are decoded in waves
of rows that fit it together (nemo_tlt.rollout.kv_admission).

Per row b the engine keeps (see nemo_tlt.drafter.base): committed length L[b]
(slots in the target KV cache), tokens[b, :L+1] (x_L is the root, produced but not
yet fed to the target), features[b, :L] and logprobs[b, :L+1] (beside each generated
token, the log-probability it was reported with: ``speculative.sampling.token_logprobs``
of the target's logits that predicted it, the plain step's or, with SD, the verify
forward's at the accepted node; no extra forward). A feature is the target's final hidden
state, or, for a drafter that declares `capture_layers` (EAGLE-3), the outputs of
those target layers concatenated, then the final state ([(k+1)*H]), all from the same
target forward.

Devices and dtypes: the engine computes on the device of the target's parameters and
makes every tensor there (KV caches, token and feature buffers, tree masks and
positions, acceptance and sampling tensors, the sampling generator); prompts are
copied over once. Values leave the device only where they must (the tokens of a
finished row, with their log-probs in the same read, the stop decision, metrics),
through nemo_tlt.model.host, and
`StepTrace.host_syncs` counts them per decode step: one per plain step, one more per
speculative step (the drafter's catch-up), one per tree depth more with rejection
sampling, and a few where rows finish. ``compute_dtype`` (``rollout.compute_dtype``)
decouples the arithmetic from the weights' dtype: a bf16 target served with
``compute_dtype=torch.float32`` keeps bf16-rounded weights (policy weights loaded
later are rounded to bf16 too) but computes and caches in fp32, so that speculative
verification and plain decoding agree as often as they do in fp32 (docs/benchmarks.md,
"Precision"); the cost is an fp32 copy of the weights, an fp32 KV cache and fp32 math.
The CUDA paths are written for GPUs but, in this repository, run only on CPU.

Tensor parallelism: a target built with a `TensorParallel` of size > 1 (``from_hf_folder(...,
tp=...)``: each rank reads only its slices) holds 1/TP of every split weight and of the KV
cache (nemo_tlt.model.lm states the collectives per forward); every rank of the group calls
`generate` with the same requests and sampling and gets the same tokens (the lockstep of
nemo_tlt.rollout.tp_lockstep: TP rank 0's SD policy decides each step, and the results are
checked to agree). The drafter is replicated: every rank holds it whole and drafts the same
tree, its reads of the target's embedding and head making the target's collectives in step.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.drafter.base import CapturesLayers, DraftContext, Drafter
from nemo_tlt.drafter.features import feature_width, join_features
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import load_hf_folder
from nemo_tlt.model.tensor_parallel import TensorParallel, active
from nemo_tlt.model.host import host_list, host_syncs
from nemo_tlt.model.layers import padded_causal_mask
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rollout.kv_admission import admission, check_fits, engine_slot_bytes, wave_requests, wave_slots
from nemo_tlt.rollout.kv_limit import KVBudget, KVLimit
from nemo_tlt.rollout.prefill import prefill_chunks
from nemo_tlt.rollout.row_batch import RowBatch
from nemo_tlt.rollout.row_steps import commit_tokens, done_rows, longest_running, retire_rows
from nemo_tlt.rollout.tp_lockstep import check_agreement, check_ready, lead_shape
from nemo_tlt.rollout.weight_load import (canonical_shapes, check_weight, compute_copy, load_tp_folder, local_part,
                                          weight_pair)
from nemo_tlt.rollout.protocol import (EngineLimits, FinishSink, GenerateOutput, GenerationStats, PolicyWeights, Request,
                                       RequestResult, StepTrace)
from nemo_tlt.rollout.validate import validate_requests
from nemo_tlt.speculative.acceptance import accept_greedy, accept_rejection
from nemo_tlt.speculative.sampling import (SamplingParams, coupled_draw, coupled_noise_table, draw,
                                           process_logits, token_logprobs)
from nemo_tlt.speculative.tree import block_tokens, tree_block_mask, tree_block_positions
from nemo_tlt.speculative.tree_shape import TreeShape


class TorchRolloutEngine:
    """Implements `RolloutEngine` over a `DecoderLM` held in this process.

    ``drafter`` is a shortcut for `load_drafter`. ``max_tree_nodes`` bounds the cache
    slots reserved for a draft tree, ``prefill_overhead_tokens`` prices one more
    prefill forward (see prefill_chunks) and ``initial_slots`` is how many cache slots
    per row are allocated past the longest prompt at first (None: room for
    max_new_tokens up front); none of them changes a token generated.
    ``kv_cache_gib`` (``rollout.kv_cache_gib``) or ``kv_cache_fraction`` (``rollout.kv_cache_fraction``,
    of the memory free on the device when a call starts; both None: unbounded) bounds the KV bytes
    this rank's caches hold, the target's and the drafter's (see nemo_tlt.rollout.kv_limit and
    nemo_tlt.rollout.kv_admission).
    ``compute_dtype`` (None: the target's own dtype) is the dtype the engine computes
    and caches in (see the module docstring); a target in another dtype is copied and
    cast, the caller's model is left as it is."""

    LIMITS = EngineLimits()  # none: every mode, hidden states, per-step stats, every drafter kind
    accepts_rollout_slices = True  # at TP > 1 a policy may stream only this rank's slices

    def __init__(self, target: DecoderLM, drafter: Drafter | None = None, *, max_tree_nodes: int = 256,
                 prefill_overhead_tokens: int = 64, initial_slots: int | None = 128,
                 compute_dtype: torch.dtype | None = None, kv_cache_gib: float | None = None,
                 kv_cache_fraction: float | None = None) -> None:
        if max_tree_nodes < 1:
            raise ValueError(f"TorchRolloutEngine.max_tree_nodes must be >= 1, got {max_tree_nodes}")
        if prefill_overhead_tokens < 0:
            raise ValueError("TorchRolloutEngine.prefill_overhead_tokens must be >= 0, got "
                             f"{prefill_overhead_tokens}")
        if initial_slots is not None and initial_slots < 1:
            raise ValueError(f"TorchRolloutEngine.initial_slots must be >= 1 or None, got {initial_slots}")
        self.kv_limit = KVLimit(kv_cache_gib, kv_cache_fraction)
        self.last_kv_budget: KVBudget | None = None  # the budget the last generate call decoded under
        self.weights_dtype = target.lm_head_weight.dtype
        self.target = compute_copy(target, compute_dtype).eval()
        self.tp: TensorParallel | None = target.tp
        self._full_shapes = canonical_shapes(target.config) if self.tp is not None else None
        self.kv_limit.check_device(self.device)
        self.max_tree_nodes = max_tree_nodes
        self.initial_slots = initial_slots
        self.prefill_overhead_tokens = prefill_overhead_tokens
        self.drafter: Drafter | None = None
        self._failed_load: str | None = None  # why the last weight load left the model half-written
        self.load_drafter(drafter)

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike, drafter: Drafter | None = None, *,
                       device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                       tp: TensorParallel | None = None, **kwargs: Any) -> "TorchRolloutEngine":
        """An engine serving the HF-format model folder at `path` (see nemo_tlt.model.hf_io),
        its weights in `dtype` on `device` (None: the CPU); ``kwargs`` go to the constructor.
        With ``tp`` of size > 1 this rank reads only its own slices (see the module docstring)."""
        if active(tp) is not None:
            return cls(load_tp_folder(path, tp, device or "cpu", dtype), drafter, **kwargs)
        return cls(load_hf_folder(path, dtype).to(device or "cpu"), drafter, **kwargs)

    @property
    def device(self) -> torch.device:
        """Where the engine computes: the device of the target's parameters."""
        return self.target.lm_head_weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.target.lm_head_weight.dtype

    # ---- RolloutEngine protocol -------------------------------------------
    @property
    def model_config(self) -> LMConfig:
        return self.target.config

    @torch.no_grad()
    def load_policy_weights(self, weights: PolicyWeights) -> None:
        """See `RolloutEngine.load_policy_weights`. Tensors are copied into the model's
        parameters as they arrive (cast to the model's dtype), so a stream is never held
        whole; a stream that fails after a copy marks the model unservable instead. A TP
        rank takes each tensor whole (keeping its slice) or already sliced (weight_load)."""
        params = self.target.state_dict()  # canonical name -> tensor sharing the parameter's storage
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        seen: set[str] = set()
        try:
            for i, item in enumerate(pairs):
                name, tensor = weight_pair(i, item)
                if self.tp is not None and name in params and name not in seen:
                    tensor = local_part(name, tensor, tuple(params[name].shape), self._full_shapes[name], self.tp)
                check_weight(name, tensor, params, seen)
                params[name].copy_(tensor.to(self.weights_dtype))  # served weights: rounded to the model dtype
                seen.add(name)
            missing = [name for name in params if name not in seen]
            if missing:
                raise ValueError(f"load_policy_weights: tensor {missing[0]!r} was not given ({len(missing)} of "
                                 f"{len(params)} canonical tensors missing)")
        except BaseException as err:  # re-raised: only the model's state is recorded
            if seen:  # a tensor was written: the model is half-written (else it is as it was)
                self._failed_load = f"{len(seen)} of {len(params)} tensors written before: {err}"
            raise
        self._failed_load = None

    def load_drafter(self, drafter: Drafter | None) -> None:
        """Install a drafter (None: plain decoding only). A drafter built for another
        target is refused with a ValueError naming the mismatch."""
        if drafter is not None:
            drafter.check_target(self.target)
            drafter.eval()
        self.drafter = drafter

    @torch.no_grad()
    def generate(self, requests: list[Request], sampling: SamplingParams, *, policy: SpecPolicy | None = None,
                 return_hidden: bool = False, on_finish: FinishSink | None = None) -> GenerateOutput:
        """See `RolloutEngine.generate` (``on_finish`` runs as each row retires). With TP,
        every rank of the group calls it alike (nemo_tlt.rollout.tp_lockstep)."""
        budget = self.last_kv_budget = self.kv_limit.budget(self.device, self.tp)  # None: unbounded
        slot_bytes = engine_slot_bytes(self.target, self.drafter) if budget is not None else 0
        self._validate(requests, sampling, budget, slot_bytes)
        lead = self.tp is None or self.tp.rank == 0  # whose policy is consulted
        stats = GenerationStats()
        t_start, syncs_start = time.perf_counter(), host_syncs()
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        results: list[RequestResult | None] = [None] * len(requests)
        accepted: list[torch.Tensor] = []  # per SD step, tokens per row: read back once at the end
        if policy is not None and lead:
            policy.begin_rollout()
        for rows in admission(requests, sampling, budget, slot_bytes):
            wave = requests if len(rows) == len(requests) else wave_requests(requests, rows)
            sink = None if on_finish is None else (lambda i, result, rows=rows: on_finish(rows[i], result))
            done = self._decode(wave, sampling, gen, stats, policy if lead else None, accepted, return_hidden, sink,
                                wave_slots(budget, len(rows), slot_bytes))
            for i, result in zip(rows, done):
                results[i] = result
        if accepted:
            stats.accept_lengths.extend(host_list(torch.cat(accepted)))
        stats.host_syncs = host_syncs() - syncs_start
        stats.wall_s = time.perf_counter() - t_start
        stats.time_other_s = stats.wall_s - stats.time_draft_s - stats.time_verify_s - stats.time_plain_s
        out = GenerateOutput([r for r in results if r is not None], stats)
        if self.tp is not None:
            check_agreement(self.tp, out.results)
        return out

    def _decode(self, requests: list[Request], sampling, gen, stats, policy: SpecPolicy | None, accepted: list,
                return_hidden: bool, on_finish: FinishSink | None, slot_cap: int | None) -> list[RequestResult]:
        """Prefill `requests` and decode them all to their ends (one wave); ``policy`` is
        consulted here only on the rank that leads (None elsewhere), ``slot_cap`` caps the
        cache slots per row (the KV budget's). Returns their results in request order."""
        t_start = time.perf_counter()
        results: list[RequestResult | None] = [None] * len(requests)
        batch = self._prefill(requests, sampling, gen, stats, slot_cap)
        stats.prefill_s += time.perf_counter() - t_start
        eos = self.target.config.eos_token_id
        done = done_rows(batch, sampling, eos)
        any_done, longest = host_list(torch.stack((done.any().long(), longest_running(batch, done))))
        retire_rows(batch, done, bool(any_done), longest, sampling, eos, results, return_hidden, on_finish)
        while batch.rows.numel():
            running, syncs0 = batch.rows.numel(), host_syncs()
            shape = self._choose(policy, running)
            if shape is not None and not self._tree_fits(longest, batch, shape):
                shape = None  # a tree would run past the context or the cache: finish plainly
            t0 = time.perf_counter()
            batch.reserve(longest + (self._tree_slots(shape) if shape is not None else 1) + 1, longest)
            batch.cache.note_max_length(longest)
            if shape is None:
                emitted, logprobs, counts = self._plain_step(batch, sampling, gen, stats)
            else:
                emitted, logprobs, counts = self._sd_step(batch, sampling, gen, stats, shape)
                accepted.append(counts)
            kept = commit_tokens(batch, emitted, logprobs, counts, sampling, eos)
            done = done_rows(batch, sampling, eos)
            # the one read of a step: tokens kept, whether any row is done, the longest running row
            made, any_done, longest = host_list(torch.stack((kept.sum(), done.any().long(),
                                                             longest_running(batch, done))))
            dt = time.perf_counter() - t0
            stats.tokens_generated += made
            if policy is not None:
                policy.observe(running, shape, made, dt)
            retire_rows(batch, done, bool(any_done), longest, sampling, eos, results, return_hidden, on_finish)
            stats.trace.append(StepTrace(running, shape.name if shape else None, made, made / running, dt,
                                         batch.kv_bytes(), host_syncs() - syncs0))
        return results

    def _choose(self, policy: SpecPolicy | None, running: int) -> TreeShape | None:
        shape = lead_shape(self.tp, policy, running)
        if shape is not None and self.drafter is None:
            raise ValueError(f"generate: the policy chose tree shape {shape.name} but no drafter is loaded "
                             "(load_drafter(...) first, or pass policy=None for plain decoding)")
        if shape is not None:
            self.drafter.check_shape(shape)
        return shape

    # ---- validation ---------------------------------------------------------
    def _validate(self, requests: list[Request], sampling: SamplingParams, budget: KVBudget | None,
                  slot_bytes: int) -> None:
        try:
            self._validate_local(requests, sampling, budget, slot_bytes)
        except ValueError as err:
            return check_ready(self.tp, err)
        check_ready(self.tp, None)

    def _validate_local(self, requests: list[Request], sampling: SamplingParams, budget: KVBudget | None,
                        slot_bytes: int) -> None:
        if self._failed_load is not None:
            raise ValueError(f"generate: the last load_policy_weights failed midway ({self._failed_load}); "
                             "the model is half-written: load complete weights first")
        validate_requests(requests, sampling, self.target.config)
        if budget is not None:
            check_fits(requests, sampling, budget, slot_bytes)

    @staticmethod
    def _tree_slots(shape: TreeShape) -> int:
        """Cache slots one SD step writes past the committed length (target or drafter)."""
        return max(shape.num_verify + 1, (shape.depth - 1) * shape.topk + 1)

    def _tree_fits(self, L: int, batch: RowBatch, shape: TreeShape) -> bool:
        """Whether a tree grown from the longest row (committed length L) fits."""
        return (L + shape.depth + 2 <= self.target.config.max_position_embeddings
                and L + self._tree_slots(shape) <= batch.max_slots)

    # ---- steps ------------------------------------------------------------------
    def _capture(self) -> tuple[int, ...] | None:
        return self.drafter.capture_layers if isinstance(self.drafter, CapturesLayers) else None

    def _feature_width(self) -> int:
        return feature_width(self.target.config.hidden_size, self._capture())

    def _forward(self, tokens, positions, cache, new_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward: (final hidden states, the features kept per position:
        the final state, or the captured layers followed by it)."""
        capture = self._capture()
        if capture:
            hidden, captured = self.target.hidden_capture(tokens, capture, positions, cache, new_mask)
            return hidden, join_features(hidden, captured)
        hidden = self.target.hidden(tokens, positions, cache, new_mask)
        return hidden, hidden

    def _prefill(self, requests, sampling, gen, stats, slot_cap: int | None) -> RowBatch:
        """Prompts are sorted by length (row b holds request rows[b]) and prefilled in
        the chunks of `prefill_chunks`, each padded to its own longest prompt; the caches
        may grow to `slot_cap` slots per row (None: as many as a row can use)."""
        B, dev = len(requests), self.device
        order = sorted(range(B), key=lambda i: len(requests[i].prompt))
        lens_host = [len(requests[i].prompt) for i in order]
        T = lens_host[-1]
        max_slots = T + sampling.max_new_tokens + self.max_tree_nodes + 2
        if slot_cap is not None:
            max_slots = min(max_slots, slot_cap)  # >= T + max_new_tokens: plain steps always fit (check_fits)
        cap = max_slots if self.initial_slots is None else min(max_slots, T + self.initial_slots)
        prompts = torch.zeros(B, cap + 1, dtype=torch.long, device="cpu")  # the prompts' one trip to the device
        for b, i in enumerate(order):
            prompts[b, : lens_host[b]] = torch.tensor(requests[i].prompt, dtype=torch.long, device="cpu")
        tokens = prompts.to(dev)
        lens = torch.tensor(lens_host, dtype=torch.long, device=dev)
        cache = self.target.new_cache(B, cap)
        features = torch.zeros(B, cap, self._feature_width(), dtype=self.compute_dtype, device=dev)
        last = features.new_empty(B, self.target.config.hidden_size)
        t0 = time.perf_counter()
        for start, stop in prefill_chunks(lens_host, self.prefill_overhead_tokens):
            n, Tc = stop - start, lens_host[stop - 1]
            hidden, feats = self._forward(tokens[start:stop, :Tc], None, cache.row_range(start, stop),
                                          padded_causal_mask(lens[start:stop], Tc))
            stats.target_forwards += 1
            stats.prefill_forwards += 1
            features[start:stop, :Tc] = feats
            last[start:stop] = hidden[torch.arange(n, device=dev), lens[start:stop] - 1]
        stats.tokens_generated += B
        cache.advance(lens)
        cache.note_max_length(T)
        rows = torch.tensor(order, dtype=torch.long, device=dev)
        seq_ids = torch.tensor([requests[i].seq_id if requests[i].seq_id is not None else i for i in order],
                               dtype=torch.long, device=dev)
        logits = self.target.logits(last)
        first = draw(logits, sampling, seq_ids, lens, gen)
        stats.time_plain_s += time.perf_counter() - t0
        tokens[torch.arange(B, device=dev), lens] = first
        logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=dev)
        logprobs[torch.arange(B, device=dev), lens] = token_logprobs(logits, sampling, first)
        dstate = self.drafter.init_state(B, cap) if self.drafter is not None else None
        return RowBatch(rows, seq_ids, lens.clone(), lens.clone(), torch.ones(B, dtype=torch.long, device=dev),
                      tokens, features, logprobs, cache, dstate, B, max_slots)

    def _plain_step(self, batch: RowBatch, sampling, gen, stats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(emitted [B, 1], their log-probs [B, 1], counts [B])."""
        t0 = time.perf_counter()
        B = batch.rows.numel()
        b_idx = torch.arange(B, device=self.device)
        L = batch.lengths
        roots = batch.tokens[b_idx, L]
        hidden, feats = self._forward(roots[:, None], L[:, None], batch.cache)
        hidden = hidden[:, 0]
        stats.target_forwards += 1
        batch.features[b_idx, L] = feats[:, 0]
        logits = self.target.logits(hidden)
        nxt = draw(logits, sampling, batch.seq_ids, L + 1, gen)
        batch.cache.advance(1)
        stats.plain_steps += 1
        stats.time_plain_s += time.perf_counter() - t0
        return (nxt[:, None], token_logprobs(logits, sampling, nxt)[:, None],
                torch.ones(B, dtype=torch.long, device=self.device))

    def _sd_step(self, batch: RowBatch, sampling, gen, stats,
                 shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(emitted [B, D+1], -1 padded; their log-probs [B, D+1]; counts [B]). Emitted token
        j was predicted at the j-th kept node (root, then the accepted path), so its
        log-prob comes from the verify forward's logits there."""
        t0 = time.perf_counter()
        B, dev = batch.rows.numel(), self.device
        b_idx = torch.arange(B, device=dev)
        L = batch.lengths
        noise = None
        if sampling.mode == "coupled":  # positions L+1 .. L+depth+1: the drafter ranks with it, the target draws
            noise = coupled_noise_table(sampling.seed, batch.seq_ids, L + 1, shape.depth + 1,
                                        self.target.config.vocab_size)
        ctx = DraftContext(self.target, batch.tokens, batch.features, L, sampling, noise)
        tree = self.drafter.propose(batch.draft_state, ctx, shape)
        stats.drafter_forwards += self.drafter.forwards_per_draft(shape)
        t1 = time.perf_counter()
        block = block_tokens(tree, batch.tokens[b_idx, L])
        positions = tree_block_positions(tree, L)
        ancestors = tree_block_mask(tree)
        hidden, feats = self._forward(block, positions, batch.cache, ancestors)
        logits = self.target.logits(hidden)
        stats.target_forwards += 1
        n = block.shape[1]
        if sampling.mode == "rejection":
            probs = process_logits(logits, sampling).exp()
            acc = accept_rejection(tree, probs, gen)
        elif sampling.mode == "coupled":
            node_noise = noise.gather(1, (positions - L[:, None])[..., None].expand(B, n, noise.shape[-1]))
            acc = accept_greedy(tree, coupled_draw(logits, sampling, node_noise), ancestors)
        else:
            acc = accept_greedy(tree, logits.argmax(-1), ancestors)
        keep = acc.kept_block_offsets()
        counts = acc.num_accepted + 1
        kept_hidden = feats.gather(1, keep[..., None].expand(-1, -1, feats.shape[-1]))
        slots = (L[:, None] + torch.arange(keep.shape[1], device=dev)).clamp(max=batch.features.shape[1] - 1)
        batch.features[b_idx[:, None], slots] = kept_hidden
        batch.cache.compact(keep, counts)
        emitted = acc.tokens(tree)
        kept_logits = logits.gather(1, keep[..., None].expand(-1, -1, logits.shape[-1]))
        logprobs = token_logprobs(kept_logits, sampling, emitted)
        stats.sd_steps += 1
        stats.time_draft_s += t1 - t0
        stats.time_verify_s += time.perf_counter() - t1
        return emitted, logprobs, counts
