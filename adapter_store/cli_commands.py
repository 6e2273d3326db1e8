"""`loraplex db upgrade`, `loraplex gc` and `loraplex adapters upload`: the store's command-line verbs."""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import datetime

from loraplex.config import default_cache_dir

from .config import StoreConfig


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    up = db_sub.add_parser("upgrade", help="apply migrations up to the newest schema")
    _store_args(up, model=False)
    up.add_argument("--revision", default="head")
    up.set_defaults(func=_db_upgrade)

    gc = sub.add_parser("gc", help="remove object-store blobs that no adapter points at")
    _store_args(gc, model=False)
    gc.add_argument("--min-age", type=float, default=None,
                    help="seconds an unreferenced blob must have existed to be removed (default 3600)")
    gc.add_argument("--dry-run", action="store_true")
    gc.add_argument("--scrub", action="store_true", help="also re-verify every adapter's blob")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(func=_gc)

    adapters = sub.add_parser("adapters", help="manage adapters in the store")
    a_sub = adapters.add_subparsers(dest="adapters_command", required=True)
    upload = a_sub.add_parser("upload", help="validate and store a PEFT folder or a .zip/.tar.gz archive")
    upload.add_argument("path")
    upload.add_argument("--tenant", required=True)
    upload.add_argument("--name", required=True)
    upload.add_argument("--create-tenant", action="store_true", help="create the tenant if it does not exist")
    _store_args(upload, model=True)
    upload.add_argument("--json", action="store_true")
    upload.set_defaults(func=_adapters_upload)


def _store_args(p: argparse.ArgumentParser, model: bool) -> None:
    p.add_argument("--data-dir", default=None, help="data folder (default: $LORAPLEX_DATA_DIR or "
                                                     "$LORAPLEX_HOME/data)")
    p.add_argument("--database-url", default=None, help="SQLAlchemy URL (default: $LORAPLEX_DATABASE_URL or a "
                                                        "SQLite file in the data folder)")
    p.add_argument("--object-store-url", default=None, help="file:///path or s3://bucket/prefix")
    p.add_argument("--s3-endpoint-url", default=None)
    if model:
        p.add_argument("--model", default="default", help='checkpoint folder, or "default"')
        p.add_argument("--max-lora-rank", type=int, default=256)


def _config(args: argparse.Namespace) -> StoreConfig:
    overrides = dict(database_url=args.database_url, object_store_url=args.object_store_url,
                     s3_endpoint_url=args.s3_endpoint_url, data_dir=args.data_dir,
                     max_lora_rank=getattr(args, "max_lora_rank", None))
    return StoreConfig.from_env(**overrides)


def _db_upgrade(args: argparse.Namespace) -> int:
    from . import migrate

    url = _config(args).resolved_database_url
    migrate.upgrade(url, args.revision)
    print(f"database at revision {migrate.current_revision(url)}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    from .blobs import BlobStore
    from .garbage import collect_garbage, scrub
    from .object_store import open_object_store
    from .registry import Registry

    config = _config(args)
    registry = Registry.open(config.resolved_database_url)
    try:
        blobs = BlobStore(open_object_store(config))
        scrubbed = scrub(registry, blobs) if args.scrub else None
        age = config.gc_min_age_s if args.min_age is None else args.min_age
        report = collect_garbage(registry, blobs, age, args.dry_run)
    finally:
        registry.close()
    if args.json:
        out = {"gc": dataclasses.asdict(report)}
        if scrubbed is not None:
            out["scrub"] = dataclasses.asdict(scrubbed)
        print(json.dumps(out))
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"scanned {report.scanned} blobs; {verb} {len(report.deleted)} ({report.freed_bytes:,} bytes); "
              f"kept {report.kept_young} too young; removed {report.partial_writes_removed} partial writes")
        if scrubbed is not None:
            print(f"scrub: checked {scrubbed.checked}; unhealthy {len(scrubbed.marked_unhealthy)}; "
                  f"healthy again {len(scrubbed.marked_ready)}")
    return 0


def _adapters_upload(args: argparse.Namespace) -> int:
    from loraplex.models.config import load_model_config
    from loraplex.models.default_model import resolve_model_path

    from .store import AdapterStore

    model = load_model_config(resolve_model_path(args.model, default_cache_dir()))
    store = AdapterStore.open(_config(args), model)
    try:
        registry = store.registry
        tenant = registry.ensure_tenant(args.tenant) if args.create_tenant else registry.get_tenant_by_name(args.tenant)
        ref = store.upload_path(tenant.id, args.name, args.path)
    finally:
        store.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(ref), default=_json_default))
    else:
        print(f"uploaded {args.tenant}/{ref.name} version {ref.version} (id {ref.id}, rank {ref.rank}, "
              f"{ref.size_bytes:,} bytes, sha256 {ref.sha256[:12]}...)")
    return 0


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")
