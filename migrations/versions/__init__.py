"""Schema revisions, oldest first; each has an upgrade and a downgrade."""
