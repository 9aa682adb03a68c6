"""KV storage tests: layouts, block copies, offloads and onboards (kvcache.storage)."""
