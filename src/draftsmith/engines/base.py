"""A serving engine as a bench row: a real server process on 127.0.0.1, plain or with a draft.

Each engine module (``vllm.py``, ``llamacpp.py``) builds the command line that starts
its server and knows how to ask it for a greedy completion of token ids and how to
read its own speculative-decoding counters. This module owns what they share: a
free port, starting the process in its own process group with its log in a file,
waiting until it answers, and stopping it on every exit path (normal exit, error,
Ctrl-C, SIGTERM) so that no server outlives the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from draftsmith.errors import DraftsmithError

LOG_TAIL_LINES = 40


@dataclass
class SpecCounters:
    """Speculative-decoding counters as the engine itself reports them (vLLM's definitions).

    Attributes:
        drafts: verifier rounds that checked at least one drafted token.
        draft_tokens: drafted tokens.
        accepted_tokens: drafted tokens the verifier accepted.
        accepted_per_position: accepted at draft position i (i = 0..k-1); empty when the
            engine does not report it (llama.cpp).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (n - len(other.accepted_per_position))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted_tokens - other.accepted_tokens, [a - b for a, b in zip(mine, theirs)])

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return self - SpecCounters(-other.drafts, -other.draft_tokens, -other.accepted_tokens,
                                   [-a for a in other.accepted_per_position])

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts (bonus token included), vLLM's mean acceptance length."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]


@dataclass
class EngineResult:
    """One greedy completion served by an engine.

    Attributes:
        token_ids: the new tokens (prompt excluded), in the verifier's vocabulary.
        seconds: wall time of the request as the client saw it (prefill included).
        counters: the engine's speculative-decoding counters for this request alone
            (None when served without a draft).
    """

    token_ids: list[int]
    seconds: float
    counters: SpecCounters | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (never a fixed one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def http_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
    """GET (``payload`` None) or POST JSON to ``url``; the decoded JSON answer."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def http_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` run under ``setpriv --pdeathsig TERM``: the kernel stops the server when we die.

    Our own exit paths stop the server; this covers the ones that run no Python code: a
    SIGKILL, or a SIGTERM in a program that does not turn it into an exception. Without
    ``setpriv`` (util-linux, Linux only) the command runs as it is. The kernel sends the
    signal when the *thread* that started the server ends: start servers from a thread
    that outlives them (the main thread, as bench and the tests do).
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *argv] if setpriv else list(argv)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``: a server and all it started.

    Read from /proc (Linux); elsewhere [pgid] while the group can still be signalled.
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    pids = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            pids.append(int(d.name))
    return pids


class ServerProcess:
    """A server started as its own process group, logged to a file, always stopped.

    Use as a context manager; the process is killed on every exit path. Startup
    failures (the process exits, or never answers ``health_url``) raise a
    :class:`DraftsmithError` that carries the tail of the server's log.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, health_url: str,
                 env: dict[str, str] | None = None, startup_timeout: float = 600.0) -> None:
        self.name, self.argv, self.log_path, self.health_url = name, list(argv), Path(log_path), health_url
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None  # kept after stop(), so callers can check that nothing outlived it

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(die_with_parent(self.argv), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise DraftsmithError(f"{self.name}: cannot start {self.argv[0]!r}: {e}") from e
        finally:
            log.close()
        self.pid = self.proc.pid
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise DraftsmithError(f"{self.name} exited with code {code} while starting; its log "
                                      f"({self.log_path}) ends with:\n{log_tail(self.log_path)}")
            try:
                urllib.request.urlopen(self.health_url, timeout=5).close()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise DraftsmithError(f"{self.name} did not answer {self.health_url} within "
                                      f"{self.startup_timeout:.0f} s; its log ({self.log_path}) ends with:\n"
                                      f"{log_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after ``grace`` seconds.

        Returns only when no live process of the group is left: a server's workers (vLLM's
        engine core) can outlive its main process by seconds after a SIGTERM.
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None or group_members(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + grace
            while group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
