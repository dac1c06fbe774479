"""`LMConfig`: the shape of a Llama / Qwen2 family decoder-only LM.

Round-trips with HF ``config.json`` (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``)
as transformers 4.x and 5.x write it. Rotary settings are read from either form:
4.x keeps the base at top-level ``rope_theta`` and any scaling in ``rope_scaling``;
5.x keeps both in ``rope_parameters``. Rope types ``default`` and ``llama3``
(Llama-3.1 / 3.3) are supported; any other type, or a rope key whose meaning we
do not implement, is refused with an error naming the file and the key, never
silently ignored. Validation happens at construction; every error names the field.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from nemo_tlt.checks import check_float, check_int

Family = Literal["llama", "qwen2"]

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2"}

# transformers' default base when a file names none (RotaryEmbeddingConfigMixin.default_theta).
_HF_DEFAULT_THETA = 10000.0
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Keys of a rope dict that we implement, per rope_type; any other key is refused.
# `type` is the pre-4.45 spelling of `rope_type`; partial_rotary_factor is accepted at 1.0 only.
_ROPE_KEYS = {
    "default": frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"}),
    "llama3": frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor", *_LLAMA3_KEYS}),
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 rotary frequency scaling (HF ``rope_type: llama3``).

    Frequencies whose wavelength exceeds original_max_position_embeddings /
    low_freq_factor are divided by `factor`; those shorter than
    original_max_position_embeddings / high_freq_factor are kept; those between are
    interpolated smoothly (see nemo_tlt.model.rope.llama3_inv_freq)."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"RopeScaling.rope_type must be 'llama3', got {self.rope_type!r}")
        check_float("RopeScaling.factor", self.factor, lo=1.0)
        check_float("RopeScaling.low_freq_factor", self.low_freq_factor, lo=0.0, lo_open=True)
        check_float("RopeScaling.high_freq_factor", self.high_freq_factor, lo=self.low_freq_factor, lo_open=True)
        check_int("RopeScaling.original_max_position_embeddings", self.original_max_position_embeddings, lo=1)

    def to_hf(self) -> dict[str, Any]:
        """The scaling keys of an HF rope dict (without rope_theta)."""
        return {"rope_type": self.rope_type, "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclass(frozen=True)
class LMConfig:
    family: Family = "llama"
    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 means hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool | None = None  # None means the family default (Qwen2: True, Llama: False)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # None: plain rotary frequencies. A mapping (as `to_dict` writes it) is converted at construction.
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.family not in _HF_ARCH:
            raise ValueError(f"LMConfig.family must be one of {sorted(_HF_ARCH)}, got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LMConfig.{name} must be a positive int, got {value!r}")
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.family == "qwen2")
        if self.family == "qwen2" and not self.qkv_bias:
            raise ValueError("LMConfig.qkv_bias must be True for family 'qwen2' (Qwen2 always has q/k/v biases)")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"LMConfig.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                    "set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"LMConfig.head_dim must be a positive even int (rotary), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LMConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"LMConfig.rope_theta must be > 0, got {self.rope_theta}")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"LMConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"LMConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"LMConfig.{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_query_groups(self) -> int:
        return self.num_kv_heads

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias. HF Llama's
        ``attention_bias`` gives all four projections a bias (q/k/v and o); Qwen2 has
        q/k/v biases and never an o_proj bias. Derived, so it cannot disagree with
        the family and qkv_bias; weight converters check it to refuse what they lack."""
        return self.family == "llama" and bool(self.qkv_bias)

    # ---- HF config.json ---------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict. Rotary settings are written in both forms, so
        that transformers 4.x and 5.x (and tools reading either) agree: top-level
        ``rope_theta`` plus, when scaled, ``rope_scaling`` (4.x), and
        ``rope_parameters`` holding the base and any scaling (what 5.x's
        ``save_pretrained`` writes). 5.x reads ``rope_scaling`` over
        ``rope_parameters`` when both are present; the two hold the same values."""
        cfg: dict[str, Any] = {
            "architectures": [_HF_ARCH[self.family]],
            "model_type": _HF_MODEL_TYPE[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling is None:
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        else:
            cfg["rope_scaling"] = self.rope_scaling.to_hf()
            cfg["rope_parameters"] = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
        if self.family == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "LMConfig":
        family = _hf_family(cfg, source)
        _refuse_unsupported(cfg, family, source)
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing}")
        rope_theta, rope_scaling = _hf_rope(cfg, source)
        eos = cfg.get("eos_token_id", 2)
        if isinstance(eos, list):
            eos = eos[0]
        heads = cfg["num_attention_heads"]
        try:
            return cls(
                family=family,  # type: ignore[arg-type]
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or 0,
                rope_theta=rope_theta,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                qkv_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                bos_token_id=cfg.get("bos_token_id") if cfg.get("bos_token_id") is not None else 1,
                eos_token_id=eos if eos is not None else 2,
                pad_token_id=cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None else 0,
                rope_scaling=rope_scaling,
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """Field values as plain data; ``LMConfig(**to_dict())`` rebuilds the config.
        ``rope_scaling`` is left out when None, so the dict of a config without scaling
        (and any hash of it, e.g. the demo's cache folder names) does not mention the field."""
        d = asdict(self)
        if self.rope_scaling is None:
            del d["rope_scaling"]
        return d


# ---- reading HF config.json ------------------------------------------------

def _hf_family(cfg: dict[str, Any], source: str) -> str:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    family: str | None = None
    for fam, arch in _HF_ARCH.items():
        if arch in archs or model_type == _HF_MODEL_TYPE[fam]:
            family = fam
    if family is None:
        raise ValueError(
            f"{source}: unknown model family (architectures={archs!r}, model_type={model_type!r}); "
            f"supported: {sorted(_HF_ARCH.values())}"
        )
    return family


def _refuse_unsupported(cfg: dict[str, Any], family: str, source: str) -> None:
    """Refuse settings of the family that change the math and that DecoderLM lacks."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act must be 'silu', got {cfg['hidden_act']!r}")
    if family == "llama" and cfg.get("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=true is not supported (the reference LM has no MLP biases)")
    if family == "qwen2":
        if cfg.get("use_sliding_window", False):
            raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")
        other = sorted(set(cfg.get("layer_types") or []) - {"full_attention"})
        if other:
            raise ValueError(f"{source}: layer_types {other} are not supported (full_attention only)")


def _hf_rope_dict(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The rope dict transformers 5.x resolves from ``config.json``: ``rope_scaling``
    (4.x) if present, else ``rope_parameters`` (5.x), with ``rope_theta`` from the
    top level when the dict has none. A file whose forms contradict each other is
    refused rather than read one way or the other."""
    top_theta = cfg.get("rope_theta")
    base = {"rope_theta": _HF_DEFAULT_THETA if top_theta is None else top_theta}
    forms: dict[str, dict[str, Any]] = {}
    for name in ("rope_scaling", "rope_parameters"):
        value = cfg.get(name)
        if value is None or value == {}:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{source}: {name} must be an object, got {value!r}")
        forms[name] = {**base, **value}
    if len(forms) == 2 and forms["rope_scaling"] != forms["rope_parameters"]:
        raise ValueError(f"{source}: rope_scaling {cfg['rope_scaling']!r} and rope_parameters "
                         f"{cfg['rope_parameters']!r} disagree; keep one of them")
    rope = forms.get("rope_scaling") or forms.get("rope_parameters") or base
    if top_theta is not None and rope["rope_theta"] != top_theta:
        raise ValueError(f"{source}: rope_theta={top_theta!r} disagrees with the rope dict's "
                         f"rope_theta={rope['rope_theta']!r}")
    return rope


def _hf_rope(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) of an HF ``config.json``, 4.x or 5.x form."""
    rope = _hf_rope_dict(cfg, source)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if "type" in rope and "rope_type" in rope and rope["type"] != rope["rope_type"]:
        raise ValueError(f"{source}: rope dict has type={rope['type']!r} and rope_type={rope['rope_type']!r}")
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"{source}: rope_type={rope_type!r} is not supported; supported rope_type values: "
                         f"{sorted(_ROPE_KEYS)}")
    unknown = sorted(set(rope) - _ROPE_KEYS[rope_type])
    if unknown:
        raise ValueError(f"{source}: rope key(s) {unknown} are not supported for rope_type={rope_type!r} "
                         f"(they would change the rotary math); supported keys: {sorted(_ROPE_KEYS[rope_type])}")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial!r} is not supported (only 1.0: every "
                         "head dimension is rotated)")
    theta = float(rope["rope_theta"])
    if rope_type == "default":
        return theta, None
    missing = [k for k in _LLAMA3_KEYS[:3] if k not in rope]
    if missing:
        raise ValueError(f"{source}: rope_type='llama3' needs keys {missing}")
    try:
        scaling = RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=_original_max_positions(cfg, rope, source),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: rope dict {rope!r}: {e}") from e
    return theta, scaling


def _original_max_positions(cfg: dict[str, Any], rope: dict[str, Any], source: str) -> int:
    """transformers 5.x takes a top-level original_max_position_embeddings over the
    rope dict's, and falls back to max_position_embeddings; refuse the two disagreeing."""
    top = cfg.get("original_max_position_embeddings")
    inner = rope.get("original_max_position_embeddings")
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"{source}: original_max_position_embeddings={top!r} disagrees with the rope dict's "
                         f"{inner!r}")
    for value in (top, inner):
        if value is not None:
            return value
    return cfg.get("max_position_embeddings", 2048)
