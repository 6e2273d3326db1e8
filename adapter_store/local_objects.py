"""Objects as files under one folder; each put writes a temporary file, fsyncs it and renames it in place."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from loraplex.errors import ConfigError

from .errors import BlobMissingError
from .object_store import ObjectInfo, check_key

_TMP = ".tmp"  # partial writes live here until renamed; never listed as objects


class LocalObjectStore:
    def __init__(self, root: str | Path):
        if not str(root):
            raise ConfigError("the local object store needs a folder (file:///path)")
        self.root = Path(root).expanduser().absolute()
        self.url = f"file://{self.root}"
        (self.root / _TMP).mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / _TMP / f"{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(final.parent)

    def get(self, key: str) -> bytearray:
        # A bytearray read in place: one copy from the page cache, and writable memory that decoded
        # tensors can alias (codec.decode_tensors) instead of copying again.
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = bytearray(size)
                if f.readinto(data) != size:
                    raise BlobMissingError(f"object {key} in {self.url} changed size while being read")
                return data
        except FileNotFoundError:
            raise BlobMissingError(f"object {key} is missing from {self.url}") from None

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            if Path(dirpath) == self.root:
                dirnames[:] = [d for d in dirnames if d != _TMP]
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:  # deleted while we walked
                    continue
                yield ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def remove_partial_writes(self, older_than_s: float) -> int:
        removed, cutoff = 0, time.time() - older_than_s
        for path in (self.root / _TMP).iterdir():
            try:
                if path.stat().st_mtime <= cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
