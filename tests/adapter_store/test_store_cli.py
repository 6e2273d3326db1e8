"""`loraplex db upgrade`, `loraplex adapters upload` and `loraplex gc` (in-process, real SQLite and files)."""

from __future__ import annotations

import json

from adapter_files import write_peft_adapter, zip_folder
from loraplex.adapter_store import migrate
from loraplex.cli import build_parser, main


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_db_upgrade_upload_and_gc(capsys, tmp_path, tiny_model_dir, tiny_config):
    data = ["--data-dir", str(tmp_path / "data")]
    code, out, _ = cli(capsys, "db", "upgrade", *data)
    assert code == 0 and migrate.head_revision() in out

    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=4)
    common = ["--tenant", "acme", "--model", str(tiny_model_dir), *data]
    code, _, err = cli(capsys, "adapters", "upload", str(folder), "--name", "bot", *common)
    assert code == 2 and "tenant 'acme' does not exist" in err

    code, out, _ = cli(capsys, "adapters", "upload", str(folder), "--name", "bot", "--create-tenant", "--json", *common)
    assert code == 0
    first = json.loads(out)
    assert (first["name"], first["version"], first["rank"], first["status"]) == ("bot", 1, 4, "ready")

    archive = zip_folder(folder, tmp_path / "bot.zip")
    code, out, _ = cli(capsys, "adapters", "upload", str(archive), "--name", "bot", *common)
    assert code == 0 and "version 2" in out

    code, _, err = cli(capsys, "adapters", "upload", str(folder), "--name", "../bot", *common)
    assert code == 2 and "adapter name '../bot' is not allowed" in err

    code, out, _ = cli(capsys, "gc", "--min-age", "0", "--scrub", "--json", *data)
    report = json.loads(out)
    assert code == 0 and report["gc"]["deleted"] == [] and report["scrub"]["checked"] == 2


def test_generate_is_still_there():
    args = build_parser().parse_args(["generate", "hello", "--max-tokens", "3"])
    assert args.prompt == "hello" and args.max_tokens == 3
