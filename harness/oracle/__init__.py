"""The independent reuse oracle: replays the cache's admission log and predicts reuse.

It imports nothing from `kvcache`; see `harness.oracle.model` for the rules it follows.
"""

from __future__ import annotations

from harness.oracle.model import ReuseOracle, predict_sequential, replay
from harness.oracle.types import Event, OracleConfig, OraclePrediction, RequestReuse, hit_rate

__all__ = ["Event", "OracleConfig", "OraclePrediction", "RequestReuse", "ReuseOracle",
           "hit_rate", "predict_sequential", "replay"]
