"""Decode-time attention over the KV cache on the CPU: a C++ kernel as a custom op.

A compiled step (``--compile``) attends over its static cache (:class:`~draftsmith.models.kv.KVCache`,
static mode). Through SDPA under a position mask, it reads all S slots of the cache's bucket
whatever the context holds, at a third of the memory bandwidth (BENCHMARKS.md 9k: a one-token
step at 1024 cached tokens 1.19-1.24x one at 128). :func:`decode_attention` reads only the
slots each query sees (``[pos - W + 1, pos]``, or ``[0, pos]``), the query heads of one KV head
together, split into (KV head, chunk of slots) tasks over the threads and combined by their
softmax maxima; float32 inside, K/V float32 or bfloat16 (``cpu_attention.cpp``).

The eager steps of ``--weight-layout cpp`` use it too (:func:`draftsmith.models.kv.eager_cpu_attention`):
SDPA's one-query kernel made an eager SmolLM2-135M step at 1024 cached tokens 1.22x one at 128,
the kernel 1.11x (BENCHMARKS.md 15h). Its work is split at absolute slot multiples, so a query's
result does not depend on the other queries of its call (a verify step's rows are one-token steps').

It is a ``torch.library`` custom op, so ``torch.compile`` calls it as one opaque kernel.
The extension is built on first use (:func:`draftsmith.models.cpp_ops.build`). Where it cannot be built, or with
``DRAFTSMITH_CPU_ATTENTION=0``, the static path keeps SDPA. Its outputs equal SDPA's to float32
rounding (not bitwise: a compiled step is not bitwise the eager one anyway); the greedy
identity tests cover the compiled steps that use it.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from draftsmith.models import cpp_ops

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
#: Slots per task: small enough that 2 threads share a one-query step's work, large enough that a
#: task's softmax and combine cost little next to reading its K/V.
CHUNK = 256

_FAKE_REGISTERED = False


def _disabled() -> bool:
    return os.environ.get("DRAFTSMITH_CPU_ATTENTION", "1").strip().lower() in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def _extension():
    """The built extension module, or None (with one warning) where it cannot be built."""
    if _disabled():
        return None
    try:
        cpp_ops.build(_SOURCE, "draftsmith_cpu_attention")
        global _FAKE_REGISTERED
        if not _FAKE_REGISTERED:  # once per process: the op outlives a cache_clear of this function
            torch.library.register_fake("draftsmith::decode_attention")(_fake)
            _FAKE_REGISTERED = True
        return torch.ops.draftsmith.decode_attention
    except Exception as e:  # no compiler, no ninja, a build error: SDPA still works
        log.warning("the CPU decode-attention kernel could not be built (%s); compiled steps attend through SDPA",
                    str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
        return None


def available() -> bool:
    """Whether the kernel is built (building it now if not yet) and not disabled."""
    return _extension() is not None


def _fake(q, K, V, pos, window, scale, chunk):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos: torch.Tensor, window: int,
                     scale: float) -> torch.Tensor:
    """Queries ``q [1, nh, m, hd]`` at positions ``pos [m]`` over the slots ``[pos - window + 1, pos]``
    (``window`` 0: ``[0, pos]``) of ``K, V [1, nkv, S, hd]``; returns ``[1, nh, m, hd]`` in q's dtype.

    The op ``torch.ops.draftsmith.decode_attention`` (registered in C++, so a compiled graph calls
    it without Python in between); :func:`available` must have returned True.
    """
    return torch.ops.draftsmith.decode_attention(q, K, V, pos, window, scale, CHUNK)
