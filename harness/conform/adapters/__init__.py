"""The engine adapters: one module per engine, each a `CacheUnderTest` over that engine's
own prefix cache (`harness.conform.protocol`), importing the engine only when it loads.

`ADAPTERS` is the registry a worker loads from: an engine's name (a lock's `engine`, a
worker's `load` message) selects its module here, and nothing else can, so no data names
code to import. kvcache's adapter runs in the harness's own process and is not listed.
Each module here imports the standard library and `harness.conform`'s shared modules
(protocol, stubs, versions) only, until it loads its engine in the engine's venv.
"""

# engine -> the adapter module its worker loads (the only code a lock can lead to)
ADAPTERS = {"vllm": "harness.conform.adapters.vllm_scheduler", "sglang": "harness.conform.adapters.sglang_radix",
            "sglang_unified": "harness.conform.adapters.sglang_unified",
            "shortfin": "harness.conform.adapters.shortfin"}
