"""A preallocated KV cache sized to one request, rolled back by moving an index.

Symbols: S capacity (prompt + max new tokens + draft length + slack), T ``length``
(positions whose keys/values are valid), m new positions of a forward, nkv / hd
key-value heads and head dim, W a layer's sliding window (None: full attention).

A forward writes the keys/values of its m positions at ``[T, T+m)`` of every layer
and then ``advance(m)``; a rejected draft is undone by ``rollback(T')``, which only
moves T: the stale entries past T are overwritten by the next write and never read,
because attention reads ``[.., :T+m)`` (eager) or masks every key past the query's
position (static). Nothing is copied or concatenated per step, unlike a
``DynamicCache`` whose every layer re-concatenates its whole cache on each forward.

Two ways to read the cache, same buffers:

- eager (default): attend over the prefix view ``[lo, T+m)`` (``lo`` > 0 only for a
  sliding window), so a step costs what its context holds; a one-token step needs no mask.
  Inside :func:`eager_cpu_attention` (``--weight-layout cpp``) a CPU cache's decode and verify
  forwards attend through :mod:`draftsmith.models.cpu_attention`'s kernel instead of SDPA.
- static (``static=True``, for ``torch.compile`` and CUDA graphs): write at the
  position tensor with ``index_copy_``, so every shape is fixed and nothing in the step
  reads T on the host. On the CPU the attention is :mod:`draftsmith.models.cpu_attention`'s
  kernel, which reads the position tensor itself and only the slots each query sees;
  elsewhere (CUDA, or where the kernel cannot be built) SDPA attends over all S slots
  under a mask built from that tensor.

``per_query=True`` (eager only) makes a multi-token forward after the prompt attend
one query at a time, each exactly as a one-token step at its position would: the
same call on the same keys. A verifier whose other operations are row-wise exact
(int8 matmuls with per-token activation scales, norms, rope, elementwise ops) then
computes each position bitwise as plain decoding does. A W8A8 verifier needs it:
its activation rounding turns an ulp of attention rounding into a whole int8 step
(logits ~1 apart on Gemma-3-270M, BENCHMARKS.md section 12). Costs m attention
calls per layer instead of one.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.models import cpu_attention


#: Queries of an eager forward up to which :func:`eager_cpu_attention` attends through the C++ kernel
#: (a decode or verify step); a longer forward (a prefill) keeps SDPA's causal kernel.
EAGER_KERNEL_MAX_ROWS = 16

_eager_kernel: list[bool] = []  # the innermost eager_cpu_attention block's setting


@contextlib.contextmanager
def eager_cpu_attention(enabled: bool = True) -> Iterator[None]:
    """While the block runs, eager (not static) decode and verify forwards of up to
    :data:`EAGER_KERNEL_MAX_ROWS` queries on a CPU cache (float32 or bfloat16) attend through
    :mod:`~draftsmith.models.cpu_attention`'s kernel instead of SDPA over the prefix view: it reads
    each query's slots once at memory speed, where SDPA's one-query kernel made a SmolLM2-135M
    eager step at 1024 cached tokens 1.22x one at 128 (BENCHMARKS.md 15h). Entered by
    ``--weight-layout cpp`` (:func:`draftsmith.models.verifier.linears_cpp`) for every cache of the
    process; the innermost block decides (``enabled=False`` inside turns it off). Results differ from SDPA's by float32 rounding, so the lean eager step is then
    not bitwise transformers' forward (whose attention stays SDPA); a query's result does not
    depend on the other queries of its forward (tested), so verify rows are one-token steps' rows."""
    _eager_kernel.append(bool(enabled))
    try:
        yield
    finally:
        _eager_kernel.pop()


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA uses it: 0 where ``keep``, -inf elsewhere, in ``dtype``.

    Both values are exact in every float dtype, so passing it is bitwise passing ``keep``;
    built once, it saves SDPA the conversion on every layer's call.
    """
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


#: Whether :func:`gqa_attention` folds a masked grouped-query call's query heads (None: off the CPU).
FOLD_GQA: bool | None = None


def gqa_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  causal: bool = False, fold: bool | None = None) -> torch.Tensor:
    """SDPA of queries ``[b, nh, m, hd]`` over keys/values ``[b, nkv, S, hd]`` with ``nkv`` dividing
    ``nh``, under ``mask`` (``[m, S]``, boolean or additive) or ``causal``.

    On the CPU through SDPA's ``enable_gqa`` (no K/V copies; its rounding is what the CPU tests pin
    down). Elsewhere a masked call with grouped heads folds the ``rep = nh / nkv`` query heads of each
    KV head into one sequence of ``rep * m`` queries under the mask tiled ``rep`` times: CUDA's fused
    kernels take grouped heads only without a mask (flash) or a mask only without grouped heads
    (memory-efficient), so ``enable_gqa`` with a mask runs the math kernel, which builds the whole
    score matrix. transformers' masked one-token step folds the same way; a query row's result does
    not depend on the other rows, so the two forms agree to rounding (tested on the CPU through
    :data:`FOLD_GQA`). ``fold`` decides instead where given (a one-token mask of one row broadcasts
    over the folded heads, as transformers passes it).
    """
    nh, nkv = q.shape[1], K.shape[1]
    if fold is None and mask is not None and nh != nkv:  # (resolved only where it can matter: a hot path)
        fold = (q.device.type != "cpu") if FOLD_GQA is None else FOLD_GQA
    if mask is None or nh == nkv or not fold:
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=nh != nkv)
    b, _, m, hd = q.shape
    rep = nh // nkv
    out = F.scaled_dot_product_attention(q.reshape(b, nkv, rep * m, hd), K, V,
                                         attn_mask=mask if m == 1 else mask.repeat(rep, 1), scale=scale)
    return out.reshape(b, nh, m, hd)


class KVCache:
    """Keys and values ``[1, nkv, S, hd]`` per layer, valid up to ``length``.

    Args:
        num_layers: layers (one buffer pair each).
        num_kv_heads: nkv, one int or one per layer.
        head_dim: hd, one int or one per layer.
        capacity: S, the most positions the request can reach.
        dtype: buffer dtype (the model's).
        device: buffer device.
        windows: per layer sliding window W, or None for full attention.
        per_query: attend one query at a time after the prompt (see the module docstring).
    """

    def __init__(self, num_layers: int, num_kv_heads: int | Sequence[int], head_dim: int | Sequence[int],
                 capacity: int, dtype: torch.dtype, device: torch.device | str,
                 windows: Sequence[int | None] | None = None, per_query: bool = False) -> None:
        if capacity < 1:
            raise DraftsmithError(f"KV cache capacity must be >= 1, got {capacity}")
        nkv = [num_kv_heads] * num_layers if isinstance(num_kv_heads, int) else list(num_kv_heads)
        hd = [head_dim] * num_layers if isinstance(head_dim, int) else list(head_dim)
        self.windows = list(windows) if windows is not None else [None] * num_layers
        if not len(nkv) == len(hd) == len(self.windows) == num_layers:
            raise DraftsmithError("KV cache: one head count, head dim and window per layer")
        self.keys = [torch.zeros(1, n, capacity, d, dtype=dtype, device=device) for n, d in zip(nkv, hd)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.capacity = capacity
        self.length = 0
        self._static = False
        self.per_query = per_query
        self._cpu_kernel: bool | None = None
        self._eager_kernel: bool | None = None
        self._masks: dict[tuple, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def check_room(self, m: int) -> None:
        """Raise a clear error before a forward of ``m`` positions that would not fit."""
        if self.length + m > self.capacity:
            raise DraftsmithError(
                f"KV cache full: {self.length} cached + {m} new positions > capacity {self.capacity}; "
                "the cache is sized to the request (prompt + max new tokens + draft length)")

    def advance(self, m: int) -> None:
        """Mark the ``m`` positions the last forward wrote as valid."""
        self.check_room(m)
        self.length += m

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions (a rejected draft's entries become free slots)."""
        if not 0 <= length <= self.length:
            raise DraftsmithError(f"cannot roll the KV cache back to {length}: it holds {self.length} positions")
        self.length = length

    def reserve(self, capacity: int) -> None:
        """Grow to at least ``capacity`` positions, keeping the valid ones.

        A copy, so it doubles at the least (amortised); a cache sized to its request never grows.
        """
        if capacity <= self.capacity:
            return
        capacity = max(capacity, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for j, old in enumerate(buffers):
                new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
                new[:, :, : self.length] = old[:, :, : self.length]
                buffers[j] = new
        self.capacity = capacity

    def mark_static_addresses(self) -> None:
        """Tell dynamo the buffers keep their addresses (CUDA graphs then skip re-copying them)."""
        for t in self.keys + self.values:
            torch._dynamo.mark_static_address(t)

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Write layer ``i``'s new keys/values and attend.

        Args:
            i: layer index.
            q: ``[1, nh, m, hd]`` queries (rope applied).
            k: ``[1, nkv, m, hd]`` new keys (rope applied).
            v: ``[1, nkv, m, hd]`` new values.
            pos: ``[m]`` absolute positions of the queries, ``T .. T+m-1``.
            scale: softmax scale.

        Returns:
            ``[1, nh, m, hd]``: causal attention (windowed where the layer has W) over the
            cached and new positions; grouped heads through :func:`gqa_attention`, no repeated K/V.
        """
        K, V = self.keys[i], self.values[i]
        if self.static:
            if self.cpu_kernel:
                self._write_slots(i, k, v, pos)
                W = self.windows[i]
                return cpu_attention.decode_attention(q, K, V, pos, W or 0, scale)
            keep = self.write_static(i, k, v, pos)
            return gqa_attention(q, K, V, keep, scale)
        m = q.shape[2]
        start = self.length
        self.check_room(m)
        K[:, :, start:start + m] = k
        V[:, :, start:start + m] = v
        if self.per_query and m > 1 and start > 0:
            return torch.cat([self._read(i, q[:, :, j:j + 1], start + j, scale) for j in range(m)], 2)
        # (a per-query cache keeps SDPA for its one-token steps too: its verify rows above are SDPA's)
        if self.kernel_step(m, start):
            return cpu_attention.decode_attention(q, K, V, pos, self.windows[i] or 0, scale)
        return self._read(i, q, start, scale)

    def kernel_step(self, m: int, start: int | None = None) -> bool:
        """Whether an eager forward of ``m`` queries from slot ``start`` (None: the cache's length)
        attends through the C++ decode-attention kernel: inside :func:`eager_cpu_attention`, a step
        (at most :data:`EAGER_KERNEL_MAX_ROWS` queries after the prompt, or one), not static, not
        per-query, buffers the kernel reads. (The lean forward's fused layer asks it too.)"""
        start = self.length if start is None else start
        return bool(_eager_kernel and _eager_kernel[-1] and m <= EAGER_KERNEL_MAX_ROWS and (start > 0 or m == 1)
                    and not self.per_query and not self.static and self.eager_kernel)

    def _kernel_fits(self) -> bool:
        """Whether :mod:`~draftsmith.models.cpu_attention`'s kernel can read these buffers (CPU, float32
        or bfloat16) and is built."""
        K = self.keys[0]
        return K.device.type == "cpu" and K.dtype in (torch.float32, torch.bfloat16) and cpu_attention.available()

    @property
    def eager_kernel(self) -> bool:
        """Whether this cache can attend through the C++ kernel in eager mode; resolved on first use
        inside :func:`eager_cpu_attention`."""
        if self._eager_kernel is None:
            self._eager_kernel = self._kernel_fits()
        return self._eager_kernel

    def write_static(self, i: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Static mode's write: layer ``i``'s new keys/values at slots ``pos`` (a tensor, no host read);
        returns the mask ``[m, S]`` of the slots each query attends to (past the query: stale or empty)."""
        K, W = self.keys[i], self.windows[i]
        self._write_slots(i, k, v, pos)
        slots = torch.arange(K.shape[2], device=pos.device)
        keep = slots[None, :] <= pos[:, None]
        if W is not None:
            keep = keep & (slots[None, :] > pos[:, None] - W)
        return keep

    def _write_slots(self, i: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        self.keys[i].index_copy_(2, pos, k)
        self.values[i].index_copy_(2, pos, v)

    @property
    def static(self) -> bool:
        """Static mode (see the module docstring); the compiled steps switch it on around each call."""
        return self._static

    @static.setter
    def static(self, on: bool) -> None:
        if on and self._cpu_kernel is None:  # resolved here, outside the compiled region that reads it
            self.cpu_kernel = True
        self._static = bool(on)

    @property
    def cpu_kernel(self) -> bool:
        """Whether static mode attends through :mod:`~draftsmith.models.cpu_attention`'s kernel (reading
        only the slots each query sees) instead of SDPA over all slots under a mask. Decided when static
        mode is first switched on: True on the CPU with float32/bfloat16 buffers once the kernel is built;
        set it False to keep SDPA (or ``DRAFTSMITH_CPU_ATTENTION=0`` for every cache)."""
        return bool(self._cpu_kernel)

    @cpu_kernel.setter
    def cpu_kernel(self, use: bool) -> None:
        self._cpu_kernel = bool(use) and self._kernel_fits()

    def _mask(self, start: int, end: int, lo: int, W: int | None, q: torch.Tensor) -> torch.Tensor:
        """The additive mask ``[m, end-lo]`` of queries ``[start, end)`` over keys ``[lo, end)``.

        Built once per forward and window (every layer of that kind reads the same one), and
        additive in the queries' dtype: what SDPA turns a boolean mask into on every call.
        """
        key = (start, end, lo, W, q.dtype)
        mask = self._masks.get(key)
        if mask is None:
            if len(self._masks) >= 8:
                self._masks.clear()
            qpos = torch.arange(start, end, device=q.device)[:, None]
            kpos = torch.arange(lo, end, device=q.device)[None, :]
            keep = kpos <= qpos
            if W is not None:
                keep = keep & (kpos > qpos - W)
            mask = self._masks[key] = additive_mask(keep, q.dtype)
        return mask

    def _read(self, i: int, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """Attention of the queries at ``[start, start+m)`` over the cached keys up to them (eager)."""
        K, V, W = self.keys[i], self.values[i], self.windows[i]
        m = q.shape[2]
        end = start + m
        lo = 0 if W is None else max(0, start - W + 1)  # the oldest key any of the m queries sees
        mask, causal = None, False
        if m > 1 and lo == 0 and start == 0 and (W is None or m <= W):
            causal = True  # a prefill: SDPA's own causal mask, nothing to build
        elif m > 1 or (W is not None and end - lo >= W):
            # A one-token step sees all of [lo, end) and needs no mask, but once a window is
            # full transformers passes an all-true mask, and SDPA rounds differently with one:
            # building it keeps the logits bitwise equal to transformers'.
            mask = self._mask(start, end, lo, W, q)
        # a masked one-token step folds its query heads on every device: transformers' masked one-token
        # GQA does, and the lean step rounds as it does
        return gqa_attention(q, K[:, :, lo:end], V[:, :, lo:end], mask, scale, causal=causal,
                             fold=True if m == 1 else None)


class BatchKVCache:
    """Keys and values ``[B, nkv, S, hd]`` per layer for B left-padded sequences decoded together.

    Regeneration's batches (:func:`draftsmith.data.generation.generate_batch`): row b's
    tokens fill slots ``[pad_b, T)``, so every row's next token goes to the same slot T
    and a step writes one slice. Slot s holds row b's position ``s - pad_b``; a query
    attends to the keys at slots ``[pad_b, its own]`` (within a sliding window, counted in
    slots, which is counted in positions); a padding slot's query attends to itself only,
    so it stays finite and nothing reads it. Grouped-query attention folds the query
    heads of one KV head into that head's queries (as transformers' masked one-token
    path does), so no K/V is repeated. Attention reads from the smallest padding on, so
    slots that are padding in every row cost nothing.

    Continuous batching: :meth:`admit` puts a sequence prefilled on its own
    (:class:`KVCache`) into a row whose reply has ended, ending at slot T like the others;
    when T reaches the capacity the slots every row pads are dropped (a shift left), so a
    stream of prompts needs no more than the longest prompt plus the most new tokens.
    :meth:`keep` drops rows (when no prompt is left to refill them).

    Args:
        num_layers, num_kv_heads, head_dim: per layer, as :class:`KVCache`.
        pads: the left padding of each row.
        capacity: S, the longest prompt plus the most new tokens.
        dtype, device: buffer dtype and device.
        windows: per layer sliding window W, or None for full attention.
    """

    def __init__(self, num_layers: int, num_kv_heads: Sequence[int], head_dim: Sequence[int], pads: Sequence[int],
                 capacity: int, dtype: torch.dtype, device: torch.device | str,
                 windows: Sequence[int | None] | None = None) -> None:
        if capacity < 1 or not pads:
            raise DraftsmithError(f"batch KV cache needs rows and capacity >= 1, got {len(pads)} rows, {capacity}")
        B = len(pads)
        self.keys = [torch.zeros(B, n, capacity, d, dtype=dtype, device=device) for n, d in zip(num_kv_heads, head_dim)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.windows = list(windows) if windows is not None else [None] * num_layers
        self.pads = torch.as_tensor(list(pads), dtype=torch.long, device=device)
        self._pads = [int(p) for p in pads]  # the same on the host: decisions without a device sync
        self.capacity = capacity
        self.length = 0
        self.moves = 0  # shifts of the whole cache (admitting a long prompt, compacting)
        self._masks: dict[tuple[int | None, int], torch.Tensor] = {}

    @property
    def batch(self) -> int:
        return int(self.pads.shape[0])

    def begin(self, m: int) -> torch.Tensor:
        """Prepare a forward of the next ``m`` slots; returns the rows' positions ``[B, m]``.

        When the m slots do not fit, the slots that are padding in every row are dropped
        first; if that is not enough, the buffers grow.
        """
        if self.length + m > self.capacity:
            lo = min(self._pads)
            if lo > 0:
                self._move(-lo)
            if self.length + m > self.capacity:
                self._move(0, capacity=self.length + m + max(64, self.capacity // 4))
        T = self.length
        dev = self.pads.device
        self._lo = lo = min(min(self._pads), T)
        slots = torch.arange(lo, T + m, device=dev)[None, None, :]  # [1, 1, T+m-lo]
        qslots = torch.arange(T, T + m, device=dev)[None, :, None]  # [1, m, 1]
        self._base = (slots >= self.pads[:, None, None]) & (slots <= qslots)  # [B, m, T+m-lo]
        self._base |= slots == qslots  # a padding query sees itself only
        self._qslots, self._slots = qslots, slots
        self._masks = {}
        return (torch.arange(T, T + m, device=dev)[None, :] - self.pads[:, None]).clamp_(min=0)

    def _mask(self, window: int | None, rep: int) -> torch.Tensor:
        key = (window, rep)
        if key not in self._masks:
            mask = self._base
            if window is not None:
                mask = mask & (self._slots > self._qslots - window)
            # [B, 1, rep*m, T+m-lo]: the rep query heads of a KV head are queries of that head
            # (one query position: the mask row broadcasts over them)
            mask = mask.repeat(1, rep, 1)[:, None] if rep > 1 and mask.shape[1] > 1 else mask[:, None]
            self._masks[key] = additive_mask(mask, self.keys[0].dtype)
        return self._masks[key]

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Write layer ``i``'s keys/values ``[B, nkv, m, hd]`` at the next m slots; attention ``[B, nh, m, hd]``."""
        K, V = self.keys[i], self.values[i]
        B, nh, m, hd = q.shape
        nkv = K.shape[1]
        T, lo = self.length, self._lo
        K[:, :, T:T + m] = k
        V[:, :, T:T + m] = v
        rep = nh // nkv
        out = F.scaled_dot_product_attention(q.reshape(B, nkv, rep * m, hd), K[:, :, lo:T + m], V[:, :, lo:T + m],
                                             attn_mask=self._mask(self.windows[i], rep), scale=scale)
        return out.view(B, nh, m, hd)

    def advance(self, m: int) -> None:
        """Mark the ``m`` slots the last forward wrote as valid."""
        self.length += m

    def admit(self, row: int, source: KVCache) -> None:
        """Put the ``source.length`` positions of one sequence into ``row``, ending at slot T.

        The row's earlier contents are dropped (its reply has ended). A sequence longer
        than T moves every row right first.
        """
        L = source.length
        if L > self.length:
            self._move(L - self.length, capacity=max(self.capacity, L + 1))
        T = self.length
        for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
            for buf, src in zip(mine, theirs):
                buf[row, :, T - L:T] = src[0, :, :L]
        self.pads[row] = T - L
        self._pads[row] = T - L

    def _move(self, d: int, capacity: int | None = None) -> None:
        """Shift every row's slots by ``d`` (< 0: drop ``-d`` slots that every row pads), optionally resizing."""
        T = self.length
        cap = capacity or self.capacity
        lo = max(0, -d)
        if lo > min(self._pads):
            raise DraftsmithError(f"batch KV cache: cannot drop {lo} slots, a row starts at {min(self._pads)}")
        for buffers in (self.keys, self.values):
            for j, old in enumerate(buffers):
                if cap != self.capacity:
                    new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
                    new[:, :, lo + d:T + d] = old[:, :, lo:T]
                    buffers[j] = new
                elif d:
                    old[:, :, lo + d:T + d] = old[:, :, lo:T].clone()  # the ranges overlap
        self.pads += d
        self._pads = [p + d for p in self._pads]
        self.length = T + d
        self.capacity = cap
        self.moves += 1

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into the current batch), copying their valid slots."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.pads.device)
        T = self.length
        for buffers in (self.keys, self.values):
            for j, old in enumerate(buffers):
                new = old.new_empty(len(rows), old.shape[1], self.capacity, old.shape[3])
                new[:, :, :T] = old[:, :, :T].index_select(0, idx)
                buffers[j] = new
        self.pads = self.pads.index_select(0, idx)
        self._pads = [self._pads[r] for r in rows]
