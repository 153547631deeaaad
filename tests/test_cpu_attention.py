"""The CPU decode-attention kernel (models/cpu_attention.py) against SDPA: compiled steps' static caches,
and eager steps' caches inside ``--weight-layout cpp`` (``kv.eager_cpu_attention``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.models import cpu_attention
from draftsmith.models.kv import EAGER_KERNEL_MAX_ROWS, KVCache, eager_cpu_attention


def _reference(q, K, V, pos, window, scale):
    """SDPA in float64 over all slots under the position (and window) mask: what the kernel must give."""
    slots = torch.arange(K.shape[2])
    keep = slots[None, :] <= pos[:, None]
    if window:
        keep &= slots[None, :] > pos[:, None] - window
    return F.scaled_dot_product_attention(q.double(), K.double(), V.double(), attn_mask=keep, scale=scale,
                                          enable_gqa=True)


def _op(q, K, V, pos, window, scale, chunk):
    return torch.ops.draftsmith.decode_attention(q, K, V, pos, window, scale, chunk)


def test_the_kernel_builds_here():
    """On this project's machines the kernel must build: without it compiled CPU steps fall back to SDPA
    (a warning, not an error, for users without a compiler)."""
    assert cpu_attention.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 128), (2, 2, 256), (6, 2, 24)])  # 24: the scalar path
@pytest.mark.parametrize("window", [0, 7])
def test_kernel_equals_sdpa(dtype, heads, window):
    """One and several queries (a decode and a verify step), GQA to MHA, windows, chunks of every size
    (one task per KV head, many, a last one partly filled), at the cache's first, middle and last slots."""
    assert cpu_attention.available()
    nh, nkv, hd = heads
    g = torch.Generator().manual_seed(hd + window)
    S = 90
    K = torch.randn(1, nkv, S, hd, generator=g).to(dtype)
    V = torch.randn(1, nkv, S, hd, generator=g).to(dtype)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    for m, first in [(1, 0), (1, 40), (4, 30), (5, S - 5), (1, S - 1)]:
        q = torch.randn(1, nh, m, hd, generator=g).to(dtype)
        pos = torch.arange(first, first + m)
        want = _reference(q, K, V, pos, window, 0.125)
        for chunk in (1, 7, 16, 33, 256):
            got = _op(q, K, V, pos, window, 0.125, chunk)
            assert got.dtype == dtype and got.shape == q.shape
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        if 0 < first and first + m < S:  # negative control: the same call one position further attends to one more slot
            wrong = _op(q, K, V, pos + 1, window, 0.125, 16)
            assert not torch.allclose(wrong.double(), want, atol=tol, rtol=tol)
    # the public wrapper (its fixed chunk) agrees with the op
    torch.testing.assert_close(cpu_attention.decode_attention(q, K, V, pos, window, 0.125),
                               _op(q, K, V, pos, window, 0.125, cpu_attention.CHUNK))


@pytest.mark.parametrize("window", [0, 6])
def test_kernel_reads_no_slot_outside_the_queries_ranges(window):
    """Slots past the last query's position (empty or stale in a static cache) and before the 16-slot
    block where the first query's window starts are never read: NaN there changes nothing. SDPA over all
    slots would read them. (Within that block the kernel reads K/V of earlier positions of the
    sequence, valid values, and weighs them 0.)"""
    assert cpu_attention.available()
    g = torch.Generator().manual_seed(window)
    nh, nkv, hd, S, m, first = 6, 2, 64, 80, 3, 40
    K, V = torch.randn(1, nkv, S, hd, generator=g), torch.randn(1, nkv, S, hd, generator=g)
    q = torch.randn(1, nh, m, hd, generator=g)
    pos = torch.arange(first, first + m)
    want = _op(q, K, V, pos, window, 0.2, 16)
    Kn, Vn = K.clone(), V.clone()
    lo = (first - window + 1) // 16 * 16 if window else 0
    for t in (Kn, Vn):
        t[:, :, first + m:] = float("nan")
        t[:, :, :lo] = float("nan")
    got = _op(q, Kn, Vn, pos, window, 0.2, 16)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # negative control: a NaN inside the range does show
    Kn[:, :, first] = float("nan")
    assert torch.isnan(_op(q, Kn, Vn, pos, window, 0.2, 16)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (6, 2, 24)])  # 24: the scalar path
@pytest.mark.parametrize("window", [0, 37])
def test_a_querys_result_does_not_depend_on_the_others_in_its_call(dtype, heads, window):
    """Every row of a call of m queries (a verify step) is bitwise the row the query gets alone (a
    one-token step), across chunk borders and windows: the chunks split at absolute slots. With
    chunks split where the call's first slot is (the kernel before), a window's rows were not."""
    nh, nkv, hd = heads
    g = torch.Generator().manual_seed(hd + window)
    S = 700
    K = torch.randn(1, nkv, S, hd, generator=g).to(dtype)
    V = torch.randn(1, nkv, S, hd, generator=g).to(dtype)
    rows = {}
    for first, m in [(0, 1), (250, 9), (300, 16), (505, 12), (S - 7, 7)]:
        q = torch.randn(1, nh, m, hd, generator=g).to(dtype)
        pos = torch.arange(first, first + m)
        together = _op(q, K, V, pos, window, 0.125, 256)
        alone = torch.cat([_op(q[:, :, j:j + 1], K, V, pos[j:j + 1], window, 0.125, 256) for j in range(m)], 2)
        assert torch.equal(together, alone), (first, m)
        rows[first] = (q, pos, together)
    # the control: rows whose slots cross a split (256) summed under another split (100) are not bitwise
    # the same (float32 outputs: bfloat16's rounding of the output can hide the difference)
    q, pos, together = rows[250]
    other = _op(q.float(), K.float(), V.float(), pos, window, 0.125, 100)
    assert not torch.equal(other, _op(q.float(), K.float(), V.float(), pos, window, 0.125, 256))


