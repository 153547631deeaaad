"""Few-row Linear on the CPU: a C++ kernel as a custom op (``--weight-layout cpp``), float32 or bfloat16
weights (:func:`small_linear`) or an int8 draft's (:func:`small_linear_i8`), and the draft's RMSNorm
(:func:`rms_norm`).

An eager decode step multiplies one row (a verify step k + 1 rows) by each weight, and costs
what reading the weights costs. MKL's float32 GEMM and oneDNN's matmul are made for many rows:
on the AMD EPYC of BENCHMARKS.md (15g) the 211 GEMMs of a SmolLM2-135M step took 47 ms through
MKL and 29 ms through oneDNN at one row, and 1.6x / 1.1x that at two. :func:`small_linear` reads
each weight once for all rows (blocks of 8 weight rows per thread, prefetched, times tiles of 2
input rows; ``cpu_linear.cpp``): 21 ms at one or two rows there. Its rows are
batch-invariant: a row of a verify step is bitwise the row a one-token step computes for the
same input.

The extension is built on first use (:func:`draftsmith.models.cpp_ops.build`, ~25 s once, cached
by torch); where it cannot be built, :func:`available` is False (one warning) and the layout is
not offered. Eager only: compiled steps multiply with inductor's own kernels (on the SPR this
kernel lost to inductor's GEMM template there: BENCHMARKS.md 9t).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from draftsmith.models import cpp_ops

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_linear.cpp")
#: Rows up to which :func:`small_linear` is the kernel (a verify step of up to 15 drafted tokens):
#: on the EPYC of BENCHMARKS.md 15g it beat oneDNN and MKL at every count measured up to 16 (16 rows:
#: 44 / 50 / 71 ms for a SmolLM2-135M step's GEMMs); longer inputs (a prefill) take MKL's GEMM.
MAX_ROWS = 16


_BUILT = False  # the extension is loaded in this process (argmax asks, without building it)


@functools.lru_cache(maxsize=None)
def _op():
    """``torch.ops.draftsmith.small_linear`` once built, or None (with one warning) where it cannot be."""
    global _BUILT
    try:
        cpp_ops.build(_SOURCE, "draftsmith_cpu_linear")
        _BUILT = True
        return torch.ops.draftsmith.small_linear
    except Exception as e:  # no compiler, no ninja, a build error: the other layouts still work
        log.warning("the CPU few-row linear kernel could not be built (%s); --weight-layout cpp is not available",
                    str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
        return None


def available() -> bool:
    """Whether the kernel is built (building it now if not yet)."""
    return _op() is not None


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for float32 CPU tensors ``x [..., K]``, ``weight [N, K]``, ``bias [N]``, or
    bfloat16 ones (the weights widened in registers, the sums in float32, the result rounded to
    bfloat16 to nearest even: half the bytes a step reads; rows batch-invariant the same way).

    :func:`available` must have returned True. Any number of rows is accepted; callers send at
    most :data:`MAX_ROWS`.
    """
    return torch.ops.draftsmith.small_linear(x, weight, bias)


def small_linear_i8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ qweight.T) * scale + bias`` for float32 ``x [..., K]``, int8 ``qweight [N, K]`` and float32
    ``scale [N]``, ``bias [N]`` (CPU): the int8 weights widened to float32 in registers, the sums in
    float32 (W8A32), rows batch-invariant as in :func:`small_linear`. A bfloat16 ``x`` (and ``bias``)
    is widened once and the result rounded to bfloat16 (W8A16). :func:`available` must have returned
    True."""
    return torch.ops.draftsmith.small_linear_i8(x, qweight, scale, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))`` for float32 CPU ``x [..., H]``, ``weight [H]``, in one
    call (an EAGLE-3 draft's :class:`~draftsmith.models.eagle3.RMSNorm` in the cpp layout): equal to
    ``F.rms_norm`` within float32 rounding, each row independent of the others. For bfloat16 ``x`` and
    ``weight``, computed in float32 and rounded as the module rounds: ``bf16(weight * bf16(x / rms))``."""
    return torch.ops.draftsmith.rms_norm(x, weight, eps)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the same indices (first of the largest; a NaN counts as the largest), through the
    extension's ``argmax_rows`` for a float32 or bfloat16 CPU tensor once the extension is loaded (the
    cpp layout loads it; this never builds it): ATen's reduction took 178 us for a bfloat16 row of
    SmolLM2's 49152 logits on the EPYC, 43 us in float32 (BENCHMARKS.md 15p). Elsewhere ATen's."""
    if _BUILT and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() >= 1 \
            and x.shape[-1] > 0 and not torch.compiler.is_compiling():
        return torch.ops.draftsmith.argmax_rows(x)
    return x.argmax(-1)
