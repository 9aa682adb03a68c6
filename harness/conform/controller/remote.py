"""The harness's side of the pipe: `WorkerTarget` drives an engine in its own venv.

It starts `python -m harness.conform.worker` with the engine's interpreter. The worker
sees the harness (and kvcache, for the benchmark) through a folder holding links to
those two packages only, never the harness's whole environment, and a source tree's
package root after it when the engine comes from one. PYTHONHASHSEED is fixed
(`HASH_SEED`): vLLM seeds its block hashes from it (a random seed per process without
it, so the events' hashes would change from run to run) and warns on every cache it
builds when it is unset. Replies come on a pipe
of their own (`--replies-fd`): the worker's stdout and stderr go to `log`, whose tail
every WorkerError quotes, so nothing the engine's venv prints can pass for a reply.
Replies are read with a timeout on a reader thread, so a hung engine ends the run
(WorkerError, exit 2) instead of the harness. Every reply is checked before it is used
(a JSON object, `ok` true with the fields its request returns, or false with an error):
anything else is a WorkerError naming the request and quoting the reply.
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
from harness.conform.protocol import CacheOptions, Contract
from harness.conform.stubs import StubSpec
from harness.conform.worker.session import StepReport

LOAD_TIMEOUT = 900.0  # the first import after an install compiles every module
CALL_TIMEOUT = 300.0
BENCH_TIMEOUT = 3600.0
HASH_SEED = "0"


class WorkerError(RuntimeError):
    """The worker failed, timed out, died or answered nonsense; the message has its error
    (or the reply) and log tail."""


class StubTouched(WorkerError):
    """The engine touched a stub (`stub`, inside the stub module `module`) while serving
    a request: the lock's stub list is wrong for this engine, and the run is void."""

    def __init__(self, stub: str, module: str, message: str) -> None:
        super().__init__(message)
        self.stub = stub
        self.module = module


