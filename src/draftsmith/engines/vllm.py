"""vLLM as a bench row: a real ``vllm serve`` process, plain or with an EAGLE-3 draft.

vLLM runs from its own virtual environment (``make setup-vllm`` builds ``.venv-vllm``
with ``vllm-cpu`` pinned next to the CPU torch), never imported here: its pins must
not constrain draftsmith's. :class:`VllmEngine` starts the OpenAI-compatible server
on 127.0.0.1 at a free port, serving the verifier's local HF directory
(:func:`~draftsmith.models.verifier.resolve_spec`), asks it for greedy completions of
token ids, and reads vLLM's own speculative-decoding counters from ``/metrics``
before and after each request, so every result carries that request's counters.

Requests are sent one at a time by :meth:`VllmEngine.generate`: the counters are
server-wide, so a request's delta is only its own while no other request runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
import urllib.error
from pathlib import Path
from typing import Any, Sequence

from draftsmith.engines.base import (EngineResult, ServerProcess, SpecCounters, free_port, http_json, http_text,
                                     log_tail)
from draftsmith.errors import DraftsmithError

PYTHON_ENV = "DRAFTSMITH_VLLM_PYTHON"
VENV = ".venv-vllm"
# vLLM's spec-decode counters (prometheus_client appends "_total" to counters).
_METRIC = re.compile(r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)"
                     r"(?:_total)?(\{[^}]*\})?\s+(\S+)\s*$")
_POSITION = re.compile(r'position="(\d+)"')


def vllm_python() -> Path:
    """The python of the vLLM venv: ``$DRAFTSMITH_VLLM_PYTHON``, else the checkout's ``.venv-vllm``.

    Raises:
        DraftsmithError: no such interpreter (with how to build it).
    """
    override = os.environ.get(PYTHON_ENV)
    if override:
        path = Path(override).expanduser()
        where = f"${PYTHON_ENV} ({override})"
    else:
        # The repository root of a source checkout (src/draftsmith/engines/vllm.py), else the
        # working directory: where `make setup-vllm` puts the venv.
        root = Path(__file__).resolve().parents[3]
        path = next((r / VENV / "bin" / "python" for r in (root, Path.cwd())
                     if (r / VENV / "bin" / "python").is_file()), root / VENV / "bin" / "python")
        where = str(path)
    if not path.is_file():
        raise DraftsmithError(f"vLLM's python not found at {where}: run `make setup-vllm` in the draftsmith "
                              f"checkout (it installs vllm-cpu into {VENV}), or point ${PYTHON_ENV} at the "
                              "python of an environment where `import vllm` works")
    return path


def parse_spec_metrics(text: str) -> SpecCounters:
    """vLLM's speculative-decoding counters from its Prometheus ``/metrics`` text (summed over engines).

    A server without a draft exports none of them: all counters are then 0.
    """
    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "accepted_tokens_per_pos":
            p = _POSITION.search(labels)
            if p is None:
                raise DraftsmithError(f"vLLM metric without a position label: {line!r}")
            per_pos[int(p.group(1))] = per_pos.get(int(p.group(1)), 0.0) + value
        else:
            totals[name] += value
    n = max(per_pos) + 1 if per_pos else 0
    return SpecCounters(int(totals["drafts"]), int(totals["draft_tokens"]), int(totals["accepted_tokens"]),
                        [int(per_pos.get(i, 0.0)) for i in range(n)])


class VllmEngine:
    """A vLLM OpenAI-compatible server for the verifier, optionally with an EAGLE-3 draft.

    Use as a context manager; the server is stopped on every exit path, and one that
    fails to start raises :class:`DraftsmithError` with the tail of its log and leaves
    no process behind.

    Args:
        verifier_spec: a verifier spec (HF dir, ``.gguf``, alias), served from its HF directory.
        draft_dir: a speculators-format EAGLE-3 draft (None: plain decoding).
        k: tokens drafted per step (``num_speculative_tokens``).
        dtype: the server's dtype (float32: greedy outputs comparable to draftsmith's engine).
        work_dir: where the server log goes (``vllm-<port>.log``).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``, the KV cache vLLM reserves on a CPU.
        device: ``cpu`` (vllm-cpu, eager: no CUDA graphs to capture) or ``cuda`` (a CUDA build of vLLM,
            with its CUDA graphs: what it serves with).
        gpu_memory_utilization: on CUDA, the share of the GPU's memory this server takes (vLLM's default,
            0.92, leaves no room for a second server, which then refuses to start).
        max_model_len: context limit the server allows (None: the model's).
        startup_timeout: seconds to wait for ``/health``.
        extra_args: more ``vllm serve`` flags.
    """

    name = "vllm"

    def __init__(self, verifier_spec: str | os.PathLike, draft_dir: str | os.PathLike | None = None, k: int = 3,
                 dtype: str = "float32", work_dir: str | os.PathLike = "runs/engines", kv_cache_gib: int = 2,
                 max_model_len: int | None = None, startup_timeout: float = 900.0,
                 extra_args: Sequence[str] = (), device: str = "cpu",
                 gpu_memory_utilization: float | None = None) -> None:
        if k < 1:
            raise DraftsmithError(f"--num-draft-tokens must be >= 1, got {k}")
        if draft_dir is not None and not (Path(draft_dir) / "config.json").is_file():
            raise DraftsmithError(f"draft {draft_dir}: no config.json (a speculators-format draft directory "
                                  "from `draftsmith export`)")
        self.verifier_spec, self.k, self.dtype = str(verifier_spec), k, dtype
        self.draft_dir = None if draft_dir is None else Path(draft_dir).resolve()
        self.work_dir, self.kv_cache_gib, self.max_model_len = Path(work_dir), kv_cache_gib, max_model_len
        self.startup_timeout, self.extra_args = startup_timeout, list(extra_args)
        self.device, self.gpu_memory_utilization = device, gpu_memory_utilization
        self.server: ServerProcess | None = None
        self.port: int | None = None
        self.model_name: str | None = None
        self.version: str | None = None
        self.startup_seconds: float | None = None
        self.argv: list[str] = []
        self.env: dict[str, str] = {}

    # ------------------------------------------------------------------ lifecycle
    def command(self, python: Path, model_dir: Path, port: int) -> list[str]:
        """The ``vllm serve`` command line (also what the report prints)."""
        # The server's own entry point: the `vllm` console script reads the version of a
        # distribution named "vllm", which vllm-cpu is not, and fails.
        argv = [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir),
                "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
                # CPU: no CUDA graphs or torch.compile to capture; eager also starts much faster.
                # (On CUDA its graphs stay on: the speed it serves with is the one that counts.)
                *(["--enforce-eager"] if self.device == "cpu" else []),
                *(["--gpu-memory-utilization", f"{self.gpu_memory_utilization:.3f}"]
                  if self.device != "cpu" and self.gpu_memory_utilization is not None else []),
                # Without it vLLM applies the model's generation_config.json (penalties, top-k) as
                # request defaults; every request here states its own sampling settings.
                "--generation-config", "vllm",
                "--disable-uvicorn-access-log"]
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.draft_dir is not None:
            spec = {"method": "eagle3", "model": str(self.draft_dir), "num_speculative_tokens": self.k}
            argv += ["--speculative-config", json.dumps(spec)]
        return argv + self.extra_args

    def environment(self, python: Path) -> dict[str, str]:
        """The server's environment on top of ours."""
        # vLLM's default on a CPU is 4 GiB of KV cache; a 135M model needs far less.
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)} if self.device == "cpu" else {}
        iomp = python.parent.parent / "lib" / "libiomp5.so"
        # vLLM's CPU guide preloads the Intel OpenMP runtime its wheel brings (for speed); 0.32.0
        # also starts without it, and an environment without the file simply goes without.
        if iomp.is_file():
            env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), os.environ.get("LD_PRELOAD", "")) if p)
        return env

    def start(self) -> "VllmEngine":
        """Start the server and wait until it answers (minutes on a small CPU)."""
        if self.server is not None:
            return self
        from draftsmith.models.verifier import resolve_spec

        python = vllm_python()
        model_dir = resolve_spec(self.verifier_spec)
        self.port = free_port()
        url = f"http://127.0.0.1:{self.port}"
        log = self.work_dir / f"vllm-{self.port}.log"
        label = "vLLM" + (f" with draft {self.draft_dir}" if self.draft_dir else "")
        self.argv, self.env = self.command(python, model_dir, self.port), self.environment(python)
        server = ServerProcess(label, self.argv, log, f"{url}/health", env=self.env,
                               startup_timeout=self.startup_timeout)
        t0 = time.perf_counter()
        server.start()
        self.server = server
        try:
            self.model_name = str(http_json(f"{url}/v1/models", timeout=30)["data"][0]["id"])
            self.version = str(http_json(f"{url}/version", timeout=30).get("version"))
        except (OSError, ValueError, KeyError, IndexError) as e:
            self.stop()
            raise DraftsmithError(f"{label} answered /health but not /v1/models or /version ({e}); its log "
                                  f"({log}) ends with:\n{log_tail(log)}") from e
        except BaseException:  # Ctrl-C while asking: the server goes too
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - t0
        return self

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def __enter__(self) -> "VllmEngine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self.server is None or self.port is None:
            raise DraftsmithError("the vLLM server is not running (use VllmEngine as a context manager)")
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return None if self.server is None else self.server.log_path

    def describe(self) -> dict[str, Any]:
        """What a report records about the server: its command line, environment, version, startup time."""
        return {"engine": self.name, "version": self.version, "command": shlex.join(self.argv), "env": self.env,
                "model": self.model_name, "draft": None if self.draft_dir is None else str(self.draft_dir),
                "k": self.k if self.draft_dir is not None else None, "dtype": self.dtype, "device": self.device,
                "startup_seconds": None if self.startup_seconds is None else round(self.startup_seconds, 1)}

    # ------------------------------------------------------------------ requests
    def counters(self) -> SpecCounters:
        """The server's cumulative speculative-decoding counters (all 0 without a draft)."""
        return parse_spec_metrics(http_text(f"{self.url}/metrics"))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> EngineResult:
        """One greedy completion of ``prompt_ids``; stops at the model's end-of-sequence token.

        Returns:
            the new token ids (the end-of-sequence token included when it ended the reply,
            as draftsmith's engine does), the request's wall time, and, with a draft,
            vLLM's counters for this request.

        Raises:
            DraftsmithError: the server refused the request or died (with its log tail).
        """
        if max_new_tokens < 1:
            raise DraftsmithError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        payload = {"model": self.model_name, "prompt": [int(t) for t in prompt_ids], "max_tokens": max_new_tokens,
                   "temperature": 0.0, "ignore_eos": False,
                   # the generated ids themselves: re-tokenizing the text would not give them back
                   "return_token_ids": True}
        before = self.counters() if self.draft_dir else None
        t0 = time.perf_counter()
        try:
            answer = http_json(f"{self.url}/v1/completions", payload)
        except (urllib.error.URLError, OSError) as e:
            raise self._request_error(e) from e
        seconds = time.perf_counter() - t0
        choice = answer["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:
            raise DraftsmithError("vLLM answered without token_ids; it does not support return_token_ids "
                                  "(vllm-cpu 0.32.0 does: run `make setup-vllm`)")
        counters = self.counters() - before if before is not None else None
        return EngineResult([int(t) for t in ids], seconds, counters)

    def _request_error(self, e: Exception) -> DraftsmithError:
        detail = ""
        if isinstance(e, urllib.error.HTTPError):
            try:
                detail = ": " + e.read().decode(errors="replace")[:500]
            except OSError:
                pass
        alive = self.server is not None and self.server.proc is not None and self.server.proc.poll() is None
        tail = "" if self.log_path is None else f"; its log ({self.log_path}) ends with:\n{log_tail(self.log_path)}"
        return DraftsmithError(f"vLLM request failed ({e}{detail}){'' if alive else ' and the server died'}{tail}")
