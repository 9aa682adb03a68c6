"""`python -m harness.conform.worker --replies-fd N`: the worker (`serve.main`)."""

from harness.conform.worker.serve import main

main()
