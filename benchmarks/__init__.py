"""pytest-benchmark suites; `nox -s bench` runs them and writes the report."""
