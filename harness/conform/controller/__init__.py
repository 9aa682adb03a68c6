"""The harness's side of `kvharness conform`: everything that judges, nothing that runs
inside an engine's venv.

`runner` (the run and `--replay`), `engine_spec` (a SPEC and `open_target`), `targets`
(`Target`, `LocalTarget`, `replay`), `remote` (`WorkerTarget`: the worker over its pipe),
`families` (the scenario families), `fuzz` (the fuzz and the shrinker), `judge` (the
oracles over step reports), `report`, `locks` and `install` (pinned releases and their
venvs), `resolve` (a lock made for a release without one), `tree` (a source tree's
package root and version), `speed` (`nox -s bench`'s side-by-side table).
"""
