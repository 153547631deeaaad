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
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import time
import weakref

import torch

log = logging.getLogger(__name__)

#: content key (bytes, digest of a sample) -> a frozen-graph constant whose storage equal ones share
_POOL: dict[tuple, weakref.ref] = {}
#: id of a compiled graph already gone through -> a weak reference to it (ids are reused after a free)
_SEEN: dict[int, weakref.ref] = {}
#: Sampled bytes of a storage in its content key (a key match is then checked over every byte)
_SAMPLE = 65536


def sharing_enabled() -> bool:
    """``DRAFTSMITH_SHARE_CONSTANTS``: ``1`` (default) shares; ``0`` keeps each graph's own copy."""
    return os.environ.get("DRAFTSMITH_SHARE_CONSTANTS", "1").strip() != "0"


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _key(storage: torch.UntypedStorage) -> tuple | None:
    flat = _bytes(storage)
    n = flat.numel()
    if n == 0:
        return None
    sample = flat[:: max(1, n // _SAMPLE)].contiguous()
    return n, hashlib.blake2b(sample.numpy().tobytes(), digest_size=16).digest()


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
    """Called after a frozen graph's function ran a call that may have compiled: shares the new
    graph's constants (:func:`share_frozen_constants`) when dynamo compiled one since the last look."""
    from torch._dynamo.utils import counters

    n = counters["stats"]["unique_graphs"]
    if n != _GRAPHS_SEEN[0]:
        _GRAPHS_SEEN[0] = n
        share_frozen_constants()


def share_frozen_constants() -> int:
    """Make the CPU constants of frozen graphs compiled since the last call share the storage of equal
    constants of frozen graphs before them (see the module's doc). Returns the bytes of the copies
    let go (freed, unless something this cannot reach holds them too); 0 where sharing is off
    (:func:`sharing_enabled`) or this torch keeps its graphs otherwise."""
    if not sharing_enabled():
        return 0
    t0 = time.perf_counter()
    try:
        graphs, held = _scan()
    except (ImportError, AttributeError) as e:  # another torch's inductor: nothing shared, nothing broken
        log.debug("frozen constants not shared: %s", e)
        return 0
    freed = shared = 0
    with torch.inference_mode():  # set_ on inference tensors (the constants of graphs compiled inside it)
        for g in graphs:
            seen = _SEEN.get(id(g))
            if (seen is not None and seen() is g) or not getattr(g, "frozen_param_names", None):
                continue
            _SEEN[id(g)] = weakref.ref(g)
            for t in (getattr(g, "constants", None) or {}).values():
                if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() in held:
                    continue
                key = _key(storage)
                if key is None:
                    continue
                ref = _POOL.get(key)
                other = ref() if ref is not None else None
                if other is None:
                    _POOL[key] = weakref.ref(t)
                    continue
                target = other.untyped_storage()
                if target.data_ptr() == storage.data_ptr() or not torch.equal(_bytes(target), _bytes(storage)):
                    continue
                chain = [t]  # the constant and its bases (set_ cuts a view from its base: list them first)
                while chain[-1]._base is not None:
                    chain.append(chain[-1]._base)
                for x in chain:  # none of them keeps the old storage alive
                    x.set_(target, x.storage_offset(), x.size(), x.stride())
                freed += storage.nbytes()
                shared += 1
    for k in [k for k, r in _POOL.items() if r() is None]:
        del _POOL[k]
    for k in [k for k, r in _SEEN.items() if r() is None]:
        del _SEEN[k]
    if shared:
        log.info("frozen graphs: %d constants (%.0f MiB) now share an equal one's memory (%.2f s)",
                 shared, freed / 2**20, time.perf_counter() - t0)
    return freed
