"""The harness's side of the pipe: `WorkerTarget` drives an engine in its own venv.

It starts `python -m harness.conform.worker` with the engine's interpreter. The worker
sees the harness (and kvcache, for the benchmark) through a folder holding links to
those two packages only, never the harness's whole environment, and a source tree's
package root after it when the engine comes from one. PYTHONHASHSEED is fixed
(`HASH_SEED`): vLLM seeds its block hashes from it (a random seed per process without
it, so the events' hashes would change from run to run) and warns on every cache it
builds when it is unset. Replies are read with a
timeout on a reader thread, so a hung engine ends the run (WorkerError, exit 2) instead
of the harness. The worker's stderr goes to `log`, whose tail every WorkerError quotes.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import harness
from harness.conform.ops import Op, ops_to_json
from harness.conform.protocol import Contract
from harness.conform.session import StepReport
from harness.conform.stubs import StubSpec

LOAD_TIMEOUT = 900.0  # the first import after an install compiles every module
CALL_TIMEOUT = 300.0
BENCH_TIMEOUT = 3600.0
HASH_SEED = "0"


class WorkerError(RuntimeError):
    """The worker failed, timed out or died; the message has its error and log tail."""


def _package_links() -> Path:
    """A temporary folder with links to the harness and kvcache packages."""
    folder = Path(tempfile.mkdtemp(prefix="kvharness-worker-"))
    here = Path(harness.__file__).resolve().parent
    for package in (here, here.parent / "kvcache"):
        if package.exists():
            (folder / package.name).symlink_to(package)
    return folder


def worker_environment(python: Path, links: Path, source: Path | None) -> dict[str, str]:
    """The worker's environment: this one's, but its Python path is `links` (then
    `source`, a source tree's package root), no user site, PYTHONHASHSEED fixed
    (`HASH_SEED`) whatever it is here, and `python`'s folder first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    path = [str(links)] + ([str(source)] if source is not None else [])
    env.update(PYTHONPATH=os.pathsep.join(path), PYTHONNOUSERSITE="1",
               PYTHONHASHSEED=HASH_SEED,
               PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}")
    return env


class WorkerTarget:
    """A `Target` whose caches live in a worker process (see the module docstring).

    `python`: the engine venv's interpreter; `engine`: an adapter name; `stubs`: the
    lock's stubs; `source`: a source tree's package root, imported from where it is;
    `version`: the engine's version where its package has no metadata (a source tree).
    Starting it loads the engine (`info` says what loaded).
    """

    def __init__(self, python: Path, engine: str, stubs: StubSpec, log: Path,
                 source: Path | None = None, version: str | None = None) -> None:
        self.log = log
        self._links = _package_links()
        env = worker_environment(python, self._links, source)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(log, "w", encoding="utf-8")  # noqa: SIM115 (open until close())
        self._proc = subprocess.Popen(
            [str(python), "-s", "-m", "harness.conform.worker"], cwd=self._links, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
            encoding="utf-8")
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True).start()
        self.info = self._call({"cmd": "load", "engine": engine, "stubs": stubs.as_dict(),
                                "version": version}, LOAD_TIMEOUT)
        self._name = f"{self.info['engine']} {self.info['version']}"

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self._replies.put(line)
        self._replies.put(None)  # the worker is gone

    def _call(self, msg: dict[str, Any], timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(msg) + "\n")
            stdin.flush()
            line = self._replies.get(timeout=timeout)
        except (BrokenPipeError, OSError):
            line = None
        except queue.Empty:
            self.close()
            raise WorkerError(f"the worker did not answer {msg['cmd']!r} within "
                              f"{timeout:.0f} s{self._tail()}") from None
        if line is None:
            code = self._proc.wait(timeout=30)
            raise WorkerError(f"the worker exited (code {code}) during {msg['cmd']!r}"
                              f"{self._tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerError(f"{msg['cmd']}: {reply.get('error')}\n{reply.get('traceback', '')}")
        return reply

    def _tail(self) -> str:
        self._err.flush()
        try:
            lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return f"; the end of {self.log}:\n" + "\n".join(lines[-15:]) if lines else ""

    # -- Target ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """`engine version` as the worker loaded it."""
        return self._name

    def open(self, num_blocks: int, block_size: int) -> Contract:
        """A fresh cache in the worker."""
        reply = self._call({"cmd": "open", "num_blocks": num_blocks, "block_size": block_size})
        return Contract.from_dict(reply["contract"], "the worker's contract")

    def apply(self, op: Op) -> StepReport:
        """One op."""
        return self.apply_all([op])[0]

    def apply_all(self, ops: Sequence[Op] | Iterable[Op]) -> list[StepReport]:
        """Several ops in one round trip."""
        reply = self._call({"cmd": "ops", "ops": ops_to_json(ops)})
        return [StepReport.from_dict(r, "the worker's step report") for r in reply["reports"]]

    # -- the rest -------------------------------------------------------------------------

    def self_test(self) -> dict[str, Any]:
        """The worker's self-test: problems ([] = passed), sources, substitutes."""
        return self._call({"cmd": "selftest"}, LOAD_TIMEOUT)

    def bench(self, quick: bool) -> list[dict[str, Any]]:
        """The benchmark rows, measured inside the worker."""
        return list(self._call({"cmd": "bench", "quick": quick}, BENCH_TIMEOUT)["rows"])

    def close(self) -> None:
        """Stop the worker and remove the link folder (idempotent)."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"cmd": "close"}) + "\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._err.close()
        shutil.rmtree(self._links, ignore_errors=True)
