"""The findings the harness already knows, with upstream's word on each: data.

A failed check is matched against `KNOWN` by engine, release range, check name and the
oracle that failed (`match`); report.md and the matrix then name the finding's number
in docs/conformance.md, the upstream issue, the fix and the first release that has it
(None: not fixed as of the newest release run). Ranges are read from the engines' own
code and the runs of docs/conformance.md's matrix; a release outside them that fails the
same way is reported without the annotation, as a new finding would be.

Versions compare as pip orders them (`harness.conform.versions.parse_version`:
`0.5.6.post2` after `0.5.6`, before `0.5.7`; a dev or pre-release before its release); a
version that does not parse matches no known finding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from harness.conform.versions import parse_version

_VLLM = "https://github.com/vllm-project/vllm"
_SGLANG = "https://github.com/sgl-project/sglang"
_SHARK = "https://github.com/nod-ai/amd-shark-ai"


class KnownFinding(NamedTuple):
    """One known finding: its number in docs/conformance.md's Findings, where it holds
    (`engine`, releases from `since` up to but not including `fixed_in`, the first
    release with the fix; None: not fixed), the checks and oracles that show it, what it
    is, and the upstream issue and fix (URLs; None where there is none)."""

    number: int
    engine: str
    since: str
    fixed_in: str | None
    checks: tuple[str, ...]
    oracles: tuple[str, ...]
    title: str
    issue: str | None
    fix: str | None
    says: str = ""  # what the failure's message holds, where one check shows two findings

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (report.json's `known`)."""
        return self._asdict()


