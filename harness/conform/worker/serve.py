"""The engine's side of the pipe: `python -m harness.conform.worker`, inside its venv.

The harness's process never imports an engine: it starts this worker with the engine's
interpreter and the harness on its path, and speaks JSON lines: requests on stdin,
replies on the file descriptor `--replies-fd N` names (a pipe of their own). Every
message is data; the one that loads an engine names it, and the name selects an adapter
from `harness.conform.adapters.ADAPTERS` (anything else is refused), so no message names
code to import. Replies are {"ok": true, ...} or {"ok": false, "error": ...}, with
"stub": {"name", "module"} when what failed touched a stub (StubUsedError).

    load    engine, stubs, version -> engine, version, package_dir, stubs_served, seconds,
                                      contract_basis (version: used where the package has
                                      no metadata, a source tree)
    selftest                       -> problems, sources, substitutes, functions, calls
    open    num_blocks, block_size[, options] -> contract
    ops     ops (a list)           -> reports (one StepReport dict per op)
    code                           -> functions, calls (the open cache's engine code)
    bench   quick                  -> rows
    close                          -> (the worker exits)

Replies have a descriptor of their own because anything may print to stdout: the
engine's logs (vLLM logs there), and a `.pth` file or `sitecustomize` of the engine's
venv that prints before this module even runs. The harness points stdout and stderr at
the worker's log, so none of it can be taken for a reply.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from typing import IO, Any

from harness.conform.adapters import ADAPTERS
from harness.conform.ops import ops_from_json
from harness.conform.protocol import CacheOptions, LoadedEngine, open_cache
from harness.conform.stubs import StubSpec, StubUsedError
from harness.conform.worker.selftest import engine_code, self_test_engine
from harness.conform.worker.session import Session


class Worker:
    """The worker's state: the loaded engine and the open cache's session."""

    def __init__(self) -> None:
        self.engine: LoadedEngine | None = None
        self.session: Session | None = None

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One request -> its reply (raises for a bad request or an engine failure)."""
        cmd = msg.get("cmd")
        if cmd == "load":
            return self._load(msg)
        engine = self.engine
        if engine is None:
            raise ValueError(f"{cmd!r} before load")
        if cmd == "selftest":
            return self_test_engine(engine)._asdict()
        if cmd == "open":
            cache = open_cache(engine, int(msg["num_blocks"]), int(msg["block_size"]), True,
                               CacheOptions.from_dict(msg.get("options"), "open: options"))
            self.session = Session(cache)
            return {"contract": cache.contract.as_dict()}
        if cmd == "ops":
            if self.session is None:
                raise ValueError("ops before open")
            session = self.session
            return {"reports": [session.apply(op).as_dict()
                                for op in ops_from_json(msg["ops"])]}
        if cmd == "code":
            if self.session is None:
                raise ValueError("code before open")
            return engine_code(self.session.cache, engine.package_dir)  # type: ignore[arg-type]
        if cmd == "bench":
            from harness.conform.worker.bench import run_bench  # only benchmarks need it

            return {"rows": [r._asdict() for r in run_bench(engine, bool(msg["quick"]))]}
        raise ValueError(f"unknown command {cmd!r}")

    def _load(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.engine is not None:
            raise ValueError("an engine is loaded already")
        name = msg.get("engine")
        if name not in ADAPTERS:
            raise ValueError(f"no adapter for engine {name!r}; known: {sorted(ADAPTERS)}")
        start = time.perf_counter()
        version = msg.get("version")
        if version is not None and not isinstance(version, str):
            raise ValueError(f"load: version must be a string or null, got {version!r}")
        adapter = importlib.import_module(ADAPTERS[name])
        self.engine = adapter.load(StubSpec.from_dict(msg.get("stubs", {})), version)
        e = self.engine
        return {"engine": e.name, "version": e.version, "package_dir": e.package_dir,
                "stubs_served": list(e.stubs_served),
                "contract_basis": dict(e.contract_basis),
                "seconds": round(time.perf_counter() - start, 2)}


def answer(worker: Worker, line: str) -> dict[str, Any] | None:
    """The reply to one request line (mutates `worker` as the request does), None for
    `close`. A bad request, or an engine that raises, is an error reply, never raised."""
    try:
        msg = json.loads(line)
        if not isinstance(msg, dict):
            raise ValueError(f"a request is a JSON object, got {type(msg).__name__}")
        if msg.get("cmd") == "close":
            return None
        return {"ok": True, **worker.handle(msg)}
    except Exception as exc:  # reported to the harness, which decides
        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc(limit=-8)}
        if isinstance(exc, StubUsedError):
            reply["stub"] = {"name": exc.stub, "module": exc.module}
        return reply


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer requests until `close` or the end of input."""
    worker = Worker()
    for line in requests:
        if not line.strip():
            continue
        reply = answer(worker, line)
        if reply is None:
            return
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv: list[str] | None = None) -> None:
    """Serve requests from stdin, replying on `--replies-fd N`; then exit at once: an
    interpreter that imported vLLM takes 2-12 s to tear its modules and threads down,
    and the worker has nothing left to keep (its replies are flushed and closed)."""
    parser = argparse.ArgumentParser(prog="python -m harness.conform.worker")
    parser.add_argument("--replies-fd", type=int, required=True, metavar="N",
                        help="the file descriptor replies are written to")
    args = parser.parse_args(argv)
    with os.fdopen(args.replies_fd, "w", encoding="utf-8") as replies:
        serve(sys.stdin, replies)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
