"""Conformance: the harness's scenarios and oracles run against other engines' prefix caches.

Three places, split where the process boundary is (docs/conformance.md):

    worker/       what runs where the cache runs (an engine's venv, or this process for
                  kvcache): the request loop, the session, the self-test, the bench
    adapters/     one module per engine, each a CacheUnderTest; ADAPTERS, the registry
    controller/   the harness's side: `kvharness conform`, the target, the families, the
                  fuzz, the judge, the report, the locks, the resolution of a lock for
                  a release without one, source trees, installs, the speed table

protocol, ops, stubs, known_keys and versions (release numbers in pip's order, the
nearest known one) are the words both sides speak. The worker's side (worker/,
adapters/ and those five) imports nothing of controller/ and only the standard library
until an adapter loads its engine (tests/harness/test_rooms.py holds it).
"""
