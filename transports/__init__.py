"""Moving bytes between processes: shared-memory rings, TCP framing, KV transfer."""
