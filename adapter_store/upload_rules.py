"""Which files an adapter upload may hold, and the refusals that do not need the weights parsed.

An upload is a PEFT folder: adapter_config.json and adapter_model.safetensors (README.md, which PEFT
writes beside them, is accepted and dropped). Pickle files are refused by name and by content,
whatever they are called: they are never opened by anything but these first bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from loraplex.errors import AdapterError
from loraplex.lora.peft_loader import CONFIG_FILE, WEIGHTS_FILE

IGNORED_FILES = frozenset({"README.md"})
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int  # the upload as sent, and (for an archive) its unpacked contents, each at most this
    max_members: int  # entries in an archive


def is_archive(filename: str) -> bool:
    return filename.lower().endswith(ARCHIVE_SUFFIXES)


def check_file_name(name: str, where: str = "file") -> str:
    """A plain file name (no folders), in a safe character set."""
    if "/" in name or "\\" in name:
        raise AdapterError(f"{where} name {name!r} contains a path; send plain file names")
    if name in ("", ".", "..") or ".." in name or not _FILE_NAME.match(name):
        raise AdapterError(
            f"{where} name {name!r} is not allowed: use letters, digits, '.', '_' and '-' (no '..')"
        )
    return name


def pickle_kind(head: bytes) -> str | None:
    """What a file's first bytes say it is, if it could carry a pickle."""
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (what torch.save writes, with a pickle inside)"
    if len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a pickle"
    return None


def check_staged_files(folder: Path) -> None:
    """Refuse pickles and unexpected files; require the two PEFT files; drop ignored ones."""
    names = sorted(p.name for p in folder.iterdir())
    pickles = [n for n in names if n.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise AdapterError(
            f"pickle files ({', '.join(pickles)}) are refused and never unpickled; save the adapter as "
            f"{WEIGHTS_FILE} (safe_serialization=True)"
        )
    for name in names:
        if name == WEIGHTS_FILE:
            continue  # the PEFT loader checks its header and names what it really is
        with open(folder / name, "rb") as f:
            kind = pickle_kind(f.read(8))
        if kind is not None:
            raise AdapterError(f"file {name!r} is {kind}; pickle files are refused and never unpickled")
    unexpected = [n for n in names if n not in REQUIRED_FILES and n not in IGNORED_FILES]
    if unexpected:
        raise AdapterError(
            f"unexpected files {', '.join(unexpected)}: an adapter upload holds {CONFIG_FILE} and "
            f"{WEIGHTS_FILE} (README.md is accepted and ignored)"
        )
    missing = [n for n in REQUIRED_FILES if n not in names]
    if missing:
        raise AdapterError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing from the upload")
    for name in IGNORED_FILES & set(names):
        (folder / name).unlink()
