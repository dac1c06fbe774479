"""Per-GPU memory of the training and rollout phases of a colocated RL step, by term.

Contract: pure functions of an ``LMConfig``, the parallel layout and the batch; every
term is a byte count from a formula stated beside it (no measured fudge factors).
``check_fit`` refuses a plan whose largest phase exceeds the GPU's memory, naming the
phase, its largest term and the overflow.

Training (Megatron, bf16 weights, Adam), per GPU of the fullest pipeline stage:
  weights      2 B x P_rank           (P_rank: parameters of the stage / TP, vocab padded)
  gradients    grad_bytes x P_rank    (fp32 main grads by default)
  optimizer    12 B x P_rank / D      (fp32 master + Adam m, v; D = DP with the distributed optimizer, else 1)
  activations  inflight x layers_stage x A_layer, with, per layer and micro-batch (bf16), for
               the layer spec megatron runs (``layer_spec``; nemo_tlt.megatron.gpt_builder):
               ``transformer_engine`` (a GPU with Transformer Engine: fused norms, flash
               attention, fused SwiGLU):
               A_layer = 2 s b (4h + 2q + 2kv + 3f) / t   (sequence parallel: every term split by TP)
               A_layer = 2 s b (4h + (2q + 2kv + 3f) / t) (no sequence parallel)
               i.e. the stored inputs of the two norms and the q/k/v, attention-output,
               fc1 (gate and up) and fc2 inputs; flash attention keeps no s x s scores.
               ``local`` (megatron-core's local spec on torch ops: a CPU, or a GPU without
               Transformer Engine), what autograd saves, counted op by op on the CPU:
               A_layer = s b (20h + (8q + 6 n_h s + 10f) / t) + 8 s d (no sequence
               parallelism: the local spec refuses it): each RMSNorm (torch's rms_norm) keeps its input
               upcast to fp32, the fp32 normalised value and its bf16 output (10 h); the roped
               query, key and value repeated to every query head (GQA), the attention context
               (2 q each); the scores' fp32 softmax and its bf16 copy (6 n_h s, n_h query
               heads); fc1's output (gate and up), silu(gate), up + offset, their product
               (2 f each, 4 for fc1); the rotary tables cast to bf16, cos and sin for the query
               and for the key, [s, 1, 1, d] each whatever b (8 s d, d = head_dim).
               Full recomputation stores each layer's input, 2 s b h / t (sequence parallel) or
               2 s b h (not), plus one layer's A_layer. Selective recomputation (megatron's:
               core attention only) stores what none does here: it drops the s x s scores
               that unfused attention keeps, which flash attention never stores.
               inflight = 1: the policy runs megatron's schedule once per micro-batch
               (micro-batches differ in length: nemo_tlt.policy.megatron_forward.run_schedule),
               so every stage holds one micro-batch's activations (a 1F1B schedule over m
               micro-batches would hold min(pp - p, m) on stage p, at the price of the bubble
               this one pays in full).
  logits       last stage: c B x s b V_pad / t, c = 6: at the loss, the bf16 logits and their one
               fp32 copy (scaled and masked in place, nemo_tlt.policy.megatron_forward); in its
               backward, the fp32 gradient and its bf16 cast; in the output layer's backward,
               the bf16 gradient and its contiguous copy for the weight gradient. c = 8 where the
               vocabulary is padded (V_pad > V, the last TP rank's slice): the padding mask's
               backward writes a second fp32 gradient beside the first. A sampling temperature
               other than 1 does the same (its in-place scale's backward); the plan has no
               temperature and assumes 1. (With the ``local`` spec
               the last stage's activations count the final RMSNorm's 10 s b h too.)
  reserve      CUDA context, NCCL buffers and allocator slack (a configured allowance)

Rollout, per GPU of a rollout replica of TP r:
  weights      2 B x P / r
  kv_cache     2 (K, V) x L x max(1, kv/r) x head_dim x 2 B x kv_tokens, where kv_tokens is the
               paged cache's peak (a finished row frees its pages): the largest
               k x (prompt + k-th longest response) over simulated rollouts, or, when not
               given, the worst case concurrency x (prompt + max response); with a KV budget
               (``rollout.kv_cache_gib``) min(budget, that), the replica decoding at most
               ``kv_budget_rows`` rows at once (the embedded engine's rule: nemo_tlt.model.kv_budget,
               a slot counting the target's K and V and, with SD, the drafter's replicated layer);
               a budget given as ``rollout.kv_cache_fraction`` f is, as the engine reads it when a
               rollout starts (nemo_tlt.rollout.kv_limit), f x (GPU memory - what is held then:
               weights, drafter, the drafter trainer's 16 B per parameter, training_state, reserve;
               not the transients of decoding, logits and workspace, nor the harvest allowance:
               the harvest buffer is in host memory) (``resolve_kv_fraction``)
  drafter      2 B x drafter parameters (replicated on every rollout rank)
  drafter_training  16 B x drafter parameters (fp32 grads + master + Adam) + the harvest buffer
               (TLT with drafter training only)
  logits       4 B x V / r x max(concurrency, sd_rows x (num_verify + 1))
  workspace    CUDA graphs and kernel workspaces (a configured allowance)
  training_state  what the trainer keeps resident during rollout (weights, or everything,
               or nothing when offloaded to host memory)
  reserve      as for training
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.kv_budget import budget_bytes, check_budget_keys, kv_slot_bytes, rows_within, slots_within
from nemo_tlt.plan.cluster import GIB
from nemo_tlt.weights.layout import ParallelLayout

RECOMPUTE = ("none", "selective", "full")  # policy.recompute's names
LAYER_SPECS = ("transformer_engine", "local")  # nemo_tlt.megatron.gpt_builder.layer_spec_name's
TRAINING_STATE = ("offload", "weights", "all")


def layer_parameter_count(cfg: LMConfig) -> int:
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    bias = (q + 2 * kv) if cfg.qkv_bias else 0
    o_bias = h if cfg.o_proj_bias else 0
    return 2 * h + h * q + 2 * h * kv + q * h + 3 * h * f + bias + o_bias


def parameter_count(cfg: LMConfig) -> int:
    """Every parameter of the HF checkpoint (a tied embedding counted once)."""
    vocab = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * layer_parameter_count(cfg) + vocab + cfg.hidden_size


def drafter_parameter_count(cfg: LMConfig, fc_inputs: int = 2) -> int:
    """The EAGLE drafter of nemo_tlt.drafter.eagle: fc (fc_inputs x h -> h, with bias), one
    decoder layer and a norm; embedding and LM head are the target's (not counted)."""
    h = cfg.hidden_size
    return fc_inputs * h * h + h + layer_parameter_count(cfg) + h


