"""The HTTP API: OpenAI-compatible inference, adapters, tenants and keys, reports, operations."""
