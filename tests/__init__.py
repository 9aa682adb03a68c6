"""Test suites; helpers are imported absolutely, `from tests.<suite>.support import ...`."""
