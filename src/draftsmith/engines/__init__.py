"""Serving engines as bench rows: vLLM and llama.cpp started as real processes on 127.0.0.1.

:func:`open_engine` builds one server (plain, or with an EAGLE-3 draft at draft length k)
behind the interface the bench uses: a context manager whose ``generate(prompt_ids,
max_new_tokens)`` returns an :class:`~draftsmith.engines.base.EngineResult` with the
engine's own acceptance counters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError

OURS = "draftsmith"
#: where a draft can be measured: our engine, and the serving engines
ENGINES = (OURS, "vllm", "llama.cpp")


def open_engine(name: str, verifier: str, draft: str | Path | None = None, k: int = 3, *,
                work_dir: str | Path, threads: int | None = None, dtype: str = "float32", device: str = "cpu",
                gpu_share: float | None = None) -> Any:
    """A serving engine's server for ``verifier`` (not started; use it as a context manager).

    Args:
        name: ``vllm`` or ``llama.cpp``.
        verifier: the verifier spec (alias, ``.gguf``, HF directory).
        draft: a speculators-format draft directory (None: plain decoding).
        k: tokens drafted per round.
        work_dir: where the server's log goes.
        threads: CPU threads (llama.cpp).
        dtype: the server's dtype (vLLM).
        device: where the verifier runs: ``cuda`` serves vLLM with its CUDA graphs on, taking ``gpu_share``
            of the GPU's memory (vLLM); llama.cpp's build here runs on the CPU either way.
    """
    if name == "vllm":
        from draftsmith.engines.vllm import VllmEngine

        return VllmEngine(verifier, draft, k, dtype=dtype, work_dir=work_dir, device=device,
                          gpu_memory_utilization=gpu_share)
    if name == "llama.cpp":
        from draftsmith.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(verifier, draft, k, threads=threads or 2, work_dir=work_dir)
    raise DraftsmithError(f"unknown engine {name!r}; choose one of {list(ENGINES)}")
