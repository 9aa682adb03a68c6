"""kvcache-harness: test lists, a pytest plugin, a reuse oracle and assertions, reports."""
