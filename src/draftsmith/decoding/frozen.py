"""One copy of the weights for every frozen CPU graph of a model: equal constants share their memory.

A compiled CPU step (:class:`~draftsmith.decoding.runner.CompiledFn`) freezes the weights it reads:
inductor packs each Linear's weight into the C++ GEMM template's blocked layout and keeps the packed
tensor as a constant *of that graph*. A model compiles several graphs (the one-token step, the verify
step, a graph per cache size), and each packed its own copy: SmolLM2-135M in float32 held the model's
513 MiB, then 513 MiB more per frozen graph (one-token and verify: 1.54 GiB of weights; BENCHMARKS 15c).
The copies are byte for byte the same, so after a graph is compiled, :func:`share_frozen_constants`
points each of its constants at the storage of an equal one another frozen graph already holds, and
its own copy is freed.

Sound because a graph's constants are never written (inductor folds them once, at compile time) and
the shared bytes are equal; every tensor on the replaced storage that can be reached (the constant and
its bases) is moved, so the graph computes from the same bytes as before. A storage a model's
parameter or buffer also holds is left alone: that one can be written, the constants never are.

After each compile the heap's free memory is given back to the system too (:func:`release_free_heap`):
a compile's transients otherwise stay resident.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref

import torch

log = logging.getLogger(__name__)

#: content key (:func:`_key`) -> frozen-graph constants whose storages equal ones share (one per content)
_POOL: dict[tuple, list[weakref.ref]] = {}
#: id of a compiled graph already gone through -> a weak reference to it (ids are reused after a free)
_SEEN: dict[int, weakref.ref] = {}


def sharing_enabled() -> bool:
    """``DRAFTSMITH_SHARE_CONSTANTS``: ``1`` (default) shares; ``0`` keeps each graph's own copy."""
    return os.environ.get("DRAFTSMITH_SHARE_CONSTANTS", "1").strip() != "0"


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _key(storage: torch.UntypedStorage) -> tuple | None:
    """A checksum of every byte (sums of its 32-bit words, all and every 97th; a key match is then
    checked byte for byte). Not a sample of bytes: weights dequantized from 4-bit blocks end in the
    same low bytes, so sampled bytes collide between different tensors of one shape."""
    flat = _bytes(storage)
    n = flat.numel()
    if n == 0:
        return None
    words = flat[: n - n % 4].view(torch.int32)
    return (n, int(words.sum(dtype=torch.int64)), int(words[::97].sum(dtype=torch.int64)),
            bytes(flat[n - n % 4:].tolist()))


def compiled_graphs(frozen_only: bool = False) -> list:
    """The live compiled graphs (inductor's ``CompiledFxGraph``), or only those that froze weights."""
    from torch._inductor.output_code import CompiledFxGraph

    graphs = [o for o in gc.get_objects() if issubclass(type(o), CompiledFxGraph)]  # type(): see _scan
    return [g for g in graphs if getattr(g, "frozen_param_names", None)] if frozen_only else graphs


def _scan() -> tuple[list, set[int]]:
    """The live compiled graphs, and the storages (data pointers) of every module's parameters and
    buffers, in one pass over the collector's objects."""
    from torch._inductor.output_code import CompiledFxGraph

    graphs, held = [], set()
    for o in gc.get_objects():
        kind = type(o)  # not isinstance: a dead weak proxy raises on it
        if issubclass(kind, CompiledFxGraph):
            graphs.append(o)
        elif issubclass(kind, torch.nn.Module):
            for t in (*o._parameters.values(), *o._buffers.values()):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    try:
                        held.add(t.untyped_storage().data_ptr())
                    except RuntimeError:  # a fake or meta tensor: holds no memory
                        pass
    return graphs, held


#: dynamo's count of graphs compiled in this process when :func:`after_compiled_call` last looked
_GRAPHS_SEEN = [-1]


def after_compiled_call() -> None:
    """Called after a compiled function ran a call that may have compiled: when dynamo compiled a
    graph since the last look, shares its constants (:func:`share_frozen_constants`) and trims the
    heap (:func:`release_free_heap`)."""
    from torch._dynamo.utils import counters

    n = counters["stats"]["unique_graphs"]
    if n != _GRAPHS_SEEN[0]:
        _GRAPHS_SEEN[0] = n
        share_frozen_constants()
        release_free_heap()


def release_free_heap() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    A compile allocates and frees gigabytes (inductor's lowering, autotuning, the weights packed and
    their copies given up above); glibc keeps what was freed mapped for the process's next
    allocations, so the resident size stays near the compile's peak. SmolLM2-135M with an EAGLE-3
    draft, its steps compiled: 3.3 GiB resident after, 1.8 GiB once trimmed (BENCHMARKS 15c)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def share_frozen_constants() -> int:
    """Make the CPU constants of frozen graphs compiled since the last call share the storage of equal
    constants of frozen graphs before them (see the module's doc). Returns the bytes of the copies
    let go (freed, unless something this cannot reach holds them too); 0 where sharing is off
    (:func:`sharing_enabled`: the graphs compiled meanwhile keep their own copies, and are not
    targets either) or this torch keeps its graphs otherwise."""
    t0 = time.perf_counter()
    try:
        graphs, held = _scan()
    except (ImportError, AttributeError) as e:  # another torch's inductor: nothing shared, nothing broken
        log.debug("frozen constants not shared: %s", e)
        return 0
    enabled = sharing_enabled()
    freed = shared = 0
    with torch.inference_mode():  # set_ on inference tensors (the constants of graphs compiled inside it)
        for g in graphs:
            seen = _SEEN.get(id(g))
            if (seen is not None and seen() is g) or not getattr(g, "frozen_param_names", None):
                continue
            _SEEN[id(g)] = weakref.ref(g)  # compiled while off: keeps its own copies for good
            if not enabled:
                continue
            for t in (getattr(g, "constants", None) or {}).values():
                if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() in held:
                    continue
                key = _key(storage)
                if key is None:
                    continue
                same = _POOL.setdefault(key, [])
                target = None
                for ref in same:
                    other = ref()
                    if other is not None and torch.equal(_bytes(other.untyped_storage()), _bytes(storage)):
                        target = other.untyped_storage()
                        break
                if target is None:
                    same.append(weakref.ref(t))
                    continue
                if target.data_ptr() == storage.data_ptr():
                    continue
                chain = [t]  # the constant and its bases (set_ cuts a view from its base: list them first)
                while chain[-1]._base is not None:
                    chain.append(chain[-1]._base)
                for x in chain:  # none of them keeps the old storage alive
                    x.set_(target, x.storage_offset(), x.size(), x.stride())
                same.append(weakref.ref(t))  # a target still, should the graph it now shares with go
                freed += storage.nbytes()
                shared += 1
    for k in list(_POOL):
        _POOL[k] = [r for r in _POOL[k] if r() is not None]
        if not _POOL[k]:
            del _POOL[k]
    for k in [k for k, r in _SEEN.items() if r() is None]:
        del _SEEN[k]
    if shared:
        log.info("frozen graphs: %d constants (%.0f MiB) now share an equal one's memory (%.2f s)",
                 shared, freed / 2**20, time.perf_counter() - t0)
    return freed
