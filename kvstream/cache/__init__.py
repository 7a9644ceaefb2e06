"""KV caches: the phase arena, host store, contiguous and paged caches, streaming."""
