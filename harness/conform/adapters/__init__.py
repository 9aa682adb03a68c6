"""The engine adapters: one module per engine, each a `CacheUnderTest` over its cache."""
