"""kvcache: a compact radix-tree paged KV cache with paged attention backends."""