KNOWN: tuple[KnownFinding, ...] = (
    KnownFinding(1, "vllm", "0.11.1", "0.31.0", ("scope_isolation",), ("count",),
                 "a salt and a LoRA name of equal value share block 0",
                 f"{_VLLM}/issues/44701", f"{_VLLM}/pull/44706"),
    KnownFinding(2, "vllm", "0.10.2", "0.27.0", ("refused_then_retried",
                                                  "pressure_spares_own_prefix",
                                                  "window_off_page"), ("refusal",),
                 "a refused admission is counted in the prefix-cache stats",
                 f"{_VLLM}/issues/43736", f"{_VLLM}/pull/48860"),
    KnownFinding(3, "vllm", "0.10.2", "0.11.1", ("scope_isolation", "scope_event_hashes",
                                                  "lora_name_repointed", "event_fields"),
                 ("api",),
                 "any LoRA request with KV events on raises inside the allocation",
                 f"{_VLLM}/issues/27728", None),
    KnownFinding(4, "sglang", "0.5.5", "0.5.18", ("scope_isolation",), ("count",),
                 "a salt equal to a LoRA id shares that adapter's KV",
                 f"{_SGLANG}/issues/24638", f"{_SGLANG}/pull/30827"),
    KnownFinding(5, "sglang", "0.5.5", "0.5.18", ("scope_event_hashes",), ("scenario",),
                 "router events carry no scope", f"{_SGLANG}/issues/24568",
                 f"{_SGLANG}/pull/30827"),
    # 17 before 6: on 0.5.5 a check can show either, and 17's message says which
    KnownFinding(17, "sglang", "0.5.5", "0.5.6", (
        "cold_then_warm", "shared_system_prompt", "multi_turn", "branches",
        "chunked_admission", "decode_growth", "decoded_then_edited",
        "dedup_across_split_path", "preemption_resume"), ("events",),
                 "a node's first block is published without its parent",
                 f"{_SGLANG}/issues/13488", f"{_SGLANG}/pull/13488", says="under parent None"),
    KnownFinding(6, "sglang", "0.5.5", "0.5.7", ("cold_then_warm", "shared_system_prompt",
                                                 "branches", "dedup_across_split_path"),
                 ("events",),
                 "a lookup that splits a node republishes its blocks (0.5.6: removes them "
                 "only)", f"{_SGLANG}/issues/13488", f"{_SGLANG}/pull/14934"),
    KnownFinding(7, "sglang", "0.5.5", "0.5.6", ("repeated_blocks",), ("events",),
                 "equal blocks at different positions publish one hash",
                 f"{_SGLANG}/issues/13488", None),
    KnownFinding(8, "shortfin", "3.1.0", "3.8.0", (
        "cold_then_warm", "shared_system_prompt", "multi_turn", "branches",
        "eviction_under_pressure", "abort_before_forward", "chunked_admission",
        "decode_growth", "live_blocks_survive_eviction", "decoded_then_edited",
        "repeated_blocks", "eviction_order", "dedup_across_split_path"), ("capacity",),
                 "a released request frees none of the pages it did not publish", None,
                 f"{_SHARK}/pull/2417", says="after free("),
    KnownFinding(9, "shortfin", "3.8.0", None, ("cold_then_warm", "same_prompt_twice",
                                                "live_blocks_survive_eviction"),
                 ("capacity",), "a request whose publish finds its pages already in the "
                 "trie holds no reference on them", None, None),
    KnownFinding(10, "shortfin", "3.8.0", None, ("pressure_spares_own_prefix",),
                 ("capacity",), "an allocation's eviction takes the pages its own lookup "
                 "matched", None, None),
    KnownFinding(11, "shortfin", "3.8.0", None, ("multi_turn", "decode_growth",
                                                 "decoded_then_edited"),
                 ("capacity",), "the first page a decode acquires from the cache is "
                 "dropped from the request's record", None, None),
    # a refused admission's pin outlives every request: the leak check sees it
    KnownFinding(12, "shortfin", "3.1.0", "3.8.0", ("pressure_spares_own_prefix",
                                                    "eviction_under_pressure",
                                                    "refused_then_retried"),
                 ("refusal", "leaks"), "a refused admission pins the prefix it matched", None,
                 f"{_SHARK}/pull/2076"),
    KnownFinding(13, "shortfin", "3.1.0", "3.8.0", ("same_prompt_twice",
                                                    "dedup_across_split_path"),
                 ("integrity", "capacity"), "a prompt computed by two live requests loses "
                 "one copy", None, f"{_SHARK}/pull/2417"),
    KnownFinding(14, "shortfin", "3.1.0", "3.6.0", ("multi_turn", "decode_growth",
                                                    "decoded_then_edited"), ("capacity",),
                 "a decode step past the first gets no page", None, f"{_SHARK}/pull/1773",
                 says="after append("),
    KnownFinding(15, "vllm", "0.11.1", "0.31.0", ("lora_name_repointed",
                                                  "scope_event_hashes"), ("count",),
                 "a LoRA name re-pointed at another adapter reads the first adapter's KV",
                 f"{_VLLM}/issues/30931", None),
    KnownFinding(18, "vllm", "0.26.0", "0.27.0", ("host_tier",), ("api",),
                 "a request aborted mid-prefill under the CPU offloading connector makes "
                 "the next step's store jobs raise",
                 f"{_VLLM}/issues/49118", f"{_VLLM}/pull/49285", says="AssertionError"),
    KnownFinding(19, "sglang", "0.5.5", "0.5.17", ("eviction_order",), ("scenario",),
                 "an allocation short of free pages evicts its whole size from the tree, "
                 "not the shortfall", None, f"{_SGLANG}/pull/32016"),
    KnownFinding(20, "sglang", "0.5.6", "0.5.9", ("multi_turn", "decode_growth",
                                                 "decoded_then_edited"), ("count",),
                 "a finished request's decoded tokens never enter the tree "
                 "(cache_finished_req keys its insert on fill_ids, the prompt)",
                 None, f"{_SGLANG}/pull/16521"),
    KnownFinding(21, "sglang_unified", "0.5.19", "0.5.23", ("window_off_page",),
                 ("capacity", "integrity", "provenance"),
                 "with a window not a whole number of pages, a running request's prompt "
                 "enters the tree unlocked (the match after the insert refuses the node "
                 "it made), so another admission can evict and reuse its pages", None,
                 None),
    KnownFinding(16, "sglang", "0.5.18", None, ("extra_key_isolation",), ("count",),
                 "a caller extra key equal to a LoRA's id reads that adapter's KV",
                 f"{_SGLANG}/issues/24638", None),
    KnownFinding(16, "sglang_unified", "0.5.18", None, ("extra_key_isolation",), ("count",),
                 "a caller extra key equal to a LoRA's id reads that adapter's KV",
                 f"{_SGLANG}/issues/24638", None),
)


def match(engine: str, version: str, check: str, oracle: str, message: str
          ) -> KnownFinding | None:
    """The known finding a check of `engine` `version` that failed `oracle` saying
    `message` shows; None when it is none the harness knows (or `version` does not
    parse)."""
    try:
        at = parse_version(version).key
    except ValueError:
        return None
    for known in KNOWN:
        if known.engine == engine and check in known.checks and oracle in known.oracles \
                and known.says in message and parse_version(known.since).key <= at \
                and (known.fixed_in is None or at < parse_version(known.fixed_in).key):
            return known
    return None
