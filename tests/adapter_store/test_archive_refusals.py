"""Archive uploads that could escape the staging folder or explode are refused, leaving nothing behind."""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from adapter_files import tar_gz_folder, tar_gz_with, write_peft_adapter, zip_folder
from loraplex.adapter_store import UploadFile
from loraplex.errors import AdapterError
from store_helpers import assert_nothing_stored, folder_files, new_tenant

LIMIT = 300_000


@pytest.fixture
def store(make_store):
    return make_store(max_upload_bytes=LIMIT, max_archive_members=8)


@pytest.fixture
def good(tiny_config, tmp_path) -> Path:
    return write_peft_adapter(tmp_path / "good", tiny_config, r=4)


def refuse(store, archive: Path, *fragments: str) -> None:
    tenant = new_tenant(store)
    with pytest.raises(AdapterError) as e:
        store.upload(tenant, "bot", [UploadFile(archive.name, archive.read_bytes())])
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))
    assert_nothing_stored(store, tenant)
    # Nothing was written outside staging either.
    assert not (store.uploader.staging_root.parent / "escaped").exists()


def zip_with(path: Path, good: Path, extra: list[tuple[zipfile.ZipInfo, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sorted(good.iterdir()):
            zf.write(p, p.name)
        for info, data in extra:
            zf.writestr(info, data)
    return path


def tar_members(good: Path) -> tuple[list[tarfile.TarInfo], dict[str, bytes]]:
    infos, data = [], {}
    for p in sorted(good.iterdir()):
        infos.append(tarfile.TarInfo(p.name))
        data[p.name] = p.read_bytes()
    return infos, data


def zip_info(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    return info


# -- paths -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("member, why", [
    ("/etc/escaped", "absolute path"),
    ("../escaped", "'..'"),
    ("a/../../escaped", "'..'"),
    ("C:/escaped", "absolute path"),
    ("dir\\escaped", "backslash"),
])
@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
def test_escaping_paths_are_refused(store, good, tmp_path, member, why, kind):
    if kind == "zip":
        archive = zip_with(tmp_path / "up.zip", good, [(zip_info(member, stat.S_IFREG | 0o644), b"x")])
    else:
        infos, data = tar_members(good)
        infos.append(tarfile.TarInfo(member))
        archive = tar_gz_with(tmp_path / "up.tar.gz", infos, {**data, member: b"x"})
    refuse(store, archive, repr(member), why)


def test_nested_folders_are_refused(store, good, tmp_path):
    archive = zip_folder(good, tmp_path / "up.zip", inner="a/b/")
    refuse(store, archive, "nested folder")


def test_files_in_two_folders_are_refused(store, good, tmp_path):
    archive = zip_with(tmp_path / "up.zip", good, [(zip_info("other/adapter_config.json", stat.S_IFREG | 0o644),
                                                    b"{}")])
    refuse(store, archive, "more than one folder")


# -- links and special files -------------------------------------------------------------------------

def test_zip_symlinks_are_refused(store, good, tmp_path):
    archive = zip_with(tmp_path / "up.zip", good, [(zip_info("link", stat.S_IFLNK | 0o777), b"/etc/passwd")])
    refuse(store, archive, "'link'", "symbolic link")


def test_zip_device_files_are_refused(store, good, tmp_path):
    archive = zip_with(tmp_path / "up.zip", good, [(zip_info("dev", stat.S_IFCHR | 0o644), b"")])
    refuse(store, archive, "'dev'", "device or special file")


@pytest.mark.parametrize("kind, why", [
    (tarfile.SYMTYPE, "symbolic link"),
    (tarfile.LNKTYPE, "hard link"),
    (tarfile.CHRTYPE, "device or special file"),
    (tarfile.BLKTYPE, "device or special file"),
    (tarfile.FIFOTYPE, "device or special file"),
])
def test_tar_links_and_devices_are_refused(store, good, tmp_path, kind, why):
    infos, data = tar_members(good)
    special = tarfile.TarInfo("adapter_model.safetensors.extra")
    special.type = kind
    special.linkname = "/etc/passwd"
    archive = tar_gz_with(tmp_path / "up.tar.gz", [special] + infos, data)
    refuse(store, archive, why)


# -- bombs and caps ----------------------------------------------------------------------------------

def test_zip_bomb_is_stopped_at_the_limit(store, good, tmp_path):
    bomb = zipfile.ZipInfo("payload.txt")
    bomb.compress_type = zipfile.ZIP_DEFLATED
    archive = zip_with(tmp_path / "up.zip", good, [(bomb, b"\0" * (50 * LIMIT))])
    assert archive.stat().st_size < LIMIT // 5  # small on the wire, huge unpacked
    refuse(store, archive, "unpacks to more than the 300,000-byte limit")


def test_tar_gz_bomb_is_stopped_at_the_limit(store, good, tmp_path):
    infos, data = tar_members(good)
    infos.append(tarfile.TarInfo("payload.txt"))
    data["payload.txt"] = b"\0" * (50 * LIMIT)
    archive = tar_gz_with(tmp_path / "up.tar.gz", infos, data)
    assert archive.stat().st_size < LIMIT // 5
    refuse(store, archive, "unpacks to more than the 300,000-byte limit")


def test_too_many_members_are_refused(store, good, tmp_path):
    extra = [(zip_info(f"f{i}.txt", stat.S_IFREG | 0o644), b"x") for i in range(10)]
    refuse(store, zip_with(tmp_path / "up.zip", good, extra), "entries", "limit of 8")


def test_archive_over_the_upload_cap_is_refused(store, tmp_path):
    archive = tmp_path / "up.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("README.md", bytes(range(256)) * (LIMIT // 200))
    refuse(store, archive, "larger than the 300,000-byte limit")


def test_corrupt_archives_are_refused(store, good, tmp_path):
    archive = tmp_path / "up.zip"
    archive.write_bytes(b"PK\x03\x04 definitely not a zip")
    refuse(store, archive, "not a valid zip")
    tgz = tar_gz_folder(good, tmp_path / "up.tar.gz")
    tgz.write_bytes(tgz.read_bytes()[: tgz.stat().st_size // 2])
    refuse(store, tgz, "not a valid tar.gz")


def test_pickles_inside_archives_are_refused(store, good, tmp_path):
    archive = zip_with(tmp_path / "up.zip", good, [(zip_info("adapter_model.bin", stat.S_IFREG | 0o644),
                                                    b"\x80\x04K\x01.")])
    refuse(store, archive, "pickle files (adapter_model.bin)")


def test_an_archive_must_come_alone(store, good, tmp_path):
    archive = zip_folder(good, tmp_path / "up.zip")
    tenant = new_tenant(store)
    with pytest.raises(AdapterError, match="must be the only file"):
        store.upload(tenant, "bot", folder_files(good) + [UploadFile("up.zip", archive.read_bytes())])
    assert_nothing_stored(store, tenant)


def test_bad_archive_names_are_refused(store, good, tmp_path):
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as zf:
        for p in good.iterdir():
            zf.write(p, p.name)
    tenant = new_tenant(store)
    with pytest.raises(AdapterError, match="archive name"):
        store.upload(tenant, "bot", [UploadFile("../up.zip", data.getvalue())])
    assert_nothing_stored(store, tenant)
