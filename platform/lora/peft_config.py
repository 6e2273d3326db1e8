"""Validate a PEFT ``adapter_config.json``: plain LoRA on Llama projections, or a refusal naming the feature.

This is pure (dict in, info out) so that the loader and the adapter store's upload check give the same
answers with the same messages. The weights file, not this config, decides which (layer, module) pairs
exist; the config supplies ranks and alphas and is checked for features loraplex cannot serve.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

from loraplex.errors import AdapterError
from loraplex.lora.types import TARGET_MODULES

# Which block each projection sits in, in a Llama-family decoder (Llama, Qwen2, Mistral share the names).
MODULE_BLOCK: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

# Regex target_modules are matched against module names of this many layers; more than any served model.
_REGEX_PROBE_LAYERS = 160

# Fields that do not change what the saved A and B mean at inference time.
_IGNORED_FIELDS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "lora_dropout", "init_lora_weights", "exclude_modules", "layers_pattern",
    "megatron_config", "megatron_core", "runtime_config", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "qalora_group_size", "ensure_weight_tying",
    # Checked (or read) explicitly below.
    "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "layers_to_transform",
    "bias", "modules_to_save",
})

# Fields whose set (truthy) value changes the forward math or the meaning of the weights: name -> why.
_REFUSED_WHEN_SET: dict[str, str] = {
    "use_dora": "DoRA (use_dora=true) is not supported: its magnitude vector changes the forward pass; "
                "train a plain LoRA adapter",
    "lora_bias": "lora_bias=true is not supported: the adapter adds a bias to lora_B",
    "fan_in_fan_out": "fan_in_fan_out=true is not supported: it is for GPT-2 style Conv1D weights, "
                      "Llama projections are nn.Linear",
    "layer_replication": "layer_replication is not supported: it duplicates base-model layers",
    "target_parameters": "target_parameters is not supported: LoRA on raw parameters (not on "
                         "q/k/v/o/gate/up/down projections) cannot be served",
    "trainable_token_indices": "trainable_token_indices is not supported: it trains rows of the embedding",
    "use_qalora": "QA-LoRA (use_qalora=true) is not supported: it pools the input by groups before lora_A",
    "velora_config": "VeLoRA (velora_config) is not supported: it is a LoRA variant loraplex does not implement",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens) is not supported: it applies the "
                               "adapter only after the invocation tokens",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported: it samples the LoRA weights",
    "use_bdlora": "BD-LoRA (use_bdlora) is not supported: its A or B factor is stored block-diagonal",
    "arrow_config": "Arrow routing (arrow_config) is not supported: it routes between several LoRA experts",
    "kasa_config": "KaSA (kasa_config) is not supported: it truncates the base weight and adds a "
                   "singular-value diagonal between A and B",
}

# init_lora_weights values whose initialisation also rewrites the base weights (W_res = W - scale * B0 A0):
# the saved A and B are only right on top of that rewritten base, not the original one.
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_HARMLESS_INITS = ("gaussian", "eva", "orthogonal", "mica")


@dataclass(frozen=True)
class AdapterConfigInfo:
    """What loraplex reads from a valid adapter_config.json.

    Patterns are (regex key, value) pairs in file order: PEFT's rule is that the first key matching a
    module name wins, so the order matters (a tuple keeps it, and keeps the info immutable).
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]
    target_modules: tuple[str, ...]  # the projections the config may target, in TARGET_MODULES order
    layers_to_transform: tuple[int, ...] | None  # None: every layer
    base_model_name_or_path: str | None = None

    def rank_for(self, module_name: str) -> int:
        """The rank PEFT gives the module named like ``model.layers.3.self_attn.q_proj``."""
        key = pattern_key([k for k, _ in self.rank_pattern], module_name)
        return dict(self.rank_pattern)[key] if key is not None else self.r

    def alpha_for(self, module_name: str) -> float:
        key = pattern_key([k for k, _ in self.alpha_pattern], module_name)
        return dict(self.alpha_pattern)[key] if key is not None else self.lora_alpha

    def scale_for(self, module_name: str) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        rank = self.rank_for(module_name)
        alpha = self.alpha_for(module_name)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


