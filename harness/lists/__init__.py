"""Test lists in TensorRT-LLM's test-db shape: schema, reader, selection rules, waives,
and the checks `kvharness validate` runs (validate); beside them the kill record the
fail-first order reads (kill_record). See test_lists/SCHEMA.md."""
