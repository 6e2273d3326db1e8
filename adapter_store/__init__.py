"""adapter_store."""
