"""Alembic environment and revisions of the registry's schema (run through loraplex.adapter_store.migrate)."""
