"""The worker's side: what runs where the cache under test runs.

An engine's worker (`python -m harness.conform.worker`, in the engine's venv) and
kvcache's in-process target both run these: `serve` (the JSON request loop),
`session` (one op applied, reported as a StepReport), `selftest` (the code under test is
the engine's own) and `bench` (the cache-core workloads timed). They import the standard
library, `harness.conform`'s shared modules and the adapters only: never the
controller, which drives them.
"""
