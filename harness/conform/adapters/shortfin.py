"""shark-ai shortfin's `TriePagedAttentionCache` behind the cache-level protocol (runs in a
shortfin venv).

The trie and its `PagePool` are shortfin's own, on IREE's host-CPU device (a
`CPUSystemBuilder` system, one worker, its fiber's device 0), nothing stubbed; the
decoder's requests (shortfin messages, which hold futures) are made on that worker, as
the server makes them. Two eras, told
apart by feature (`ShortfinNames.era`) and checked against the release number:

- "decoder", 3.8.0 on: the server's own caller code runs (`decoder/decoder.py`):
  `LlmDecoder.create_prefill_req` (a lookup of all but the prompt's last page, then
  `allocate` of the rest) admits; `publish_request` once the whole prompt is computed,
  then the `PageManager` and decode requests `LlmDecoder.run` builds next;
  `PageManager.update_decode_reqs` per decoded token (pages taken 8 at a time); at the
  end `publish_request(publish_incomplete_page=True)` and `free_req_cache` for each
  decode request and `PageManager.release_pages`. `evict_pages(n)` evicts.
- "allocation", 3.1.0 to 3.7.0: the trie's allocation objects, called as the batcher
  calls them (3.1-3.2 `service.py`, 3.3-3.6 `batcher.py`; not importable without a
  loaded model, so replicated): `acquire_pages_for_tokens(tokens, extra_token_slots=0)`,
  `publish_pages_for_tokens(tokens computed so far)` after each forward step,
  `extend_allocation(tokens, extra_token_slots=1)` per decoded token, `release_pages()`.
  `_evict_pages(n)` evicts (the server calls it only inside an allocation). 3.7.0's
  server calls `BasePagedAttentionCache.allocate` / `publish_pages_for_tokens` /
  `release_pages`, which the trie inherits without overriding: its server never reaches
  the trie, and the adapter drives the trie as 3.6.0's batcher did.

Replicated, with the shortfin function each stands in for (docs/conformance.md,
"shortfin"): the order of `LlmDecoder.run`'s calls (the adapter steps through them an op
at a time, with the rest of the request's state, `_allocated_cach_recs`, kept where run
keeps it); the batcher's calls in the allocation era; an abort (a request freed before
its computed tokens are published, which the server never does) releases the request
and hands its unpublished pages back with the cache's own `free_allocated_pages`.

Block ids are page indices. The trie keeps no counters, publishes no events and knows
no scopes. The gauges come from the pool and the trie: a page is free (in the pool's
available list), in the trie (reachable from its root; evictable when no node below it
holds a reference), a duplicate waiting for the next `release_pages` (3.8 on), or used.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from harness.conform.protocol import (
    Admission,
    Contract,
    LoadedEngine,
    Scope,
    Stats,
    contract_basis,
    installed_version,
    settle,
)
from harness.conform.stubs import StubSpec, install
from harness.conform.versions import nearest

Era = Literal["allocation", "decoder"]
TRIE = "shortfin_apps.llm.components.kvcache.trie_attention_cache"
POOL = "shortfin_apps.llm.components.kvcache.page_pool"
DECODER = "shortfin_apps.llm.components.decoder.decoder"
FIRST_TRIE, FIRST_DECODER = (3, 1, 0), (3, 8, 0)
# the releases whose contract was read from their own code (docs/conformance.md); any
# other takes the nearest one's, its era checked against its features by `load`
CONTRACT_RELEASES = tuple(f"3.{minor}.0" for minor in range(1, 10))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def era(version: str) -> Era:
    """Which caller a release's server uses; ValueError before 3.1.0 (no trie cache:
    2.9.x and 3.0.0 have only `AttnPageCache`, a page allocator without prefix sharing)."""
    v = _version(version)
    if v < FIRST_TRIE:
        raise ValueError(f"shortfin {version} has no TriePagedAttentionCache (it came in "
                         "3.1.0; before it components/cache.py is a plain page allocator)")
    return "decoder" if v >= FIRST_DECODER else "allocation"


_COMMON = (
    ("scope_kinds", "trie_attention_cache.py TrieNode.children: a page is keyed by its "
                    "token tuple under its parent, nothing else"),
    ("events", "no KV events and no counters: the trie module has neither"),
    ("eviction_policy", "evict_pages / _evict_pages: unreferenced leaves, least recently matched "
                 "first, then parents left childless"),
    ("refusal_evicts", "allocation tries eviction for the shortfall, then raises "
                       "CacheAllocationFailure"))
_DECODER = (
    ("last_token_cap", "decoder/decoder.py LlmDecoder.create_prefill_req: "
                       "lookup(input_ids[:-tokens_per_page]) (the adapter runs it), so the "
                       "prompt's last page is never looked up"),
    ("matchable_at", "decoder.py LlmDecoder.run: publish_request(prefill_req) once the "
                     "prefill is done, publish_request(req, publish_incomplete_page=True) "
                     "for the decode requests at the end; a chunked prefill "
                     "(batching/modes/default.py) publishes no chunk"),
    ("dedup_on_commit", "trie_attention_cache.py publish_pages_for_tokens: re-matches, "
                        "returns the trie's pages; the caller's copies go to "
                        "_duplicated_pages, freed by the next release_pages"),
    ("allocates_ahead", "decoder.py PageManager.allocate: a decode step that needs a page "
                        "takes max(count, _allocation_block_size = 8); the spares stay with "
                        "the request until PageManager.release_pages"),
    ("decode_steps", "decoder.py LlmDecoder.run: one token per step, after the prefill"))
_ALLOCATION = (
    ("last_token_cap", "acquire_pages_for_tokens matches the whole prompt and the batcher "
                       "passes all of it (board_prefills, extra_token_slots=0); the prefill "
                       "recomputes from position 0 (`assert r.start_position == 0`), so a "
                       "shared page is rewritten, never read first"),
    ("matchable_at", "the executor publishes full pages after every forward step "
                     "(publish_allocated_pages -> publish_pages_for_tokens(input_token_ids))"),
    ("allocates_ahead", "board_decodes: extend_allocation(input_token_ids, "
                        "extra_token_slots=1), pages for one slot past the tokens"),
    ("decode_steps", "generate.py GenerateItemProcess.run: one token per decode step"))


def contract(version: str, block_size: int) -> Contract:
    """shortfin `version`'s contract for its trie cache (ValueError before 3.1.0)."""
    kind = era(version)
    decoder = kind == "decoder"
    rematch = _version(version) >= (3, 6, 0)
    notes = ["block ids are PagePool page indices",
             "no scopes, counters or events: scope and event families are skipped"]
    citations = [*_COMMON, *(_DECODER if decoder else _ALLOCATION)]
    if not decoder:
        citations.append((
            "dedup_on_commit",
            "publish_pages_for_tokens re-matches and publishes past the match only; the "
            "allocation keeps its own pages for the matched part" if rematch else
            "publish_pages_for_tokens adds a node per block under last_cached_node; "
            "create_child replaces a child already there"))
    if _version(version) == (3, 7, 0):
        notes.append("3.7.0's server (messages.py acquire_pages / publish_allocated_pages / "
                     "free_cache_pages) calls BasePagedAttentionCache methods the trie does "
                     "not override: it never reaches the trie; driven as 3.6.0's batcher")
    return Contract(
        engine="shortfin", version=version, block_size=block_size, id_unit="page",
        stats_unit="blocks", last_token_cap="scheduler" if decoder else "manager",
        matchable_at="prefill" if decoder else "commit", partial_reuse=False,
        copy_on_partial_reuse=False, scope_kinds=(), lora_identity=(),
        scope_in_event_hash=(), eviction_policy="lru-leaves", explicit_evict=True,
        dedup_on_commit=decoder, chunked_allocation=False,
        unreused_tail=block_size if decoder else 0, allocates_ahead=True,
        refusal_evicts=True, decode_steps=True, events=False,
        host_full_hit="unreused-tail", host_load_reserve="none",  # no host tier
        citations=tuple(citations), notes=tuple(notes))


