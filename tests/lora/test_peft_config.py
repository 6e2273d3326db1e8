"""validate_adapter_config: plain LoRA configs pass; every non-plain feature is refused by name."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import pytest
from peft import LoraConfig
from peft.utils.other import get_pattern_key

from loraplex.errors import AdapterError
from loraplex.lora.peft_config import (
    AdapterConfigInfo,
    llama_module_name,
    pattern_key,
    validate_adapter_config,
)
from loraplex.lora.types import TARGET_MODULES


def peft_dict(**kwargs) -> dict:
    """The dict PEFT writes to adapter_config.json for these LoraConfig arguments."""
    cfg = LoraConfig(**{"target_modules": ["q_proj", "v_proj"], **kwargs}).to_dict()
    # What save_pretrained writes: JSON types only (sets become lists, enums strings).
    cfg["target_modules"] = sorted(cfg["target_modules"]) if isinstance(cfg["target_modules"], set) else cfg[
        "target_modules"]
    cfg["peft_type"] = str(getattr(cfg["peft_type"], "value", cfg["peft_type"]))
    cfg.pop("runtime_config", None)
    return cfg


def refused(cfg: dict, *fragments: str) -> str:
    with pytest.raises(AdapterError) as e:
        validate_adapter_config(cfg)
    message = str(e.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def test_plain_lora_config_is_read():
    cfg = peft_dict(r=12, lora_alpha=24, use_rslora=True, target_modules=["up_proj", "q_proj"],
                    layers_to_transform=[2, 0], rank_pattern={"q_proj": 4}, alpha_pattern={"up_proj": 3})
    before = copy.deepcopy(cfg)
    info = validate_adapter_config(cfg)
    assert cfg == before  # pure: the caller's dict is not touched
    assert info == AdapterConfigInfo(
        r=12, lora_alpha=24.0, use_rslora=True, rank_pattern=(("q_proj", 4),), alpha_pattern=(("up_proj", 3.0),),
        target_modules=("q_proj", "up_proj"), layers_to_transform=(0, 2), base_model_name_or_path=None,
    )
    q, up, v = (llama_module_name(1, m) for m in ("q_proj", "up_proj", "v_proj"))
    assert (info.rank_for(q), info.rank_for(up), info.rank_for(v)) == (4, 12, 12)
    assert (info.alpha_for(q), info.alpha_for(up)) == (24.0, 3.0)
    assert info.scale_for(q) == pytest.approx(24 / math.sqrt(4))
    assert info.scale_for(up) == pytest.approx(3 / math.sqrt(12))


def test_default_lora_config_of_installed_peft_is_accepted():
    """Every field of PEFT's LoraConfig at its default passes (a new PEFT field defaulting to 'on' would fail here)."""
    info = validate_adapter_config(peft_dict(target_modules=None))
    assert info.target_modules == TARGET_MODULES and info.layers_to_transform is None
    assert info.r == LoraConfig().r and info.lora_alpha == LoraConfig().lora_alpha


def test_harmless_fields_are_ignored():
    cfg = peft_dict(lora_dropout=0.3, inference_mode=False, init_lora_weights="gaussian", exclude_modules=["o_proj"],
                    layers_pattern="layers", layers_to_transform=1)
    assert validate_adapter_config(cfg).layers_to_transform == (1,)
    for init in (True, False, "eva", "orthogonal", "mica"):
        validate_adapter_config({**cfg, "init_lora_weights": init})


def test_layers_to_transform_empty_list_means_every_layer():
    assert validate_adapter_config(peft_dict(layers_to_transform=[])).layers_to_transform is None


@pytest.mark.parametrize("peft_type", ["IA3", "LOHA", "LOKR", "ADALORA", "PROMPT_TUNING"])
def test_other_peft_types_are_refused_by_name(peft_type):
    refused({**peft_dict(), "peft_type": peft_type}, f"peft_type {peft_type!r}", "LORA")


def test_missing_peft_type_is_refused():
    cfg = peft_dict()
    del cfg["peft_type"]
    refused(cfg, "no peft_type")


@pytest.mark.parametrize(
    "field, value, name",
    [
        ("use_dora", True, "DoRA"),
        ("lora_bias", True, "lora_bias"),
        ("fan_in_fan_out", True, "fan_in_fan_out"),
        ("layer_replication", [[0, 2], [1, 3]], "layer_replication"),
        ("target_parameters", ["mlp.experts.gate_up_proj"], "target_parameters"),
        ("trainable_token_indices", [5, 9], "trainable_token_indices"),
        ("use_qalora", True, "QA-LoRA"),
        ("velora_config", {"num_groups": 4}, "VeLoRA"),
        ("alora_invocation_tokens", [17, 4], "alora_invocation_tokens"),
        ("monteclora_config", {"n_samples": 4}, "MonteCLoRA"),
        ("use_bdlora", {"nblocks": 2}, "BD-LoRA"),
        ("arrow_config", {"top_k": 2}, "Arrow"),
        ("kasa_config", {"beta": 1e-4}, "KaSA"),
    ],
)
def test_non_plain_lora_features_are_refused_by_name(field, value, name):
    refused({**peft_dict(), field: value}, name, field)


