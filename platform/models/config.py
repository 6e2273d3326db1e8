"""The base model's shape, read from a Hugging Face config.json (transformers 4.x or 5.x)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.errors import ModelLoadError


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code and the pager need to know about a Llama-family decoder."""

    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Normalised rope scaling: None for plain RoPE, else a dict with "rope_type" in
    # {"linear", "llama3", "yarn"} and that type's parameters (see models/rope.py).
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    mlp_bias: bool = False
    o_bias: bool = False  # o_proj bias (Llama's attention_bias also puts a bias on o_proj)
    sliding_window: int | None = None  # when set, loraplex caps the context at this length
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: torch.dtype | None = None  # the checkpoint's own dtype, if stated
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]


# ---------------------------------------------------------------------------------------------
# Reading config.json
# ---------------------------------------------------------------------------------------------

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Parameters each scaled RoPE type cannot do without (yarn's factor may be derived, see rope.py).
_REQUIRED_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
# "swish" is the same function as SiLU (transformers maps both names to nn.SiLU).
_SILU_NAMES = ("silu", "swish")
# What transformers' config classes assume when config.json leaves a key out.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 131072}
_DEFAULT_MISTRAL_WINDOW = 4096
_DEFAULT_QWEN2_WINDOW = 4096
_DEFAULT_QWEN2_MAX_WINDOW_LAYERS = 28


def _require(d: dict, key: str, model_type: str) -> object:
    if d.get(key) is None:
        raise ModelLoadError(f"config.json of this {model_type} model has no {key!r}")
    return d[key]


def _positive_int(d: dict, key: str, model_type: str) -> int:
    value = _require(d, key, model_type)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


def _rope_from_dict(d: dict, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, normalised rope_scaling) from a 4.x or 5.x config dict.

    transformers 5.x writes ``rope_parameters = {"rope_theta": ..., "rope_type": ..., <params>}``;
    4.x writes ``rope_theta`` at the top level and ``rope_scaling`` (type key ``type`` or
    ``rope_type``, or null). Values in ``rope_parameters`` win, as they do in transformers.
    """
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"config.json: rope parameters must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(
            f"config.json: per-layer RoPE parameters (keys {sorted(params)}) are not supported"
        )
    theta = params.get("rope_theta", d.get("rope_theta"))
    theta = float(theta) if theta is not None else _DEFAULT_ROPE_THETA
    if theta <= 0:
        raise ModelLoadError(f"config.json: rope_theta must be positive, got {theta}")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"config.json: partial_rotary_factor={partial} (partial RoPE) is not supported")

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"RoPE type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling = {
        k: v for k, v in params.items()
        if k not in ("type", "rope_type", "rope_theta", "partial_rotary_factor")
    }
    if rope_type in ("llama3", "yarn"):
        # transformers falls back to max_position_embeddings when the pretraining length is not stated.
        if scaling.get("original_max_position_embeddings") is None:
            scaling["original_max_position_embeddings"] = d.get("original_max_position_embeddings") or max_positions
    missing = [k for k in _REQUIRED_ROPE_KEYS[rope_type] if scaling.get(k) is None]
    if missing:
        raise ModelLoadError(f"config.json: RoPE type {rope_type!r} needs {', '.join(missing)}")
    if rope_type == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return theta, {"rope_type": rope_type, **scaling}


def _sliding_window(d: dict, model_type: str, num_layers: int) -> int | None:
    if model_type == "mistral":
        window = d.get("sliding_window", _DEFAULT_MISTRAL_WINDOW)
    elif model_type == "qwen2":
        if not d.get("use_sliding_window", False):
            return None
        window = d.get("sliding_window", _DEFAULT_QWEN2_WINDOW)
        # Qwen2 slides only in layers from max_window_layers on (or as layer_types says).
        layer_types = d.get("layer_types")
        if layer_types is not None:
            slides = "sliding_attention" in layer_types
        else:
            slides = d.get("max_window_layers", _DEFAULT_QWEN2_MAX_WINDOW_LAYERS) < num_layers
        if not slides:
            return None
    else:
        return None
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    return window


def _token_ids(value: object, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{key} must be a token id or a list of token ids, got {value!r}")
    return tuple(values)


def _dtype(d: dict) -> torch.dtype | None:
    name = d.get("dtype", d.get("torch_dtype"))
    if name is None:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelLoadError(f"config.json: dtype {name!r} is not a floating-point torch dtype")
    return dtype


def model_config_from_dict(d: dict, generation_config: dict | None = None) -> ModelConfig:
    """Build a ModelConfig from the contents of config.json (and generation_config.json, if any).

    Refuses, with ModelLoadError, anything the model code cannot run: other model types,
    activations other than SiLU, RoPE types other than default/linear/llama3/yarn, bad shapes.
    """
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act not in _SILU_NAMES:
        raise ModelLoadError(f"hidden_act {hidden_act!r} is not supported; only 'silu' (SwiGLU) is")

    hidden = _positive_int(d, "hidden_size", model_type)
    num_heads = _positive_int(d, "num_attention_heads", model_type)
    num_layers = _positive_int(d, "num_hidden_layers", model_type)
    kv_heads = d.get("num_key_value_heads") or num_heads
    if num_heads % kv_heads:
        raise ModelLoadError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = d.get("head_dim")
    if head_dim is None:
        if hidden % num_heads:
            raise ModelLoadError(f"hidden_size={hidden} is not divisible by num_attention_heads={num_heads}")
        head_dim = hidden // num_heads
    if head_dim % 2:
        raise ModelLoadError(f"head_dim={head_dim} is odd; RoPE needs an even head dimension")
    max_positions = d.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type]
    rope_theta, rope_scaling = _rope_from_dict(d, max_positions)

    if model_type == "llama":
        # Llama's attention_bias puts a bias on q, k, v and o alike.
        attention_bias = o_bias = bool(d.get("attention_bias", False))
        mlp_bias = bool(d.get("mlp_bias", False))
    elif model_type == "qwen2":
        attention_bias, o_bias, mlp_bias = True, False, False  # fixed by Qwen2's architecture
    else:
        attention_bias = o_bias = mlp_bias = False  # Mistral has no biases

    gen = generation_config or {}
    # generation_config.json is what generation actually stops on; config.json is the fallback.
    eos = gen.get("eos_token_id")
    eos = d.get("eos_token_id") if eos is None else eos
    bos = gen.get("bos_token_id")
    bos = d.get("bos_token_id") if bos is None else bos
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
        raise ModelLoadError(f"bos_token_id must be a token id, got {bos!r}")

    return ModelConfig(
        architecture=model_type,
        vocab_size=_positive_int(d, "vocab_size", model_type),
        hidden_size=hidden,
        intermediate_size=_positive_int(d, "intermediate_size", model_type),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        o_bias=o_bias,
        sliding_window=_sliding_window(d, model_type, num_layers),
        eos_token_ids=_token_ids(eos, "eos_token_id"),
        bos_token_id=bos,
        torch_dtype=_dtype(d),
        raw=dict(d),
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_model_config(path: str | Path) -> ModelConfig:
    """Read config.json (and generation_config.json, for eos ids) from a checkpoint folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json")
    gen_path = folder / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else None
    return model_config_from_dict(_read_json(config_path), generation)