def stage_rank_parameters(cfg: LMConfig, layout: ParallelLayout) -> list[int]:
    """Parameters held by one TP rank of every pipeline stage (padded vocab, replicated norms)."""
    layer = layer_parameter_count(cfg)
    norms = 2 * cfg.hidden_size
    per_rank_layer = (layer - norms) // layout.tp + norms
    vocab_part = layout.padded_vocab_size(cfg.vocab_size) // layout.tp * cfg.hidden_size
    out = []
    for p, count in enumerate(layout.stage_layer_counts(cfg.num_layers)):
        n = count * per_rank_layer
        if p == 0:
            n += vocab_part
        if p == layout.pp - 1:
            n += cfg.hidden_size
            if not cfg.tie_word_embeddings or layout.pp > 1:
                n += vocab_part
        out.append(n)
    return out


@dataclass(frozen=True)
class TrainingShape:
    layout: ParallelLayout
    dp: int
    micro_batch: int        # sequences per micro-batch
    seq_len: int            # prompt + max response
    num_micro_batches: int  # per optimizer step and DP rank
    sequence_parallel: bool = True
    recompute: str = "none"
    distributed_optimizer: bool = True
    grad_bytes: int = 4
    reserve_gib: float = 3.0
    layer_spec: str = "transformer_engine"

    def __post_init__(self) -> None:
        check_training_choices(self.recompute, self.layer_spec, self.sequence_parallel)


