"""Turn what a client sent (PEFT files, or one .zip/.tar.gz) into a flat folder of checked files.

Everything is written under a private staging folder that the caller removes whatever happens, so a
refused upload leaves nothing behind.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from loraplex.errors import AdapterError

from .archive import extract_archive
from .upload_rules import UploadLimits, check_file_name, check_staged_files, is_archive

_CHUNK = 1 << 20


@dataclass(frozen=True)
class UploadFile:
    """One file as the client named it; content is bytes, an open binary stream or a local path."""

    filename: str
    content: bytes | BinaryIO | Path


def files_from_path(path: Path) -> list[UploadFile]:
    """A local folder's files, or a single file (an archive), as an upload (the CLI's input).

    Links and special files in a folder are refused here rather than followed.
    """
    path = Path(path)
    if path.is_symlink():
        raise AdapterError(f"{path} is a symbolic link; give the folder or archive itself")
    if path.is_dir():
        out = []
        for p in sorted(path.iterdir()):
            if p.is_symlink() or not p.is_file():
                raise AdapterError(f"{p.name!r} in {path} is not a regular file (links and folders are refused)")
            out.append(UploadFile(p.name, p))
        return out
    if path.is_file():
        return [UploadFile(path.name, path)]
    raise AdapterError(f"{path} does not exist")


def stage_upload(files: Sequence[UploadFile], staging: Path, limits: UploadLimits) -> Path:
    """Write the upload into staging/adapter as plain files and check the file set; returns that folder."""
    if not files:
        raise AdapterError("the upload holds no files")
    folder = staging / "adapter"
    folder.mkdir(parents=True)
    budget = [limits.max_bytes]
    if len(files) == 1 and is_archive(files[0].filename):
        name = files[0].filename
        check_file_name(name, "archive")
        archive = staging / "upload.archive"
        _copy_in(files[0], archive, budget, limits.max_bytes)
        extract_archive(archive, name, folder, limits)
        archive.unlink()
    else:
        archives = [f.filename for f in files if is_archive(f.filename)]
        if archives:
            raise AdapterError(f"an archive ({archives[0]}) must be the only file of an upload")
        if len(files) > limits.max_members:
            raise AdapterError(f"the upload has {len(files)} files, more than the limit of {limits.max_members}")
        for f in files:
            target = folder / check_file_name(f.filename)
            if target.exists():
                raise AdapterError(f"the upload holds {f.filename!r} twice")
            _copy_in(f, target, budget, limits.max_bytes)
    check_staged_files(folder)
    return folder


def _copy_in(f: UploadFile, target: Path, budget: list[int], limit: int) -> None:
    """Copy the file in, counting bytes against the upload cap as they arrive."""
    with open(target, "xb") as out:
        for chunk in _chunks(f.content):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise AdapterError(f"the upload is larger than the {limit:,}-byte limit")
            out.write(chunk)


def _chunks(content: bytes | BinaryIO | Path) -> Iterator[bytes]:
    if isinstance(content, (bytes, bytearray, memoryview)):
        view = memoryview(content)
        for start in range(0, len(view), _CHUNK):
            yield bytes(view[start:start + _CHUNK])
        return
    if isinstance(content, Path):
        with open(content, "rb") as f:
            yield from _read(f)
        return
    yield from _read(content)


def _read(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
