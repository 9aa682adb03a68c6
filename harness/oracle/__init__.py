"""The independent oracles: reuse counts, KV provenance and block capacity.

The reuse oracle replays the cache's admission log and predicts reuse
(`harness.oracle.model`); the provenance oracle keeps a shadow KV store and checks that
every reuse reads the reader's own KV (`harness.oracle.provenance`); the capacity oracle
counts the blocks live sequences need (`harness.oracle.capacity`). None imports anything
from `kvcache`: they read the events and the public API's numbers only.

Beside them, what runs them: `checked_manager` (a manager checked by the oracles after
every call; it names `kvcache` for type checking only), `after_test` (the oracles the
plugin runs on a test's caches after it) and `kv_index` (a replica's cache rebuilt from
its KV-cache events alone, as a router keeps it).
"""

from __future__ import annotations

from harness.oracle.capacity import CapacityError, CapacityOracle
from harness.oracle.model import ReuseOracle, predict_sequential, replay
from harness.oracle.provenance import ProvenanceError, ShadowStore
from harness.oracle.types import (
    CachedBlock,
    Event,
    OracleConfig,
    OraclePrediction,
    RequestReuse,
    hit_rate,
)

__all__ = ["CachedBlock", "CapacityError", "CapacityOracle", "Event", "OracleConfig",
           "OraclePrediction", "ProvenanceError", "RequestReuse", "ReuseOracle",
           "ShadowStore", "hit_rate", "predict_sequential", "replay"]
