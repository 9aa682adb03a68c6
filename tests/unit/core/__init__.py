"""Cache-core tests: config, keys, radix tree, window arithmetic, the manager, KV events."""
