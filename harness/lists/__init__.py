"""Test lists in TensorRT-LLM's test-db shape: schema, reader, selection rules, waives,
and the checks `kvharness validate` runs (validate). See test_lists/SCHEMA.md."""