class ShortfinNames:
    """The shortfin names the adapter uses, imported once, and the host-CPU system whose
    worker makes the decoder's requests (`on_worker`)."""

    def __init__(self) -> None:
        import shortfin.array as sfnp
        import shortfin.host
        from shortfin_apps.llm.components.kvcache import base_attention_cache, page_pool

        trie = importlib.import_module(TRIE)
        self.sfnp = sfnp
        self.PagePool = page_pool.PagePool
        self.PagePoolConfig = page_pool.PagePoolConfig
        self.Trie = trie.TriePagedAttentionCache
        self.CacheAllocationFailure = base_attention_cache.CacheAllocationFailure
        self.era: Era = "decoder" if hasattr(self.Trie, "lookup") else "allocation"
        if self.era == "decoder":
            from shortfin_apps.llm.components.decode_config import DecodeConfig
            from shortfin_apps.llm.components.decoder import decoder
            from shortfin_apps.llm.components.prefill_config import PrefillConfig

            self.LlmDecoder = decoder.LlmDecoder
            self.PageManager = decoder.PageManager
            self.DecodeConfig = DecodeConfig
            self.PrefillConfig = PrefillConfig
        else:
            self.Allocation = trie.TriePagedAttentionCacheAllocation
        self.system = shortfin.host.CPUSystemBuilder().create_system()
        # shut down before the interpreter does: an implicit shutdown from the
        # system's destructor aborts the worker process on exit
        atexit.register(self.system.shutdown)
        self.worker = self.system.create_worker("kvharness-conform")
        self.fiber = self.system.create_fiber(self.worker)  # kept: its device needs it
        self.device = self.fiber.device(0)
        self.known = ""  # the release whose contract this one takes (`load` sets it)

    def on_worker(self, call: Callable[[], Any]) -> Any:
        """`call()` run on the shortfin worker (where futures and requests can be made);
        returns its result or raises what it raised. Blocks until it ran."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = call()
            except BaseException as exc:  # handed back to the caller's thread
                box["error"] = exc
            done.set()

        self.worker.call_threadsafe(run)
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")


def load(stubs: StubSpec, version: str | None = None) -> LoadedEngine:
    """Import shortfin's trie (and, from 3.8.0, its decoder), build the host-CPU system
    and return the engine; `version` is used where shortfin has no metadata. Raises
    ImportError when it does not import, RuntimeError when the release's features
    contradict its number."""
    finder = install(stubs)
    names = ShortfinNames()
    version = installed_version("shortfin", version)
    names.known = nearest(version, CONTRACT_RELEASES) or version
    if names.era != era(version):
        raise RuntimeError(f"shortfin {version} should be the {era(version)} era, but its "
                           f"trie looks like the {names.era} era")
    modules = (TRIE, POOL, *((DECODER,) if names.era == "decoder" else ()))
    trie_file = importlib.import_module(TRIE).__file__
    assert trie_file is not None
    package = trie_file  # .../site-packages/shortfin_apps/llm/components/kvcache/<file>
    for _ in range(4):
        package = os.path.dirname(package)

    def new(num_blocks: int, block_size: int, record: bool) -> ShortfinCache:
        return ShortfinCache(names, version, num_blocks, block_size, record)

    return LoadedEngine("shortfin", version, package, new, modules, tuple(finder.served),
                        contract_basis(version, names.known, {}))


@dataclass
class _Seq:
    tokens: list[int]
    prompt: int  # prompt tokens
    committed: int = 0  # tokens whose KV the harness said is computed
    logged: int = 0  # the commit last logged (what shortfin was told is computed)
    ids: list[int] = field(default_factory=list)  # positional page ids, as logged
    alloc: Any = None  # allocation era: the TriePagedAttentionCacheAllocation
    decoder: Any = None  # decoder era: its LlmDecoder, prefill request, page manager
    prefill: Any = None
    manager: Any = None
    decode_reqs: list[Any] = field(default_factory=list)


class ShortfinCache:
    """`CacheUnderTest` over one fresh `TriePagedAttentionCache` and `PagePool` of
    `num_blocks` pages of `block_size` tokens."""

    def __init__(self, s: ShortfinNames, version: str, num_blocks: int, block_size: int,
                 record: bool) -> None:
        self.s = s
        self.P = block_size
        self.num_blocks = num_blocks
        self.record = record
        base = contract(s.known, block_size)
        self._contract = base if s.known == version else settle(base, version, {})
        fields = {f.name for f in dataclasses.fields(s.PagePoolConfig)}
        size: dict[str, Any] = {"paged_kv_block_size_elements": block_size} \
            if "paged_kv_block_size_elements" in fields \
            else {"paged_kv_block_size_elements_per_device": [block_size]}
        config = s.PagePoolConfig(dtype=s.sfnp.float16, alloc_page_count=num_blocks, **size)
        self.pool = s.PagePool(devices=[s.device], config=config)
        self.trie = s.Trie(page_pool=self.pool, tokens_per_page=block_size)
        self._seqs: dict[Hashable, _Seq] = {}
        self._log: list[dict[str, Any]] = []

    @property
    def contract(self) -> Contract:
        """This release's contract."""
        return self._contract

    # -- for the self-test ---------------------------------------------------------------

    def engine_callables(self) -> dict[str, tuple[object, str]]:
        """Every shortfin function the adapter calls."""
        s, t, pool = self.s, self.trie, self.pool
        out: dict[str, tuple[object, str]] = {
            "TriePagedAttentionCache.__init__": (s.Trie, "__init__"),
            "PagePool.__init__": (s.PagePool, "__init__"),
            "acquire_free_pages": (pool, "acquire_free_pages"),
            "free_pages": (pool, "free_pages")}
        if s.era == "decoder":
            out.update({name: (t, name) for name in (
                "lookup", "allocate", "publish_pages_for_tokens", "release_pages",
                "evict_pages", "free_allocated_pages")})
            out.update({f"LlmDecoder.{name}": (s.LlmDecoder, name) for name in (
                "__init__", "create_prefill_req", "publish_request", "free_req_cache",
                "create_decode_reqs")})
            out.update({f"PageManager.{name}": (s.PageManager, name) for name in (
                "__init__", "update_decode_reqs", "release_pages")})
        else:
            out.update({"acquire_pages_for_tokens": (t, "acquire_pages_for_tokens"),
                        "_evict_pages": (t, "_evict_pages")})
            out.update({f"Allocation.{name}": (s.Allocation, name) for name in (
                "publish_pages_for_tokens", "release_pages", "extend_allocation")})
        return out

    def engine_calls(self) -> dict[str, tuple[str, ...]]:
        """The shortfin functions each op kind calls, as each era's server calls them."""
        if self.s.era == "allocation":
            return {"admit": ("acquire_pages_for_tokens",), "reserve": (),
                    "commit": ("Allocation.publish_pages_for_tokens",),
                    "append": ("Allocation.extend_allocation",),
                    "free": ("Allocation.release_pages",), "evict": ("_evict_pages",)}
        return {"admit": ("LlmDecoder.__init__", "LlmDecoder.create_prefill_req"),
                "reserve": (),
                "commit": ("LlmDecoder.publish_request", "PageManager.__init__",
                           "LlmDecoder.create_decode_reqs"),
                "append": ("PageManager.update_decode_reqs",),
                "free": ("LlmDecoder.publish_request", "LlmDecoder.free_req_cache",
                         "PageManager.release_pages", "free_allocated_pages"),
                "evict": ("evict_pages",)}

    def raw_probe(self) -> dict[str, Any]:
        """shortfin's own results for two pages admitted, published, released and evicted."""
        tokens = list(range(1, 2 * self.P + 1))
        t = self.trie
        if self.s.era == "decoder":
            found = t.lookup(tokens)
            info = t.allocate(tokens, found)
            published = t.publish_pages_for_tokens(info)
            t.release_pages(published)
            return {"lookup": found, "allocate": info, "publish": published,
                    "evict_pages": t.evict_pages(2)}
        alloc = t.acquire_pages_for_tokens(tokens, extra_token_slots=0)
        alloc.publish_pages_for_tokens(tokens, publish_incomplete_page=False)
        alloc.release_pages()
        return {"acquire": alloc, "pages": list(alloc.pages), "evict": t._evict_pages(2)}

    # -- the protocol ----------------------------------------------------------------------

    def admit(self, seq_id: Hashable, tokens: Sequence[int], scope: Scope | None,
              first_chunk: int | None) -> Admission | None:
        """Look up and allocate the whole prompt (shortfin has no scopes; a first chunk
        changes nothing: every prompt page is allocated at admission)."""
        if seq_id in self._seqs:
            raise ValueError(f"admit({seq_id!r}): already live")
        seq = _Seq(list(tokens), len(tokens))
        got = self._admit(seq_id, seq)
        if got is None:
            return None
        self._seqs[seq_id] = seq
        seq.committed = seq.logged = got
        seq.ids = self._positional(seq)
        # copies: the log is read after later ops (a worker sends a batch's reports at once)
        self._write({"kind": "admit", "seq_id": seq_id, "tokens": list(seq.tokens),
                     "num_tokens": got, "scope": None, "block_ids": list(seq.ids)})
        return Admission(got, tuple(seq.ids), len(seq.tokens))

    def _admit(self, seq_id: Hashable, seq: _Seq) -> int | None:
        s = self.s
        try:
            if s.era == "allocation":  # the request's own token list, as the batcher passes it
                seq.alloc = self.trie.acquire_pages_for_tokens(seq.tokens, extra_token_slots=0)
                return int(seq.alloc.number_of_published_pages) * self.P
            seq.decoder = s.LlmDecoder(s.PrefillConfig(has_prefill_position=True),
                                       s.DecodeConfig(num_beams=1), _Batcher(self.trie),
                                       _ignore, str(seq_id))
            seq.prefill = s.on_worker(lambda: seq.decoder.create_prefill_req(list(seq.tokens)))
            return int(seq.prefill.start_position)
        except s.CacheAllocationFailure:
            return None

    def reserve(self, seq_id: Hashable, num_tokens: int) -> int | None:
        """Nothing to allocate: the whole prompt was allocated at admission."""
        return len(self._live(seq_id).tokens)

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Tell shortfin the KV of [0, num_tokens) is computed, as its server would: the
        allocation era publishes the full pages; the decoder era publishes the prompt
        once all of it is computed (and decoded tokens only when the request ends)."""
        seq = self._live(seq_id)
        if num_tokens > len(seq.tokens):
            raise ValueError(f"commit({seq_id!r}, {num_tokens}): the sequence has "
                             f"{len(seq.tokens)} tokens")
        seq.committed = max(seq.committed, num_tokens)
        if self.s.era == "allocation":
            # the executor passes the request's own token list (all of it is computed
            # after each step); a partial commit, which it never makes, passes a slice
            done = seq.tokens if num_tokens == len(seq.tokens) else seq.tokens[:num_tokens]
            seq.alloc.publish_pages_for_tokens(done, publish_incomplete_page=False)
            self._log_commit(seq_id, seq, num_tokens)
        elif seq.manager is None and seq.committed >= seq.prompt:
            self._publish_prefill(seq)
            self._log_commit(seq_id, seq, seq.prompt)

    def _publish_prefill(self, seq: _Seq) -> None:
        """`LlmDecoder.run` after its prefill: publish it, then the page manager and the
        decode requests over the published pages."""
        s, dec = self.s, seq.decoder
        dec.publish_request(seq.prefill, publish_incomplete_page=False)
        info = dec._allocated_cach_recs[seq.prefill.instance_id]
        seq.manager = s.PageManager(self.trie, self.pool,
                                    initial_pages=[p.index for p in info.pages],
                                    initial_length=seq.prompt, tokens_per_page=self.P)
        seq.decode_reqs = s.on_worker(lambda: dec.create_decode_reqs(seq.prefill))

    def _log_commit(self, seq_id: Hashable, seq: _Seq, num_tokens: int) -> None:
        if num_tokens <= seq.logged:
            return
        seq.logged = num_tokens
        event: dict[str, Any] = {"kind": "commit", "seq_id": seq_id, "num_tokens": num_tokens}
        ids = self._positional(seq)
        if ids != seq.ids:  # publish handed back the trie's pages for duplicates
            seq.ids = ids
            event["block_ids"] = list(ids)
        self._write(event)

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> tuple[int | None, ...] | None:
        """One decode step (the contract's `decode_steps`: `Session` sends one token once
        all are computed); the positional pages it added, or None when shortfin had no
        page for it (nothing else changed, but what it evicted trying)."""
        seq = self._live(seq_id)
        if len(tokens) != 1 or seq.committed < len(seq.tokens):
            raise ValueError(f"append({seq_id!r}, {list(tokens)}): one token per decode step, "
                             "after every token before it is computed")
        if not self._step(seq, int(tokens[0])):
            return None
        before = len(seq.ids)
        seq.ids = self._positional(seq)
        added = seq.ids[before:]
        self._write({"kind": "append", "seq_id": seq_id, "tokens": list(tokens),
                     "block_ids": added})
        return tuple(added)

    def _step(self, seq: _Seq, token: int) -> bool:
        """One decode step's calls; False (the token taken back) when shortfin raised
        CacheAllocationFailure."""
        s = self.s
        position = len(seq.tokens)
        seq.tokens.append(token)  # generate.py appends to the request's list, then boards it
        try:
            if s.era == "allocation":
                seq.alloc.extend_allocation(seq.tokens, extra_token_slots=1)
            else:
                recs = seq.decoder._allocated_cach_recs
                seq.manager.update_decode_reqs([0], seq.decode_reqs, recs, [token], position)
        except s.CacheAllocationFailure:
            seq.tokens.pop()
            return False
        return True

    def free(self, seq_id: Hashable) -> None:
        """The end of the request, as the server ends it (see the module docstring; an
        abort, which the server never does, hands its unpublished pages back)."""
        seq = self._live(seq_id)
        done = seq.committed == len(seq.tokens)
        if done and self.s.era == "decoder" and seq.manager is not None:
            self._log_commit(seq_id, seq, len(seq.tokens))  # published at the end
        self._end(seq, done)
        del self._seqs[seq_id]
        self._write({"kind": "free", "seq_id": seq_id})

    def _end(self, seq: _Seq, done: bool) -> None:
        if self.s.era == "allocation":
            seq.alloc.release_pages()  # GenerateItemProcess.run's finally: free_cache_pages
            return
        dec = seq.decoder
        held = self._held(seq)  # before free_req_cache empties the requests' page ids
        if seq.manager is None:  # an abort before the prefill was published
            dec.free_req_cache(seq.prefill)
            self.trie.free_allocated_pages(sorted(held))
            return
        for req in seq.decode_reqs:
            if done:
                dec.publish_request(req, publish_incomplete_page=True)
            dec.free_req_cache(req)
        seq.manager.release_pages()
        if not done:  # an abort mid-decode: its unpublished pages go back
            self.trie.free_allocated_pages(sorted(held))

    def evict(self, num_blocks: int) -> int:
        """`evict_pages(n)` (`_evict_pages` before 3.8.0): unreferenced LRU leaves."""
        t = self.trie
        evict = t.evict_pages if self.s.era == "decoder" else t._evict_pages
        return int(evict(num_blocks))

    def _live(self, seq_id: Hashable) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"{seq_id!r} is not live")
        return seq

    def _write(self, event: dict[str, Any]) -> None:
        if self.record:
            self._log.append(event)

    # -- what shortfin holds ---------------------------------------------------------------

    def _pages_of(self, seq: _Seq) -> list[int]:
        """The pages the request computes in, in position order: the allocation's pages
        (allocation era; with any past its tokens), else the page table its latest
        request runs with (the prefill's, the published prompt's until the first decode
        step, then the decode request's)."""
        if self.s.era == "allocation":
            return [p.index for p in seq.alloc.pages]
        if seq.manager is None:
            return list(seq.prefill.page_ids)
        if seq.decode_reqs[0].page_ids:
            return list(seq.decode_reqs[0].page_ids)
        recs = seq.decoder._allocated_cach_recs
        return [p.index for p in recs[seq.prefill.instance_id].pages]

    def _positional(self, seq: _Seq) -> list[int]:
        return self._pages_of(seq)[:-(-len(seq.tokens) // self.P)]

    def _held(self, seq: _Seq) -> set[int]:
        """Every page the live request holds: its page table, the pages in its cache
        info, and (decoder era) its page manager's spares."""
        held = set(self._pages_of(seq))
        if self.s.era == "decoder":
            recs = seq.decoder._allocated_cach_recs
            for req in [seq.prefill, *seq.decode_reqs]:
                info = recs.get(req.instance_id)
                held |= {p.index for p in info.pages} if info is not None else set()
            if seq.manager is not None:
                held |= set(seq.manager._free_pages)
        return held

    def _ahead(self) -> int:
        """Pages live requests hold beyond their tokens' positions."""
        total = 0
        for seq in self._seqs.values():
            total += len(self._held(seq) - set(self._positional(seq)))
        return total

    def _nodes(self) -> list[Any]:
        """Every node the trie's root reaches (the root excluded)."""
        out, stack = [], list(self.trie.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _evictable(self) -> set[int]:
        """Pages of reachable nodes with no reference at or below them."""
        pages: set[int] = set()

        def clear(node: Any) -> bool:
            below = [clear(child) for child in list(node.children.values())]
            free = all(below) and node.ref_count.is_empty()
            if free and node is not self.trie.root:
                pages.add(node.page.index)
            return free

        clear(self.trie.root)
        return pages

    def _free(self) -> set[int]:
        return {p.index for p in self.pool.available_pages}

    def _pending(self) -> set[int]:
        """Duplicates the next `release_pages` frees (3.8 on)."""
        return {p.index for p in getattr(self.trie, "_duplicated_pages", ())}

    def _accounting(self) -> tuple[set[int], set[int], set[int], set[int]]:
        return self._free(), self._evictable(), self._pending(), \
            {n.page.index for n in self._nodes()}

    def used_blocks(self) -> int:
        """Pages neither free, nor evictable in the trie, nor duplicates pending."""
        free, evictable, pending, _ = self._accounting()
        return self.num_blocks - len(free | evictable | pending)

    def stats(self) -> Stats:
        """No engine counters; the harness's gauges from the pool and the trie."""
        free, _, _, trie = self._accounting()
        used = self.used_blocks()
        harness: dict[str, int | float] = {
            "maxNumBlocks": self.num_blocks, "usedNumBlocks": used,
            "freeNumBlocks": len(free), "cachedNumBlocks": len(trie),
            "tokensPerBlock": self.P, "aheadNumBlocks": self._ahead()}
        return Stats({}, harness)

    def take_events(self) -> list[dict[str, Any]]:
        """shortfin publishes no events."""
        return []

    def take_log(self) -> list[dict[str, Any]]:
        """The harness log since the last call."""
        out, self._log = self._log, []
        return out

    def cached_hashes(self) -> None:
        """The trie names no hashes."""
        return None

    def check_integrity(self) -> list[str]:
        """Every page is exactly one of: free, in the trie, held by a live request, or a
        duplicate waiting for the next release."""
        free, _, pending, trie = self._accounting()
        nodes = self._nodes()
        out: list[str] = []
        if len(trie) != len(nodes):
            seen: dict[int, int] = {}
            for n in nodes:
                seen[n.page.index] = seen.get(n.page.index, 0) + 1
            out.append(f"pages in two trie nodes: {sorted(p for p, k in seen.items() if k > 1)}")
        held: set[int] = set()
        for seq_id, seq in self._seqs.items():
            held |= self._held(seq)
            table = self._positional(seq)
            twice = sorted({p for p in table if table.count(p) > 1})
            if twice:
                out.append(f"{seq_id!r}'s page table {table} names pages {twice} twice")
        private = held - trie
        for what, a, b in (("free and in the trie", free, trie),
                           ("free and held by a live request", free, private),
                           ("free and pending as duplicates", free, pending),
                           ("in the trie and pending as duplicates", trie, pending)):
            if a & b:
                out.append(f"pages both {what}: {sorted(a & b)}")
        orphans = {leaf.page.index for leaf in self.trie.leaves if leaf not in set(nodes)}
        if orphans:
            out.append(f"pages of nodes in the trie's leaves its root no longer reaches: "
                       f"{sorted(orphans)}")
        lost = set(range(self.num_blocks)) - free - trie - held - pending
        if lost:
            out.append(f"pages owned by nobody (neither free, in the trie, held by a live "
                       f"request nor pending): {sorted(lost)}")
        return out

    def leak_report(self) -> list[str]:
        """With nothing live: nodes still referenced (never evictable again), pages
        owned by nobody, and what `shutdown()`'s check would say (computed without
        freeing anything: the pages its `free_cache_pages` would hand back counted)."""
        free, evictable, pending, trie = self._accounting()
        out: list[str] = []
        pinned = [n for n in [self.trie.root, *self._nodes()] if not n.ref_count.is_empty()]
        if pinned:
            out.append(f"{len(pinned)} trie nodes still referenced (ref_count "
                       f"{[n.ref_count.count for n in pinned]}), pages "
                       f"{[n.page.index for n in pinned]}")
        listed = {p.index for p in getattr(self.trie, "_allocated_pages", ())}
        lost = set(range(self.num_blocks)) - free - trie - pending
        if lost:
            out.append(f"pages owned by nobody: {sorted(lost)}"
                       + (f" ({sorted(lost & listed)} still in _allocated_pages, freed only "
                          "by shutdown)" if lost & listed else ""))
        if pending:
            out.append(f"duplicates pending with no request left to release them: "
                       f"{sorted(pending)}")
        unfreed = self.num_blocks - len(free | evictable | listed)
        if unfreed:
            out.append(f"shutdown() would raise 'Pages lost: {unfreed} of "
                       f"{self.num_blocks} unfreed'")
        return out


class _Batcher:
    """What `LlmDecoder` asks of its batching facade for the cache: the page cache (the
    adapter runs no batches)."""

    def __init__(self, trie: Any) -> None:
        self._trie = trie

    def get_page_cache(self) -> Any:
        """The trie under test."""
        return self._trie


def _ignore(_results: Any) -> None:
    """The results callback: the adapter decodes no text."""
