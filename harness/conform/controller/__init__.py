"""The harness's side of `kvharness conform`: the run, the checks, the judge, the report."""
