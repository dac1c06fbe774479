"""`LMConfig`: the shape of a Llama / Qwen2 family decoder-only LM.

Round-trips with HF ``config.json`` (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``).
Validation happens at construction; every error names the field.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Family = Literal["llama", "qwen2"]

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2"}


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
        if self.rms_norm_eps <= 0:
            raise ValueError(f"LMConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"LMConfig.{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_query_groups(self) -> int:
        return self.num_kv_heads

    # ---- HF config.json ---------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
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
        if self.family == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "LMConfig":
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
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act must be 'silu', got {cfg['hidden_act']!r}")
        if cfg.get("rope_scaling"):
            raise ValueError(f"{source}: rope_scaling is not supported, got {cfg['rope_scaling']!r}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing}")
        eos = cfg.get("eos_token_id", 2)
        if isinstance(eos, list):
            eos = eos[0]
        heads = cfg["num_attention_heads"]
        return cls(
            family=family,  # type: ignore[arg-type]
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or 0,
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            bos_token_id=cfg.get("bos_token_id") if cfg.get("bos_token_id") is not None else 1,
            eos_token_id=eos if eos is not None else 2,
            pad_token_id=cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None else 0,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
