"""draftsmith's few-row float32 CPU linear (``--weight-layout cpp``): its sums, its batch invariance,
and the module that routes decode and verify steps to it."""

from __future__ import annotations

import pytest
import torch

from draftsmith.models import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no C++ toolchain to build the kernel")


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("K", [1, 15, 16, 17, 33, 576])
@pytest.mark.parametrize("N", [1, 7, 9, 65])
def test_small_linear_is_x_wt_plus_b_for_every_row_count(K, N):
    """Tails of K (lanes of 8 and 16), partial blocks of weight rows, 1 to 8 rows and more (several
    passes of 8), with and without a bias: within float32 rounding of a float64 product."""
    g = torch.Generator().manual_seed(K * 100 + N)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
        x = torch.randn(M, K, generator=g)
        for bias in (b, None):
            got = cpu_linear.small_linear(x, w, bias)
            assert got.shape == (M, N) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), _exact(x, w, bias), atol=1e-5 * K ** 0.5 + 1e-6, rtol=1e-5)


def test_small_linear_rows_are_batch_invariant():
    """A row's result is bitwise the same whether it is computed alone (a one-token step) or among
    others (a verify step), for every row count up to 17 and every row in it."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(193, 577, generator=g), torch.randn(193, generator=g)
    x = torch.randn(17, 577, generator=g)
    alone = torch.cat([cpu_linear.small_linear(x[i:i + 1], w, b) for i in range(17)])
    for M in range(1, 18):
        assert torch.equal(cpu_linear.small_linear(x[:M], w, b), alone[:M]), M
    # the control: a product summed in another order (float64, rounded) is not bitwise the same
    assert not torch.equal(_exact(x, w, b).float(), alone)


def test_small_linear_takes_any_leading_shape_and_strides():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 40, generator=g)
    x = torch.randn(1, 3, 80, generator=g)[..., ::2]  # [1, 3, 40], not contiguous
    got = cpu_linear.small_linear(x, w)
    assert got.shape == (1, 3, 24)
    assert torch.equal(got[0], cpu_linear.small_linear(x[0].contiguous(), w))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.small_linear(x.double(), w.double())
    with pytest.raises(RuntimeError, match="expected"):
        cpu_linear.small_linear(torch.randn(2, 39), w)


def test_cpp_linear_routes_steps_to_the_kernel_and_a_prefill_to_mkl():
    """Inside ``--weight-layout cpp`` a Linear of up to MAX_ROWS rows is the kernel's product
    (bitwise), a longer input (a prefill) and a bfloat16 one are ``F.linear``'s; after the block
    the module is a plain Linear again."""
    from draftsmith.models.verifier import CppLinear, weight_layout

    lin = torch.nn.Linear(64, 48)
    seq = torch.nn.Sequential(lin)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode(), weight_layout(seq, "cpp") as n:
        assert n == 1 and type(lin) is CppLinear
        for M in (1, 3, cpu_linear.MAX_ROWS):
            x = torch.randn(1, M, 64, generator=g)
            assert torch.equal(lin(x), cpu_linear.small_linear(x, lin.weight, lin.bias)), M
        x = torch.randn(1, cpu_linear.MAX_ROWS + 1, 64, generator=g)
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        xb = x[:, :2].bfloat16()
        assert lin.to(torch.bfloat16)(xb).dtype == torch.bfloat16  # other dtypes: F.linear
        lin.float()
    assert type(lin) is torch.nn.Linear


def test_cpp_layout_switches_only_float32_cpu_linears_and_refuses_without_the_kernel(monkeypatch):
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.verifier import weight_layout

    with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4).bfloat16()), "cpp") as n:
        assert n == 0  # nothing float32 to switch
    with pytest.raises(DraftsmithError, match="CPU kernel"):
        with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta")), "cpp"):
            pass
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    with pytest.raises(DraftsmithError, match="could not be built"):
        with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4)), "cpp"):
            pass
    from draftsmith.bench import measure

    assert "cpp" not in measure.layout_candidates(torch.nn.Sequential(torch.nn.Linear(4, 4)))