@lru_cache(maxsize=4096)  # asked for every module of every load: a few hundred distinct names
def llama_module_name(layer: int, module: str) -> str:
    """The module's name in a transformers Llama-family model, which PEFT matches patterns against."""
    return f"model.layers.{layer}.{MODULE_BLOCK[module]}.{module}"


def pattern_key(keys: list[str], module_name: str) -> str | None:
    """The first key that matches module_name under PEFT's rule (peft.utils.other.get_pattern_key)."""
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return key
    return None


def validate_adapter_config(cfg: dict) -> AdapterConfigInfo:
    """Check an adapter_config.json dict; raise AdapterError naming any feature loraplex cannot serve."""
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter_config.json must hold a JSON object, got {type(cfg).__name__}")
    _check_peft_type(cfg)
    for name, why in _REFUSED_WHEN_SET.items():
        if _is_set(cfg.get(name)):
            raise AdapterError(f"{why} (found {name}={cfg[name]!r})")
    _check_modules_to_save(cfg.get("modules_to_save"))
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(
            f"bias={bias!r} is not supported: the adapter trains base-model biases; only bias='none' can be served"
        )
    _check_init(cfg.get("init_lora_weights", True))
    unknown = sorted(k for k in cfg if k not in _IGNORED_FIELDS and k not in _REFUSED_WHEN_SET and _is_set(cfg[k]))
    if unknown:
        shown = ", ".join(f"{k}={cfg[k]!r}" for k in unknown)
        raise AdapterError(
            f"adapter_config.json sets fields loraplex does not know ({shown}); refused because they may "
            f"change the adapter's math (made by a newer PEFT?)"
        )

    r = _positive_int(cfg.get("r", 8), "r")
    lora_alpha = _finite_number(cfg.get("lora_alpha", 8), "lora_alpha")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"use_rslora must be true or false, got {use_rslora!r}")
    rank_pattern = tuple((k, _positive_int(v, f"rank_pattern[{k!r}]")) for k, v in _pattern(cfg, "rank_pattern"))
    alpha_pattern = tuple((k, _finite_number(v, f"alpha_pattern[{k!r}]")) for k, v in _pattern(cfg, "alpha_pattern"))
    return AdapterConfigInfo(
        r=r,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        target_modules=_target_modules(cfg.get("target_modules")),
        layers_to_transform=_layers(cfg.get("layers_to_transform")),
        base_model_name_or_path=cfg.get("base_model_name_or_path") or None,
    )


def _is_set(value: object) -> bool:
    """A field counts as used when it holds anything but its 'off' value (None, false, empty)."""
    return not (value is None or value is False or value == "" or value == [] or value == {})


def _check_peft_type(cfg: dict) -> None:
    peft_type = cfg.get("peft_type")
    if peft_type is None:
        raise AdapterError("adapter_config.json has no peft_type; only LoRA adapters (peft_type 'LORA') are served")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(
            f"peft_type {peft_type!r} is not supported; only LoRA adapters (peft_type 'LORA') are served"
        )


def _check_modules_to_save(value: object) -> None:
    if not _is_set(value):
        return
    names = value if isinstance(value, list) else [value]
    raise AdapterError(
        f"modules_to_save {names} is not supported: the adapter ships whole replacement modules "
        f"({', '.join(map(str, names))}) instead of LoRA weights"
    )


def _check_init(value: object) -> None:
    if isinstance(value, bool):
        return
    if not isinstance(value, str):
        raise AdapterError(f"init_lora_weights must be true, false or a method name, got {value!r}")
    method = value.lower()
    if any(method.startswith(m) for m in _BASE_MUTATING_INITS):
        raise AdapterError(
            f"init_lora_weights={value!r} is not supported: that initialisation also rewrites the base model's "
            f"weights, so the adapter is only correct on that rewritten base; save it with PEFT's "
            f"path_initial_model_for_weight_conversion to get a plain LoRA adapter"
        )
    if method not in _HARMLESS_INITS:
        raise AdapterError(f"init_lora_weights={value!r} is not a LoRA initialisation loraplex knows")


