"""Scenario suites: every tricky reuse scenario, warm equals cold, exact reuse counts."""