def test_eager_cache_attends_through_the_kernel_inside_the_block_only(monkeypatch):
    """Inside ``eager_cpu_attention`` an eager decode or verify forward (1..EAGER_KERNEL_MAX_ROWS queries
    after the prompt) attends through the kernel, equal to SDPA within float32 rounding; a prefill,
    longer forwards, and everything outside the block (or inside an inner ``enabled=False``) take SDPA."""
    calls = []
    real = torch.ops.draftsmith.decode_attention

    def spy(*a):
        calls.append(a[0].shape[2])
        return real(*a)

    g = torch.Generator().manual_seed(5)
    caches = {name: KVCache(2, 2, 64, 80, torch.float32, "cpu", [None, 9]) for name in ("kernel", "sdpa")}
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in caches}
    for name, c in caches.items():
        g.manual_seed(5)
        with eager_cpu_attention(name == "kernel"):
            for m in (20, 1, 3, EAGER_KERNEL_MAX_ROWS, EAGER_KERNEL_MAX_ROWS + 1, 1):
                pos = torch.arange(c.length, c.length + m)
                for i in range(2):
                    q = torch.randn(1, 6, m, 64, generator=g)
                    k, v = torch.randn(1, 2, m, 64, generator=g), torch.randn(1, 2, m, 64, generator=g)
                    monkeypatch.setattr(torch.ops.draftsmith, "decode_attention", spy if name == "kernel" else real)
                    outs[name].append(c.attend(i, q, k, v, pos, 0.125))
                c.advance(m)
    assert calls == [1, 1, 3, 3, EAGER_KERNEL_MAX_ROWS, EAGER_KERNEL_MAX_ROWS, 1, 1]  # not the prefill nor 17
    for a, b in zip(outs["kernel"], outs["sdpa"]):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    assert not all(torch.equal(a, b) for a, b in zip(outs["kernel"], outs["sdpa"]))  # the control: another kernel
    c = KVCache(1, 2, 64, 8, torch.float32, "cpu")
    c.attend(0, torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 64), torch.arange(2), 1.0)
    c.advance(2)
    monkeypatch.setattr(torch.ops.draftsmith, "decode_attention", spy)
    with eager_cpu_attention(), eager_cpu_attention(False):  # the inner block decides
        c.attend(0, torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64),
                 torch.tensor([2]), 1.0)
    assert len(calls) == 8
    half = KVCache(1, 2, 64, 8, torch.float16, "cpu")
    assert not half.eager_kernel and c.eager_kernel


def test_kernel_rejects_bad_input():
    assert cpu_attention.available()
    q, K = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 10, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        _op(q, K, K, torch.tensor([10]), 0, 1.0, 16)
    with pytest.raises(RuntimeError, match="pos"):
        _op(q, K, K, torch.tensor([3], dtype=torch.int32), 0, 1.0, 16)
    with pytest.raises(RuntimeError, match="contiguous"):
        _op(q, K.transpose(2, 3).contiguous().transpose(2, 3), K, torch.tensor([3]), 0, 1.0, 16)
    with pytest.raises(RuntimeError, match="GQA"):
        _op(torch.randn(1, 3, 1, 16), K, K, torch.tensor([3]), 0, 1.0, 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _op(q.half(), K.half(), K.half(), torch.tensor([3]), 0, 1.0, 16)


def test_static_cache_picks_the_kernel_on_the_cpu_and_can_keep_sdpa():
    """A CPU cache switched to static mode resolves the kernel once; float16 buffers and an explicit
    ``cpu_kernel = False`` keep SDPA, and both paths give the same attention."""
    assert cpu_attention.available()
    g = torch.Generator().manual_seed(1)
    caches = {name: KVCache(1, 2, 32, 40, torch.float32, "cpu", [None]) for name in ("kernel", "sdpa")}
    caches["sdpa"].cpu_kernel = False
    outs = {}
    for name, c in caches.items():
        g.manual_seed(1)
        k, v = torch.randn(1, 2, 10, 32, generator=g), torch.randn(1, 2, 10, 32, generator=g)
        c.attend(0, torch.randn(1, 4, 10, 32, generator=g), k, v, torch.arange(10), 0.3)
        c.advance(10)
        c.static = True
        outs[name] = c.attend(0, torch.randn(1, 4, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g),
                              torch.randn(1, 2, 1, 32, generator=g), torch.tensor([10]), 0.3)
        c.static = False
    assert caches["kernel"].cpu_kernel and not caches["sdpa"].cpu_kernel
    torch.testing.assert_close(outs["kernel"], outs["sdpa"], atol=1e-6, rtol=1e-6)
    half = KVCache(1, 2, 32, 40, torch.float16, "cpu")
    half.static = True
    assert not half.cpu_kernel


def test_disabled_by_the_environment(monkeypatch):
    """DRAFTSMITH_CPU_ATTENTION=0: not available, so static caches keep SDPA."""
    monkeypatch.setenv("DRAFTSMITH_CPU_ATTENTION", "0")
    cpu_attention._extension.cache_clear()
    try:
        assert not cpu_attention.available()
        c = KVCache(1, 1, 16, 8, torch.float32, "cpu")
        c.static = True
        assert not c.cpu_kernel
    finally:
        monkeypatch.delenv("DRAFTSMITH_CPU_ATTENTION")
        cpu_attention._extension.cache_clear()
    assert cpu_attention.available()
