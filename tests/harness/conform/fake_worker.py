"""A stand-in for an engine venv's interpreter, for the tests of the worker pipe.

Started as the harness starts every worker (`python -s -m harness.conform.worker
--replies-fd N`: it reads only the descriptor), it serves kvcache's own manager posing as
the engine the load request names, through the real worker (`harness.conform.worker`),
except for what `$KVH_FAKE_WORKER` (a JSON object) says:

    version  the version its load reply claims (the lock's, for a run to go on)
    pid_file where it writes its process id (a test checks the worker is gone after)
    replies  {request: text}: the reply line sent for that request instead of the real one
    stub     true: the engine's commit touches the first raising stub of the load
             request's stubs (the lock's), as an engine whose lock stubs too much does
    raises   {"kind": OP, "when": WHEN}: the second call of that op raises
             (`faults.RaisesAt`: before the engine acted, or after, logged or not)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types
from collections.abc import Hashable
from pathlib import Path
from typing import IO, Any

from harness.conform.adapters import kvcache
from harness.conform.adapters.kvcache import KvcacheCache
from harness.conform.protocol import LoadedEngine
from harness.conform.stubs import StubSpec, install
from harness.conform.worker.serve import Worker, answer


class _TouchesStub(KvcacheCache):
    """kvcache, but every commit reads a name of `module`, a raising stub."""

    module = ""

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        importlib.import_module(self.module).mark_computed(seq_id)  # raises StubUsedError
        super().commit(seq_id, num_tokens)


def _pose(request: dict[str, Any], config: dict[str, Any]) -> LoadedEngine:
    """kvcache as the engine `request` loads; with `stub`, its stubs installed under empty
    packages of the engine's name and a commit that touches the first; with `raises`, an
    op that raises."""
    cls: type[KvcacheCache] = KvcacheCache
    served: tuple[str, ...] = ()
    if "raises" in config:
        # the fake interpreter runs this file as a script: the checkout's tests package
        # is not on its path
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
        faults = importlib.import_module("tests.harness.conform.faults")
        cls = faults.raises_at(config["raises"]["kind"], config["raises"]["when"])
    if config.get("stub"):
        spec = StubSpec.from_dict(request["stubs"])
        raising = StubSpec(raising=spec.raising, names=spec.names)
        for root in raising.raising:  # the engine's own packages above each stub: empty
            parts = root.split(".")
            for i in range(1, len(parts)):
                package = types.ModuleType(".".join(parts[:i]))
                package.__path__ = []
                sys.modules.setdefault(package.__name__, package)
        install(raising)
        cls = type("TouchesStub", (_TouchesStub,), {"module": min(raising.raising)})
        served = (min(raising.raising),)
    return kvcache.load(cls)._replace(name=request["engine"], version=config["version"],
                                      stubs_served=served)


def serve(requests: IO[str], replies: IO[str], config: dict[str, Any]) -> None:
    """The real worker's answers, but for the load and the replies `config` replaces."""
    worker = Worker()
    for line in requests:
        request = json.loads(line)
        cmd = request["cmd"]
        if cmd == "close":
            return
        if cmd in config.get("replies", {}):
            text = config["replies"][cmd]
        elif cmd == "load":
            worker.engine = e = _pose(request, config)
            text = json.dumps({"ok": True, "engine": e.name, "version": e.version,
                               "package_dir": e.package_dir,
                               "stubs_served": list(e.stubs_served),
                               "contract_basis": dict(e.contract_basis), "seconds": 0.0})
        else:
            text = json.dumps(answer(worker, line))
        replies.write(text + "\n")
        replies.flush()


def main() -> None:
    config = json.loads(os.environ.get("KVH_FAKE_WORKER", "{}"))
    if "pid_file" in config:
        with open(config["pid_file"], "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))
    parser = argparse.ArgumentParser()
    parser.add_argument("--replies-fd", type=int, required=True)
    args, _ = parser.parse_known_args()
    with os.fdopen(args.replies_fd, "w", encoding="utf-8") as replies:
        serve(sys.stdin, replies, config)


if __name__ == "__main__":
    main()