def check_training_choices(recompute: str, layer_spec: str, sequence_parallel: bool) -> None:
    """The ``training`` block's named choices (``PlanConfig`` and `TrainingShape` alike), refused by key."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"training.recompute must be one of {list(RECOMPUTE)}, got {recompute!r}")
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"training.layer_spec must be one of {list(LAYER_SPECS)}, got {layer_spec!r}")
    if layer_spec == "local" and sequence_parallel:
        raise ValueError("training.layer_spec=local cannot run with training.sequence_parallel=true "
                         "(megatron-core's local norm refuses it: nemo_tlt.policy.megatron_checks)")


def activation_bytes_per_layer(cfg: LMConfig, tokens: int, tp: int, sequence_parallel: bool,
                               layer_spec: str = "transformer_engine", seq_len: int = 0) -> int:
    """A_layer (module docstring) of ``tokens`` = s x b tokens; ``seq_len`` (s) sizes the ``local``
    spec's attention scores."""
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if layer_spec == "local":
        per_token_tp = 8 * q + 6 * cfg.num_heads * seq_len + 10 * f
        return tokens * (20 * h + per_token_tp // tp) + 8 * seq_len * cfg.head_dim
    split = 2 * q + 2 * kv + 3 * f
    if sequence_parallel:
        return 2 * tokens * (4 * h + split) // tp
    return 2 * tokens * (4 * h + split // tp)


def stage_training_memory(cfg: LMConfig, shape: TrainingShape, p: int) -> dict[str, float]:
    """Bytes per GPU of pipeline stage ``p``, by term (see the module docstring)."""
    layout, tokens = shape.layout, shape.micro_batch * shape.seq_len
    params = stage_rank_parameters(cfg, layout)[p]
    layers = layout.stage_layer_counts(cfg.num_layers)[p]
    per_layer = activation_bytes_per_layer(cfg, tokens, layout.tp, shape.sequence_parallel, shape.layer_spec,
                                           shape.seq_len)
    # one micro-batch in flight: one schedule call per micro-batch (module docstring)
    if shape.recompute == "full":
        stored = 2 * tokens * cfg.hidden_size // (layout.tp if shape.sequence_parallel else 1)
        acts = layers * stored + per_layer
    else:
        acts = layers * per_layer
    logits = 0
    if p == layout.pp - 1:
        padded = layout.padded_vocab_size(cfg.vocab_size)
        logits = (8 if padded > cfg.vocab_size else 6) * tokens * padded // layout.tp
        if shape.layer_spec == "local":  # the final RMSNorm's saves
            acts += 10 * tokens * cfg.hidden_size
    terms = {"weights": 2 * params, "gradients": shape.grad_bytes * params,
             "optimizer": 12 * params / (shape.dp if shape.distributed_optimizer else 1),
             "activations": acts, "logits": logits, "reserve": shape.reserve_gib * GIB}
    return {k: float(v) for k, v in terms.items()}


def training_memory(cfg: LMConfig, shape: TrainingShape) -> dict[str, float]:
    """Bytes per GPU of the fullest stage, by term (see the module docstring)."""
    stages = [stage_training_memory(cfg, shape, p) for p in range(shape.layout.pp)]
    return max(stages, key=lambda terms: sum(terms.values()))


@dataclass(frozen=True)
class RolloutShape:
    tp: int
    concurrency: int        # sequences decoded at once by one rollout replica
    context: int            # prompt + max response tokens per sequence
    kv_tokens: int = 0      # peak cached tokens of a replica (0: concurrency x context)
    sd: bool = True
    sd_rows: int = 32       # running sequences at and below which SD is on
    max_num_verify: int = 16
    drafter_training: bool = True
    harvest_bytes: int = 256 * 2 ** 20
    fc_inputs: int = 2
    workspace_gib: float = 4.0
    training_state: str = "offload"
    reserve_gib: float = 3.0
    kv_cache_gib: float | None = None  # KV budget per GPU (None: unbounded)
    kv_cache_fraction: float | None = None  # or: that fraction of the GPU's free memory at rollout start
    gpu_gib: float | None = None  # the GPU's memory (what a kv_cache_fraction is taken of)

    def __post_init__(self) -> None:
        check_budget_keys(self.kv_cache_gib, self.kv_cache_fraction)
        if self.kv_cache_fraction is not None:
            if self.gpu_gib is None or not self.gpu_gib > 0:
                raise ValueError(f"RolloutShape.gpu_gib must be > 0 with a kv_cache_fraction, got {self.gpu_gib!r}")
        if self.training_state not in TRAINING_STATE:
            raise ValueError(f"rollout.training_state must be one of {list(TRAINING_STATE)}, "
                             f"got {self.training_state!r}")


def kv_bytes_per_token(cfg: LMConfig, tp: int, kv_bytes: int = 2) -> int:
    """K and V of one token over all layers, on one GPU of a TP-``tp`` replica."""
    return kv_slot_bytes(cfg.num_layers, max(1, cfg.num_kv_heads // tp), cfg.head_dim, kv_bytes)


def rollout_kv_slot_bytes(cfg: LMConfig, tp: int, sd: bool, kv_bytes: int = 2) -> int:
    """What one cache position of one row holds on one GPU under ``rollout.kv_cache_gib``: the
    target's K and V and, with SD, the drafter's one layer over all KV heads (replicated)."""
    drafter = kv_slot_bytes(1, cfg.num_kv_heads, cfg.head_dim, kv_bytes) if sd else 0
    return kv_bytes_per_token(cfg, tp, kv_bytes) + drafter


def _unresolved(shape: RolloutShape, what: str) -> None:
    if shape.kv_cache_fraction is not None:
        raise ValueError(f"{what}: the shape's rollout.kv_cache_fraction is not resolved to a budget "
                         "(resolve_kv_fraction(cfg, shape, training) first)")


def kv_budget_rows(cfg: LMConfig, shape: RolloutShape, kv_bytes: int = 2) -> int | None:
    """Rows of ``shape.context`` slots a replica decodes at once within its KV budget (None: no budget)."""
    _unresolved(shape, "kv_budget_rows")
    if shape.kv_cache_gib is None:
        return None
    return rows_within(budget_bytes(shape.kv_cache_gib), shape.context,
                       rollout_kv_slot_bytes(cfg, shape.tp, shape.sd, kv_bytes))


def kv_budget_slots(cfg: LMConfig, shape: RolloutShape, rows: int, kv_bytes: int = 2) -> int | None:
    """Cache slots per row that ``rows`` rows may grow to within the KV budget (None: no budget)."""
    _unresolved(shape, "kv_budget_slots")
    if shape.kv_cache_gib is None:
        return None
    return slots_within(budget_bytes(shape.kv_cache_gib), rows,
                        rollout_kv_slot_bytes(cfg, shape.tp, shape.sd, kv_bytes))


def held_at_rollout_start(terms: dict[str, float], shape: RolloutShape) -> float:
    """Bytes a rollout GPU holds when the engine starts a rollout, from ``terms`` (`rollout_memory`'s,
    the KV cache aside): the engine's weights, the drafter, the drafter trainer's state (its term
    less the harvest allowance: the harvest buffer is in host memory), the training state kept
    resident and the reserve (CUDA context among it)."""
    trainer = terms["drafter_training"] - shape.harvest_bytes if terms["drafter_training"] else 0.0
    return terms["weights"] + terms["drafter"] + trainer + terms["training_state"] + terms["reserve"]


def resident_training_state(shape: RolloutShape, training: dict[str, float]) -> float:
    return {"offload": 0.0, "weights": training["weights"],
            "all": training["weights"] + training["gradients"] + training["optimizer"]}[shape.training_state]


def resolve_kv_fraction(cfg: LMConfig, shape: RolloutShape, training: dict[str, float]) -> RolloutShape:
    """``shape`` with a ``kv_cache_fraction`` turned into the ``kv_cache_gib`` the engine would
    take: the fraction of the GPU's memory less what is held at rollout start, in whole bytes as
    ``nemo_tlt.rollout.kv_limit`` floors it (at least 1 B: a GPU with nothing free holds no row).
    Unchanged without a fraction."""
    return _resolved(shape, _terms_but_kv(cfg, shape, training))


def _resolved(shape: RolloutShape, terms: dict[str, float]) -> RolloutShape:
    if shape.kv_cache_fraction is None:
        return shape
    free = max(0.0, shape.gpu_gib * GIB - held_at_rollout_start(terms, shape))
    budget = int(shape.kv_cache_fraction * free)
    return replace(shape, kv_cache_fraction=None, kv_cache_gib=max(budget, 1) / GIB)


def _terms_but_kv(cfg: LMConfig, shape: RolloutShape, training: dict[str, float]) -> dict[str, float]:
    drafter = drafter_parameter_count(cfg, shape.fc_inputs) if shape.sd else 0
    rows = max(shape.concurrency, shape.sd_rows * (shape.max_num_verify + 1) if shape.sd else 0)
    terms = {
        "weights": 2 * parameter_count(cfg) / shape.tp,
        "drafter": 2 * drafter,
        "drafter_training": (16 * drafter + shape.harvest_bytes) if (shape.sd and shape.drafter_training) else 0,
        "logits": 4 * cfg.vocab_size * rows / shape.tp,
        "workspace": shape.workspace_gib * GIB,
        "training_state": resident_training_state(shape, training),
        "reserve": shape.reserve_gib * GIB,
    }
    return {k: float(v) for k, v in terms.items()}


def rollout_memory(cfg: LMConfig, shape: RolloutShape, training: dict[str, float]) -> dict[str, float]:
    terms = _terms_but_kv(cfg, shape, training)
    kv = float(kv_cache_bytes(cfg, _resolved(shape, terms)))
    return {"weights": terms.pop("weights"), "kv_cache": kv, **terms}


def kv_cache_bytes(cfg: LMConfig, shape: RolloutShape) -> int:
    """The rollout's KV term: what the rows need, capped by the KV budget where one is set."""
    _unresolved(shape, "kv_cache_bytes")
    need = kv_bytes_per_token(cfg, shape.tp) * (shape.kv_tokens or shape.concurrency * shape.context)
    return need if shape.kv_cache_gib is None else min(need, budget_bytes(shape.kv_cache_gib))


class PlanDoesNotFit(ValueError):
    """A phase needs more memory per GPU than the GPU has."""


def to_gib(terms: dict[str, float]) -> dict[str, float]:
    return {k: round(v / GIB, 3) for k, v in terms.items()}


def check_fit(memory: dict[str, dict[str, float]], gpu_gib: float) -> None:
    """Raise ``PlanDoesNotFit`` naming every phase over ``gpu_gib``, its largest term and the overflow."""
    problems = []
    for phase, terms in memory.items():
        total = sum(terms.values()) / GIB
        if total > gpu_gib:
            term, value = max(terms.items(), key=lambda kv: kv[1])
            problems.append(f"{phase} needs {total:.1f} GiB per GPU, {total - gpu_gib:.1f} GiB more than the "
                            f"GPU's {gpu_gib:.1f} GiB; largest term {phase}.{term} = {value / GIB:.1f} GiB")
    if problems:
        raise PlanDoesNotFit("plan does not fit: " + "; ".join(problems))