def test_every_lora_variant_of_installed_peft_is_refused():
    """PEFT marks the fields that switch on a LoRA variant; each of them changes the math and must be refused."""
    variants = [f.name for f in dataclasses.fields(LoraConfig) if f.metadata.get("is_lora_variant")]
    assert "use_dora" in variants
    for name in variants:
        refused({**peft_dict(), name: {"on": 1}}, name)


def test_modules_to_save_is_refused_naming_the_modules():
    refused(peft_dict(modules_to_save=["lm_head", "embed_tokens"]), "modules_to_save", "lm_head", "embed_tokens")


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_biases_are_refused(bias):
    refused(peft_dict(bias=bias), f"bias={bias!r}", "bias='none'")


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"])
def test_inits_that_rewrite_the_base_weights_are_refused(init):
    refused({**peft_dict(), "init_lora_weights": init}, f"init_lora_weights={init!r}", "base model",
            "path_initial_model_for_weight_conversion")


@pytest.mark.parametrize(
    "targets, named",
    [
        (["q_proj", "embed_tokens"], ["embed_tokens"]),
        (["lm_head", "v_proj"], ["lm_head"]),
        (["model.embed_tokens", "lm_head", "k_proj"], ["lm_head", "model.embed_tokens"]),
        (["c_attn"], ["c_attn"]),
        (["mlp"], ["mlp"]),
    ],
)
def test_unsupported_target_modules_are_refused_by_name(targets, named):
    message = refused({**peft_dict(), "target_modules": targets}, *named, "q_proj, k_proj")
    listed = message.split(" are not supported")[0]  # "target modules a, b"
    assert all(ok not in listed for ok in set(targets) - set(named))


def test_target_module_suffix_paths_are_accepted():
    info = validate_adapter_config({**peft_dict(), "target_modules": ["self_attn.o_proj", "mlp.down_proj"]})
    assert info.target_modules == ("o_proj", "down_proj")


@pytest.mark.parametrize(
    "regex, targets",
    [
        (r".*\.(q|v)_proj", ("q_proj", "v_proj")),
        (r".*layers\.[01]\.mlp\..*_proj", ("gate_proj", "up_proj", "down_proj")),
        (r"model\.layers\.\d+\.self_attn\.o_proj", ("o_proj",)),
        ("ALL-LINEAR", TARGET_MODULES),
    ],
)
def test_string_target_modules_resolve_to_projections(regex, targets):
    assert validate_adapter_config({**peft_dict(), "target_modules": regex}).target_modules == targets


@pytest.mark.parametrize(
    "regex, named",
    [(".*", ["lm_head", "model.embed_tokens"]), (r".*(q_proj|lm_head)", ["lm_head"]),
     (r".*embed_tokens", ["model.embed_tokens"]), (r".*\.mlp", ["model.layers.N.mlp"])],
)
def test_regex_targets_matching_other_modules_are_refused(regex, named):
    refused({**peft_dict(), "target_modules": regex}, repr(regex), *named)


def test_regex_matching_no_projection_is_refused():
    refused({**peft_dict(), "target_modules": r".*\.c_attn"}, "matches no q/k/v/o/gate/up/down projection")
    refused({**peft_dict(), "target_modules": "(unclosed"}, "does not compile")


@pytest.mark.parametrize(
    "field, value",
    [("r", 0), ("r", "8"), ("r", True), ("lora_alpha", "16"), ("lora_alpha", float("nan")),
     ("use_rslora", "yes"), ("rank_pattern", {"q_proj": 0}), ("rank_pattern", ["q_proj"]),
     ("alpha_pattern", {"(q_proj": 4}), ("layers_to_transform", [0, -1]), ("layers_to_transform", "0"),
     ("target_modules", []), ("target_modules", [3]), ("init_lora_weights", "sparse_magic")],
)
def test_malformed_fields_are_refused_by_name(field, value):
    refused({**peft_dict(), field: value}, field)


def test_unknown_fields_are_refused_only_when_set():
    validate_adapter_config({**peft_dict(), "future_option": None, "enable_lora": None, "merge_weights": False})
    refused({**peft_dict(), "future_option": {"mode": "x"}}, "future_option", "does not know")


def test_non_dict_is_refused():
    with pytest.raises(AdapterError, match="JSON object"):
        validate_adapter_config(["r", 8])  # type: ignore[arg-type]


def test_pattern_key_is_peft_get_pattern_key():
    """Same first-match rule as PEFT's get_pattern_key on random module names and pattern lists."""
    rng = random.Random()
    pool = ["q_proj", "proj", "_proj", "k_proj", r"layers\.1\..*", "self_attn.q_proj", r"\d+\.mlp\.up_proj",
            "model.layers.3.self_attn.v_proj", "down_proj", "layers.2.mlp.gate_proj", "mlp", ".*"]
    for _ in range(300):
        name = llama_module_name(rng.randrange(12), rng.choice(TARGET_MODULES))
        keys = rng.sample(pool, rng.randrange(0, 5))
        expected = get_pattern_key(keys, name)
        assert pattern_key(keys, name) == (expected if expected in keys else None), (keys, name)
