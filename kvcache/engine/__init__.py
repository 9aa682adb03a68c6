"""The engine: its options (EngineConfig), scheduler (token budget, chunked prefill,
postprocess), step runner, step loop and generate().

Names are exported lazily, so `import kvcache.engine` loads no torch until a name is used,
and `kvcache.engine.scheduler` loads numpy alone (it reaches attention only through the
block table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache._lazy import lazy_getattr

if TYPE_CHECKING:
    from kvcache.engine.config import EngineConfig
    from kvcache.engine.engine import Engine
    from kvcache.engine.request import FinishReason, GenerationOutput, RequestFinishedError
    from kvcache.engine.scheduler import Scheduler
    from kvcache.engine.step_fault import STEP_PHASES

_EXPORTS = {
    "Engine": "kvcache.engine.engine",
    "EngineConfig": "kvcache.engine.config",
    "FinishReason": "kvcache.engine.request",
    "GenerationOutput": "kvcache.engine.request",
    "RequestFinishedError": "kvcache.engine.request",
    "STEP_PHASES": "kvcache.engine.step_fault",
    "Scheduler": "kvcache.engine.scheduler",
}
__all__ = [
    "STEP_PHASES",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "GenerationOutput",
    "RequestFinishedError",
    "Scheduler",
]
__getattr__ = lazy_getattr(__name__, _EXPORTS)
