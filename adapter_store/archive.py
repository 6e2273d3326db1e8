"""Unpack one .zip or .tar.gz upload into a folder, refusing anything that could escape or explode.

Refused: absolute paths, '..', links (symbolic or hard), device files, FIFOs, more than
max_members entries, files in nested folders, and more than max_bytes of unpacked data. Bytes are
counted as they are decompressed (headers can lie), so a decompression bomb stops at the limit.
"""

from __future__ import annotations

import gzip
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from loraplex.errors import AdapterError

from .upload_rules import UploadLimits, check_file_name

_CHUNK = 1 << 20
# Tar headers and padding add at most this much over the files' own bytes in an honest archive.
_TAR_OVERHEAD_PER_MEMBER = 1024


class _Budget:
    """Bytes left to unpack; raises the bomb refusal when spent."""

    def __init__(self, limit: int, what: str, shown_limit: int | None = None):
        self.left = limit
        self.limit = shown_limit if shown_limit is not None else limit  # what the user configured
        self.what = what

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise AdapterError(
                f"{self.what} unpacks to more than the {self.limit:,}-byte limit; refused (a decompression "
                f"bomb, or an adapter over the size cap)"
            )


class _BoundedReader:
    """A file object over the decompressed stream that refuses to yield more than the budget allows."""

    def __init__(self, raw: IO[bytes], budget: _Budget):
        self._raw = raw
        self._budget = budget

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n if n is not None and n >= 0 else _CHUNK)
        self._budget.spend(len(data))
        return data


def extract_archive(archive: Path, filename: str, dest: Path, limits: UploadLimits) -> None:
    """Unpack archive (named filename by the client) into dest as plain files."""
    lower = filename.lower()
    try:
        if lower.endswith(".zip"):
            _extract_zip(archive, filename, dest, limits)
        else:
            _extract_tar_gz(archive, filename, dest, limits)
    except (zipfile.BadZipFile, tarfile.TarError, zlib.error, gzip.BadGzipFile, EOFError) as e:
        raise AdapterError(f"archive {filename!r} is not a valid {'zip' if lower.endswith('.zip') else 'tar.gz'} "
                           f"file: {e}") from e


def _member_target(raw_name: str, filename: str, dest: Path) -> tuple[Path, list[str]] | None:
    """(flat destination, path parts) of a member, None for the archive's root entry; refuses unsafe names."""
    where = f"archive {filename!r} member {raw_name!r}"
    if raw_name.startswith(("/", "\\")) or (len(raw_name) > 1 and raw_name[1] == ":"):
        raise AdapterError(f"{where} has an absolute path; refused")
    if "\\" in raw_name:
        raise AdapterError(f"{where} contains a backslash; refused")
    parts = [p for p in PurePosixPath(raw_name).parts if p not in ("", ".")]
    if ".." in parts:
        raise AdapterError(f"{where} contains '..'; refused")
    if not parts:
        return None
    return dest / check_file_name(parts[-1], where), parts


def _place(parts: list[str], is_dir: bool, filename: str, raw_name: str, seen_dir: list[str]) -> bool:
    """Whether to write the member: files may sit at the top or in one common folder (a zipped folder);
    deeper nesting, or files in two folders, is refused. Folder entries are skipped."""
    if is_dir:
        return False
    folder = "/".join(parts[:-1])
    if len(parts) > 2:
        raise AdapterError(f"archive {filename!r} member {raw_name!r} is in a nested folder; put the adapter "
                           f"files at the top of the archive or in one folder")
    if seen_dir and seen_dir[0] != folder:
        raise AdapterError(f"archive {filename!r} holds files in more than one folder ({seen_dir[0] or '.'} and "
                           f"{folder or '.'}); put the adapter files in one folder")
    if not seen_dir:
        seen_dir.append(folder)
    return True


def _write_member(chunks: Iterator[bytes], target: Path, filename: str, raw_name: str, budget: _Budget) -> None:
    if target.exists():
        raise AdapterError(f"archive {filename!r} holds {target.name!r} twice")
    with open(target, "xb") as out:
        for chunk in chunks:
            budget.spend(len(chunk))
            out.write(chunk)


def _read_chunks(f: IO[bytes]) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk


def _extract_zip(archive: Path, filename: str, dest: Path, limits: UploadLimits) -> None:
    budget = _Budget(limits.max_bytes, f"archive {filename!r}")
    seen_dir: list[str] = []
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise AdapterError(f"archive {filename!r} has {len(infos)} entries, more than the limit of "
                               f"{limits.max_members}")
        for info in infos:
            where = f"archive {filename!r} member {info.filename!r}"
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise AdapterError(f"{where} is a symbolic link; links are refused")
            if mode and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                raise AdapterError(f"{where} is a device or special file; refused")
            if info.flag_bits & 0x1:
                raise AdapterError(f"{where} is encrypted; refused")
            placed = _member_target(info.filename, filename, dest)
            if placed is None:
                continue
            target, parts = placed
            if not _place(parts, info.is_dir(), filename, info.filename, seen_dir):
                continue
            with zf.open(info) as f:
                _write_member(_read_chunks(f), target, filename, info.filename, budget)


def _extract_tar_gz(archive: Path, filename: str, dest: Path, limits: UploadLimits) -> None:
    budget = _Budget(limits.max_bytes, f"archive {filename!r}")
    # The decompressed stream as a whole (headers and padding too) is bounded, not only member data.
    stream_budget = _Budget(limits.max_bytes + _TAR_OVERHEAD_PER_MEMBER * (limits.max_members + 2),
                            f"archive {filename!r}", shown_limit=limits.max_bytes)
    seen_dir: list[str] = []
    count = 0
    with gzip.open(archive, "rb") as gz:
        with tarfile.open(fileobj=_BoundedReader(gz, stream_budget), mode="r|") as tf:
            for member in tf:
                count += 1
                if count > limits.max_members:
                    raise AdapterError(f"archive {filename!r} has more than the limit of {limits.max_members} "
                                       f"entries")
                where = f"archive {filename!r} member {member.name!r}"
                if member.issym() or member.islnk():
                    raise AdapterError(f"{where} is a {'symbolic' if member.issym() else 'hard'} link; links "
                                       f"are refused")
                if member.ischr() or member.isblk() or member.isfifo() or not (member.isreg() or member.isdir()):
                    raise AdapterError(f"{where} is a device or special file; refused")
                placed = _member_target(member.name, filename, dest)
                if placed is None:
                    continue
                target, parts = placed
                if not _place(parts, member.isdir(), filename, member.name, seen_dir):
                    continue
                f = tf.extractfile(member)
                assert f is not None  # a regular file
                _write_member(_read_chunks(f), target, filename, member.name, budget)