def _target_modules(value: object) -> tuple[str, ...]:
    if value is None:  # PEFT filled in its default for the model type; the weights file says which
        return TARGET_MODULES
    if isinstance(value, str):
        if value.lower() == "all-linear":  # PEFT: every nn.Linear except the output head
            return TARGET_MODULES
        return _regex_targets(value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise AdapterError(f"target_modules must be a list of module names or a regex string, got {value!r}")
    if not value:
        raise AdapterError("target_modules is empty: the adapter targets no module")
    # PEFT targets a module when its name equals an entry or ends with "." + entry; only the last
    # component can name a projection.
    bad = sorted({t for t in value if t.rsplit(".", 1)[-1] not in TARGET_MODULES})
    if bad:
        raise AdapterError(_unsupported_targets_message(bad))
    leaves = {t.rsplit(".", 1)[-1] for t in value}
    return tuple(m for m in TARGET_MODULES if m in leaves)


def _regex_targets(pattern: str) -> tuple[str, ...]:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise AdapterError(f"target_modules regex {pattern!r} does not compile: {e}") from e
    matched = [name for name in _llama_module_names() if compiled.fullmatch(name)]
    bad = sorted({_generic_name(n) for n in matched if n.rsplit(".", 1)[-1] not in TARGET_MODULES})
    if bad:
        raise AdapterError(f"target_modules regex {pattern!r} matches modules that cannot be served: "
                           + _unsupported_targets_message(bad))
    leaves = {n.rsplit(".", 1)[-1] for n in matched}
    found = tuple(m for m in TARGET_MODULES if m in leaves)
    if not found:
        raise AdapterError(
            f"target_modules regex {pattern!r} matches no q/k/v/o/gate/up/down projection of a Llama-family model"
        )
    return found


def _unsupported_targets_message(names: list[str]) -> str:
    return (
        f"target modules {', '.join(names)} are not supported: only LoRA on {', '.join(TARGET_MODULES)} "
        f"can be served (embedding and lm_head LoRA are not supported)"
    )


def _llama_module_names() -> list[str]:
    """Every module name of a transformers Llama-family causal LM (what a regex target is matched against)."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for i in range(_REGEX_PROBE_LAYERS):
        layer = f"model.layers.{i}"
        names += [layer, f"{layer}.self_attn", f"{layer}.mlp", f"{layer}.mlp.act_fn",
                  f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
        names += [f"{layer}.{block}.{module}" for module, block in MODULE_BLOCK.items()]
    return names


def _generic_name(name: str) -> str:
    """model.layers.7.mlp -> model.layers.N.mlp, so a message lists each kind of module once."""
    return re.sub(r"\.layers\.\d+", ".layers.N", name)


def _pattern(cfg: dict, field: str) -> list[tuple[str, object]]:
    value = cfg.get(field) or {}
    if not isinstance(value, dict):
        raise AdapterError(f"{field} must map module-name patterns to values, got {value!r}")
    for key in value:
        try:
            re.compile(rf"(.*\.)?({key})$")
        except re.error as e:
            raise AdapterError(f"{field} key {key!r} is not a valid regex: {e}") from e
    return list(value.items())


def _layers(value: object) -> tuple[int, ...] | None:
    if value is None or value == []:  # PEFT treats an empty list as "every layer"
        return None
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise AdapterError(f"layers_to_transform must be a layer index or a list of them, got {value!r}")
    return tuple(sorted(set(items)))


def _positive_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"{field} must be a positive integer, got {value!r}")
    return value


def _finite_number(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterError(f"{field} must be a finite number, got {value!r}")
    return float(value)
