"""`loraplex serve`, `loraplex tenants create`, `loraplex keys create`."""

from __future__ import annotations

import argparse
import json
import logging

from .settings import ServerConfig


def add_server_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Every flag also reads LORAPLEX_<FLAG> (e.g. LORAPLEX_PORT); flags win.")
    s.add_argument("--model", help='checkpoint folder, or "default" (SmolLM2-135M-Instruct)')
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--data-dir", help="folder of the SQLite file and the local object store")
    s.add_argument("--database-url", help="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db")
    s.add_argument("--object-store-url", help="file:///path or s3://bucket/prefix")
    s.add_argument("--s3-endpoint-url")
    s.add_argument("--redis-url", help="shared rate limits across replicas")
    s.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    s.add_argument("--device")
    s.add_argument("--pool-bytes", type=int)
    s.add_argument("--max-num-seqs", type=int)
    s.add_argument("--max-num-batched-tokens", type=int)
    s.add_argument("--max-lora-rank", type=int)
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--host-cache-bytes", type=int)
    s.add_argument("--max-waiting-requests", type=int)
    s.add_argument("--drain-timeout-s", type=float)
    s.add_argument("--served-model-name")
    s.add_argument("--default-ttft-target-ms", type=int)
    s.add_argument("--torch-threads", type=int, help="CPU only; default: cores - 1 (at least 1)")
    s.add_argument("--default-requests-per-minute", type=int, help="per tenant, unless set for the tenant")
    s.add_argument("--default-tokens-per-minute", type=int, help="prompt + max_tokens, per tenant")
    s.add_argument("--default-max-concurrent", type=int, help="requests in flight per tenant")
    s.add_argument("--queue-policy", choices=["vtc", "fcfs", "lifo"], help="order of waiting requests (vtc)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=_serve)

    t = sub.add_parser("tenants", help="manage tenants")
    t_sub = t.add_subparsers(dest="tenants_command", required=True)
    tc = t_sub.add_parser("create", help="create a tenant and print its first admin key")
    tc.add_argument("name")
    tc.add_argument("--ttft-target-ms", type=int)
    _db_args(tc)
    tc.add_argument("--json", action="store_true")
    tc.set_defaults(func=_tenants_create)

    ts = t_sub.add_parser("set", help="change a tenant's TTFT target, limits or fair share")
    ts.add_argument("name")
    ts.add_argument("--ttft-target-ms", type=int)
    ts.add_argument("--requests-per-minute", type=int)
    ts.add_argument("--tokens-per-minute", type=int)
    ts.add_argument("--max-concurrent", type=int)
    ts.add_argument("--share", type=float)
    ts.add_argument("--clear", action="append", default=[], metavar="SETTING",
                    help="set a limit back to the server default (repeatable)")
    _db_args(ts)
    ts.add_argument("--json", action="store_true")
    ts.set_defaults(func=_tenants_set)

    k = sub.add_parser("keys", help="manage API keys")
    k_sub = k.add_subparsers(dest="keys_command", required=True)
    kc = k_sub.add_parser("create", help="create an API key for a tenant and print it once")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--role", choices=["user", "admin"], default="user")
    kc.add_argument("--label")
    _db_args(kc)
    kc.add_argument("--json", action="store_true")
    kc.set_defaults(func=_keys_create)


_SERVE_FLAGS = ("model", "host", "port", "data_dir", "database_url", "object_store_url", "s3_endpoint_url",
                "redis_url", "dtype", "device", "pool_bytes", "max_num_seqs", "max_num_batched_tokens",
                "max_lora_rank", "max_model_len", "host_cache_bytes", "max_waiting_requests", "drain_timeout_s",
                "served_model_name", "default_ttft_target_ms", "torch_threads", "queue_policy",
                "default_requests_per_minute", "default_tokens_per_minute", "default_max_concurrent")


def _serve(args: argparse.Namespace) -> int:
    from .server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig.from_env({name: getattr(args, name) for name in _SERVE_FLAGS})
    return serve(config, args.log_level)


def _db_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir")
    p.add_argument("--database-url")


def _registry(args: argparse.Namespace):
    from loraplex.adapter_store import migrate
    from loraplex.adapter_store.registry import Registry

    store = ServerConfig.from_env({"data_dir": args.data_dir, "database_url": args.database_url}).store
    url = store.resolved_database_url
    store.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(url)
    return Registry.open(url)


def _tenants_create(args: argparse.Namespace) -> int:
    from loraplex.adapter_store.schemas import ApiKeyCreate, TenantCreate

    registry = _registry(args)
    try:
        tenant = registry.create_tenant(TenantCreate(name=args.name, ttft_target_ms=args.ttft_target_ms))
        key = registry.create_api_key(ApiKeyCreate(tenant_id=tenant.id, role="admin", label="first admin key"))
    finally:
        registry.close()
    if args.json:
        print(json.dumps({"tenant": {"id": tenant.id, "name": tenant.name, "ttft_target_ms": tenant.ttft_target_ms},
                          "api_key": key.secret}))
    else:
        print(f"tenant {tenant.name} (id {tenant.id})")
        print(f"admin API key (shown once): {key.secret}")
    return 0


def _tenants_set(args: argparse.Namespace) -> int:
    from loraplex.adapter_store.schemas import TENANT_SETTINGS

    changes = {k: getattr(args, k) for k in TENANT_SETTINGS if getattr(args, k) is not None}
    for name in args.clear:
        key = name.replace("-", "_")
        if key not in TENANT_SETTINGS:
            raise SystemExit(f"error: --clear {name}: settings are {', '.join(TENANT_SETTINGS)}")
        changes[key] = 1.0 if key == "share" else None
    registry = _registry(args)
    try:
        tenant = registry.update_tenant(args.name, changes)
    finally:
        registry.close()
    view = {k: getattr(tenant, k) for k in ("name", *TENANT_SETTINGS)}
    print(json.dumps(view) if args.json else ", ".join(f"{k}={v}" for k, v in view.items()))
    return 0


def _keys_create(args: argparse.Namespace) -> int:
    from loraplex.adapter_store.schemas import ApiKeyCreate

    registry = _registry(args)
    try:
        tenant = registry.get_tenant_by_name(args.tenant)
        key = registry.create_api_key(ApiKeyCreate(tenant_id=tenant.id, role=args.role, label=args.label))
    finally:
        registry.close()
    if args.json:
        print(json.dumps({"tenant": tenant.name, "role": key.key.role, "id": key.key.id, "api_key": key.secret}))
    else:
        print(f"{key.key.role} API key for {tenant.name} (shown once): {key.secret}")
    return 0
