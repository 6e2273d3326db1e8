"""Reading a base model's weights from a checkpoint folder: safetensors only, never pickle."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loraplex.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Weights in these formats are loaded by unpickling, which can run arbitrary code: refused.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _shard_files(folder: Path) -> tuple[list[Path], set[str] | None]:
    """The safetensors files that make up the checkpoint in folder, and the tensor names its index promises."""
    if (folder / INDEX_FILE).is_file():
        try:
            index = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{folder / INDEX_FILE} is not a valid safetensors index: {e!r}") from e
        shards = []
        for name in names:
            # A shard name is a file in this folder, never a path that leads out of it.
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise ModelLoadError(f"{folder / INDEX_FILE} names an invalid shard file {name!r}")
            if not (folder / name).is_file():
                raise ModelLoadError(f"shard {name} listed in {INDEX_FILE} is missing from {folder}")
            shards.append(folder / name)
        if not shards:
            raise ModelLoadError(f"{folder / INDEX_FILE} lists no shards")
        return shards, set(weight_map)
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE], None
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{folder} holds only pickle weights ({', '.join(pickles)}); loraplex reads safetensors only "
            f"because unpickling can run arbitrary code. Convert the checkpoint to {SINGLE_FILE} first."
        )
    raise ModelLoadError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_checkpoint_tensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at path (a folder, or one .safetensors file), on the CPU.

    Floating-point tensors are cast to dtype one at a time, so peak memory stays near one copy
    of the model in dtype; integer tensors (if any) keep their dtype.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        shards, expected = [path], None
    elif path.is_dir():
        shards, expected = _shard_files(path)
    elif path.is_file():
        raise ModelLoadError(f"{path} is not a safetensors file or a checkpoint folder")
    else:
        raise ModelLoadError(f"checkpoint {path} does not exist")

    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in tensors:
                        raise ModelLoadError(f"tensor {name} appears in more than one shard (again in {shard.name})")
                    t = f.get_tensor(name)
                    tensors[name] = t.to(dtype) if t.is_floating_point() else t
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read safetensors file {shard}: {e}") from e
    if expected is not None and not expected <= tensors.keys():
        missing = sorted(expected - tensors.keys())
        raise ModelLoadError(f"{INDEX_FILE} lists tensors that no shard holds: {', '.join(missing[:5])}")
    return tensors
