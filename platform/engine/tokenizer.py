"""The base model's tokenizer, read from the checkpoint folder (never from a hub)."""

from __future__ import annotations

from pathlib import Path

from loraplex.errors import ModelLoadError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(model_path: Path):
    """A transformers tokenizer, or None when the folder has no tokenizer files (ids-only use)."""
    if not any((Path(model_path) / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except Exception as e:  # a broken tokenizer should say where it came from
        raise ModelLoadError(f"cannot load the tokenizer in {model_path}: {e}") from e
