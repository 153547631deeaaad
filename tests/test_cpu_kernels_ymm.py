"""The C++ kernels' ymm-register forms (AVX2 builds without AVX-512, ``cpu_vec.h``'s
DRAFTSMITH_YMM_FORMS) against the 16-float vector forms they replace there: both forms built here for
AVX2 (an AVX-512 CPU runs AVX2 code too), each under its own op namespace, give bitwise the same
outputs (BENCHMARKS.md 15q). Up to four builds of ~30-60 s each (two on an AVX2 CPU, whose own build is
the ymm forms): marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftsmith.models import cpp_ops, cpu_attention, cpu_linear

pytestmark = pytest.mark.slow

AVX2_FLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-mavx2", "-mfma", "-mf16c"]


def _build(source: Path, ns: str, extra: list[str]) -> None:
    """``source`` built for AVX2 (even where the compiler defaults higher; plus ``extra`` flags) with its ops
    registered under ``ns``."""
    cpp_ops.build_as(source, ns, AVX2_FLAGS + ["-mno-avx512f"] + extra)


@pytest.fixture(scope="module")
def forms():
    """{"ymm": ops namespace, "v16f": ops namespace} for the linear kernel and for the attention."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("needs an x86 CPU with AVX2")
    if not (cpu_linear.available() and cpu_attention.available()):
        pytest.skip("the C++ extensions cannot be built here")
    out = {}
    for form, extra in (("ymm", ["-DDRAFTSMITH_EXPECT_YMM"]), ("v16f", ["-DDRAFTSMITH_V16F_ONLY"])):
        if form == "ymm" and torch.backends.cpu.get_cpu_capability() == "AVX2":
            # an AVX2 CPU's own build has these flags (cpp_ops.ISA_FLAGS): its ops are the ymm forms
            assert cpp_ops.flags() == AVX2_FLAGS
            out[form] = (torch.ops.draftsmith, torch.ops.draftsmith)
            continue
        _build(cpu_linear._SOURCE, f"ds_lin_{form}", extra)
        _build(cpu_attention._SOURCE, f"ds_att_{form}", extra)
        out[form] = (getattr(torch.ops, f"ds_lin_{form}"), getattr(torch.ops, f"ds_att_{form}"))
    return out


@pytest.mark.parametrize("K", [576, 1536, 100, 7])
@pytest.mark.parametrize("N", [576, 13, 5])
def test_linear_ymm_form_is_bitwise_the_vector_form(forms, K, N):
    (ymm, _), (vec, _) = forms["ymm"], forms["v16f"]
    g = torch.Generator().manual_seed(K * 1000 + N)
    for m in (1, 2, 3, 5):
        x = torch.randn(m, K, generator=g)
        w = torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g)
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        s = torch.rand(N, generator=g) / 100
        calls = {
            "float32": lambda op: op.small_linear(x, w, b),
            "bfloat16": lambda op: op.small_linear(x.bfloat16(), w.bfloat16(), b.bfloat16()),
            "int8": lambda op: op.small_linear_i8(x, q, s, b),
            "int8, bfloat16 x": lambda op: op.small_linear_i8(x.bfloat16(), q, s, None),
        }
        for name, call in calls.items():
            got, want = call(ymm), call(vec)
            assert torch.equal(got, want), (name, m)
        # and both are the product (not two forms wrong alike)
        torch.testing.assert_close(ymm.small_linear(x, w, b), x @ w.t() + b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd,nh,nkv", [(64, 9, 3), (128, 8, 8), (64, 16, 2)])
def test_attention_ymm_form_is_bitwise_the_vector_form(forms, dtype, hd, nh, nkv):
    (_, ymm), (_, vec) = forms["ymm"], forms["v16f"]
    g = torch.Generator().manual_seed(hd + nh)
    for S, m, window in ((37, 1, 0), (300, 3, 0), (1100, 1, 0), (1100, 6, 100)):
        q = torch.randn(1, nh, m, hd, generator=g).to(dtype)
        K = torch.randn(1, nkv, S + 8, hd, generator=g).to(dtype)
        V = torch.randn(1, nkv, S + 8, hd, generator=g).to(dtype)
        pos = torch.arange(S - m, S)
        got = ymm.decode_attention(q, K, V, pos, window, hd ** -0.5, 256)
        assert torch.equal(got, vec.decode_attention(q, K, V, pos, window, hd ** -0.5, 256)), (S, m, window)
        if S > 256 and window == 0 and dtype == torch.float32:  # the control: a change of summation order
            # (other chunks) shows in float32 outputs (bfloat16's rounding of the output can hide it)
            assert not torch.equal(got, ymm.decode_attention(q, K, V, pos, window, hd ** -0.5, 64))
