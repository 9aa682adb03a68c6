"""Conformance: the harness's scenarios and oracles run against other engines' prefix caches.

    protocol      CacheUnderTest (a prefix cache seen from its scheduler), Scope, Contract
    ops           operations as data (what checks, the fuzzer and a replay send)
    session       one op applied to a cache, with what the oracles need (StepReport)
    judge         the oracles over the step reports: counts, provenance, capacity, events
    checks, fuzz  the scenario families in each engine's terms; a shrinking fuzzer
    kvcache_adapter, vllm_adapter, sglang_adapter, sglang_unified_adapter
                  the implementations (SGLang's RadixCache and UnifiedRadixCache)
    stubs, selftest   raising stand-ins for the GPU stack; proof that the code is the engine's
    locks, install    pinned versions (harness/conform/locks/*.json) and their venvs
    versions, resolve release numbers in pip's order; a lock made for a release without one
    tree              a source tree's package root and version (`vllm@PATH`)
    worker, remote    the engine's side and the harness's side of the JSON pipe
    runner, report, bench   `kvharness conform`, report.md / report.json, the speed table

Every module an engine's worker imports (protocol, ops, session, stubs, selftest,
versions, worker, bench and the adapters) uses the standard library only until its
adapter loads the engine; see docs/conformance.md.
"""