# JSON's name for each kind of value a reply field holds.
_STRING, _ARRAY, _OBJECT = (str, "a string"), (list, "an array"), (dict, "an object")
_INTEGER, _NUMBER = (int, "an integer"), ((int, float), "a number")
# What an `ok` reply to each request carries, and the kind of each field.
_FIELDS: dict[str, dict[str, tuple[type | tuple[type, ...], str]]] = {
    "load": {"engine": _STRING, "version": _STRING, "package_dir": _STRING,
             "stubs_served": _ARRAY, "seconds": _NUMBER, "contract_basis": _OBJECT},
    "selftest": {"problems": _ARRAY, "sources": _OBJECT, "substitutes": _INTEGER,
                 "functions": _OBJECT, "calls": _OBJECT},
    "open": {"contract": _OBJECT},
    "ops": {"reports": _ARRAY},
    "code": {"functions": _OBJECT, "calls": _OBJECT},
    "bench": {"rows": _ARRAY},
}
QUOTED_CHARS = 200  # how much of a malformed reply an error quotes


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
    (`HASH_SEED`) whatever it is here, `python`'s folder first on PATH, and the C++
    extensions torch builds at run time kept in `python`'s venv (`torch_extensions`
    beside its bin): SGLang 0.5.19 on builds its event hash so, under one name for every
    release (0.5.23's source differs), and two releases' workers sharing torch's default
    folder rebuild it under each other's feet."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    path = [str(links)] + ([str(source)] if source is not None else [])
    env.update(PYTHONPATH=os.pathsep.join(path), PYTHONNOUSERSITE="1",
               PYTHONHASHSEED=HASH_SEED,
               PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}",
               TORCH_EXTENSIONS_DIR=str(python.parent.parent / "torch_extensions"))
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
        self._err: IO[str] | None = None
        self._proc: subprocess.Popen[str] | None = None
        try:  # whatever fails from here on, the worker and the link folder go
            self._start(python, log, source)
            self.info = self._call({"cmd": "load", "engine": engine,
                                    "stubs": stubs.as_dict(), "version": version},
                                   LOAD_TIMEOUT)
        except BaseException:
            self.close()
            raise
        self._name = f"{self.info['engine']} {self.info['version']}"

    def _start(self, python: Path, log: Path, source: Path | None) -> None:
        env = worker_environment(python, self._links, source)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(log, "w", encoding="utf-8")  # noqa: SIM115 (open until close())
        read_end, write_end = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [str(python), "-s", "-m", "harness.conform.worker", "--replies-fd",
                 str(write_end)], cwd=self._links, env=env, stdin=subprocess.PIPE,
                stdout=self._err, stderr=self._err, pass_fds=(write_end,), text=True,
                encoding="utf-8")
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the worker's now: its exit ends the reader's stream
        replies = os.fdopen(read_end, encoding="utf-8")
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(replies,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                self._replies.put(line)
        self._replies.put(None)  # the worker is gone

    def _call(self, msg: dict[str, Any], timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None
        stdin = self._proc.stdin
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
        return self._checked(msg["cmd"], line)

    def _checked(self, cmd: str, line: str) -> dict[str, Any]:
        """The reply `line` to `cmd`, checked (see the module docstring). Raises
        StubTouched for a failure that touched a stub, WorkerError for any other failure
        and for a reply that is not what `cmd` returns (quoting its start)."""
        def bad(problem: str) -> WorkerError:
            text = line.rstrip("\n")
            quoted = text[:QUOTED_CHARS] + ("..." if len(text) > QUOTED_CHARS else "")
            return WorkerError(f"the worker's reply to {cmd!r} {problem}: {quoted!r}"
                               f"{self._tail()}")

        try:
            reply = json.loads(line)
        except (ValueError, RecursionError) as exc:  # not JSON, an integer too long to
            raise bad(f"is not JSON ({exc})") from None  # read, or nested too deep
        if not isinstance(reply, dict):
            raise bad(f"is not a JSON object (got {type(reply).__name__})")
        if reply.get("ok") is False:
            error, stub = reply.get("error"), reply.get("stub")
            if not isinstance(error, str):
                raise bad("is a failure without an error message")
            if isinstance(stub, dict) and all(isinstance(stub.get(k), str)
                                              for k in ("name", "module")):
                raise StubTouched(stub["name"], stub["module"], f"{cmd}: {error}")
            if stub is not None:
                raise bad("names a stub that is not {name, module}")
            raise WorkerError(f"{cmd}: {error}\n{reply.get('traceback', '')}")
        if reply.get("ok") is not True:
            raise bad("says neither \"ok\": true nor \"ok\": false")
        for field, (kind, name) in _FIELDS[cmd].items():
            value = reply.get(field)
            if field not in reply:
                raise bad(f"lacks {field!r} ({name})")
            if isinstance(value, bool) or not isinstance(value, kind):
                raise bad(f"has {field!r} = {json.dumps(value)[:40]}, not {name}")
        return reply

    def _tail(self) -> str:
        if self._err is not None:
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

    def open(self, num_blocks: int, block_size: int,
             options: CacheOptions | None = None) -> Contract:
        """A fresh cache in the worker."""
        msg: dict[str, Any] = {"cmd": "open", "num_blocks": num_blocks,
                               "block_size": block_size}
        if options is not None and options.names():
            msg["options"] = options.as_dict()
        reply = self._call(msg)
        try:
            return Contract.from_dict(reply["contract"], "the worker's contract")
        except ValueError as exc:
            raise WorkerError(f"the worker's reply to 'open': {exc}") from None

    def apply(self, op: Op) -> StepReport:
        """One op."""
        return self.apply_all([op])[0]

    def apply_all(self, ops: Sequence[Op] | Iterable[Op]) -> list[StepReport]:
        """Several ops in one round trip; WorkerError unless the worker reports each op."""
        sent = ops_to_json(ops)
        reports = self._call({"cmd": "ops", "ops": sent})["reports"]
        if len(reports) != len(sent):
            raise WorkerError(f"the worker's reply to 'ops' has {len(reports)} reports for "
                              f"{len(sent)} ops")
        try:
            return [StepReport.from_dict(r, f"the worker's reply to 'ops': report {i}")
                    for i, r in enumerate(reports)]
        except ValueError as exc:
            raise WorkerError(str(exc)) from None

    def self_test(self) -> dict[str, Any]:
        """The worker's self-test: problems ([] = passed), sources, substitutes."""
        reply = self._call({"cmd": "selftest"}, LOAD_TIMEOUT)
        return {k: v for k, v in reply.items() if k != "ok"}

    def engine_code(self) -> dict[str, Any]:
        """The open cache's engine code (`worker.selftest.engine_code`)."""
        reply = self._call({"cmd": "code"})
        return {"functions": reply["functions"], "calls": reply["calls"]}

    def bench(self, quick: bool) -> list[dict[str, Any]]:
        """The benchmark rows, measured inside the worker."""
        return list(self._call({"cmd": "bench", "quick": quick}, BENCH_TIMEOUT)["rows"])

    def close(self) -> None:
        """Stop the worker and remove the link folder (idempotent; safe on a target
        whose start failed part-way)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"cmd": "close"}) + "\n")
                proc.stdin.close()
                proc.wait(timeout=30)
            except (OSError, ValueError, subprocess.TimeoutExpired):  # ValueError: closed
                proc.kill()
                proc.wait()
        if self._err is not None:
            self._err.close()
        shutil.rmtree(self._links, ignore_errors=True)
