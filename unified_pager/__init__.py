"""unified_pager."""
