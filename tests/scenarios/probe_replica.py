"""The probe-vs-admission check of every scenario: replay an engine's cache log on a
fresh manager of the same config and require `probe_reuse`, asked just before each
admission, to equal what that admission reuses (`ScenarioRun.expect_oracle` runs it)."""

from __future__ import annotations

from typing import Any

from kvcache import Engine, KvCacheManager, ReuseScope


def scope_from_key(key: Any) -> ReuseScope | None:
    """The ReuseScope whose key an admission-log event carries (None or (salt, lora_id))."""
    return None if key is None else ReuseScope(*key)


def assert_probe_matches_admissions(engine: Engine) -> None:
    """Replay `engine`'s cache log on a fresh manager of the same config; before every
    admission, `probe_reuse` must equal the tokens that admission reuses.

    The replica sees the same operations on the same pool, at the logged retention
    priorities, so it passes through exactly the engine's states: each admission must
    also reuse what the engine's did. Under a sliding window the log does not say how
    many blocks each chunk reserved: the replica reserves only what each commit covers
    (fewer blocks than the engine held, so it fits wherever the engine did), and checks
    probe against admission in its own states (the engine's reuse is then not the
    replica's to predict).
    """
    replica = KvCacheManager(engine.cache_config)
    lazy = engine.cache_config.sliding_window is not None
    for i, ev in enumerate(engine.admission_log()):
        kind, sid = ev["kind"], ev["seq_id"]
        if kind == "admit":
            scope = scope_from_key(ev["scope"])
            probed = replica.probe_reuse(ev["tokens"], scope)
            plan = replica.plan_admission(ev["tokens"], scope, first_chunk=1 if lazy else None)
            seq = replica.admit(sid, plan, ev["priority"])
            replica.take_copy_ops()
            assert seq.num_cached_tokens == probed, (
                f"log event {i}: probe_reuse said {probed} tokens, the admission of request "
                f"{sid!r} reused {seq.num_cached_tokens}\n{replica.state.tree.dump()}")
            assert lazy or seq.num_cached_tokens == ev["num_tokens"], (
                f"log event {i}: replaying the log, request {sid!r} reused "
                f"{seq.num_cached_tokens} tokens, the engine's admission "
                f"{ev['num_tokens']}\n{replica.state.tree.dump()}")
        elif kind == "commit":
            if lazy:
                replica.reserve(sid, ev["num_tokens"])
            replica.commit(sid, ev["num_tokens"])
        elif kind == "append":
            if ev["tokens"]:  # no tokens: blocks the engine reserved; the replica's own
                replica.append_tokens(sid, ev["tokens"])
        elif kind == "free":
            replica.free_sequence(sid)
        # "copy": the replica took its copies right after the admission
