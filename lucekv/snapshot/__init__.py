"""Session snapshots: the versioned blob format (blob) and where blobs are kept (store)."""
