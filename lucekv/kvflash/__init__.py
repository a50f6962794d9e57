"""KVFlash: a bounded KV pool with host paging and relevance policies (DESIGN §4)."""
