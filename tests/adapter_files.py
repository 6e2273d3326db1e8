"""Fast PEFT-format adapters for store tests: the files PEFT's save_pretrained writes, made directly.

make_peft_adapter (tests/factories.py) runs real PEFT, ~0.1 s each; the scale tests need thousands.
test_adapter_files.py checks that this writer and real PEFT produce the same file format.
"""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.lora.peft_config import MODULE_BLOCK
from loraplex.models.config import ModelConfig

BASE_CONFIG = {
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": False,
    "inference_mode": True, "init_lora_weights": True, "lora_dropout": 0.0, "use_dora": False,
    "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
    "layers_to_transform": None, "base_model_name_or_path": None,
}


def peft_tensors(model: ModelConfig, r: int, targets=("q_proj", "v_proj"), gen: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float32, layers=None) -> dict[str, torch.Tensor]:
    out = {}
    for layer in (range(model.num_layers) if layers is None else layers):
        for module in targets:
            fan_in, fan_out = model.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.{MODULE_BLOCK[module]}.{module}"
            out[f"{prefix}.lora_A.weight"] = (torch.randn(r, fan_in, generator=gen) * 0.1).to(dtype)
            out[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, r, generator=gen) * 0.1).to(dtype)
    return out


def write_peft_adapter(folder: Path, model: ModelConfig, r: int = 4, targets=("q_proj", "v_proj"),
                       alpha: float = 8, seed: int | None = None, dtype: torch.dtype = torch.float32,
                       readme: bool = True, **config_changes) -> Path:
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(BASE_CONFIG, r=r, lora_alpha=alpha, target_modules=list(targets))
    cfg.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(peft_tensors(model, r, targets, gen, dtype), str(folder / "adapter_model.safetensors"))
    if readme:
        (folder / "README.md").write_text("---\nlibrary_name: peft\n---\n")
    return folder


def zip_folder(folder: Path, out: Path, inner: str = "") -> Path:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sorted(folder.iterdir()):
            zf.write(p, f"{inner}{p.name}")
    return out


def tar_gz_folder(folder: Path, out: Path, inner: str = "") -> Path:
    with tarfile.open(out, "w:gz") as tf:
        for p in sorted(folder.iterdir()):
            tf.add(p, f"{inner}{p.name}")
    return out


def tar_gz_with(out: Path, members: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> Path:
    """A .tar.gz with hand-made members (links, devices, odd names)."""
    data = data or {}
    with tarfile.open(out, "w:gz") as tf:
        for info in members:
            body = data.get(info.name)
            if body is not None:
                info.size = len(body)
                tf.addfile(info, io.BytesIO(body))
            else:
                tf.addfile(info)
    return out
