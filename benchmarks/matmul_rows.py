"""Verify-cost step on CPU: time of the verifier's matmuls for M = 1..N rows (float32 or bfloat16).

`draftsmith bench` measures T_verify(k+1) of SmolLM2-135M stepping up between 3 and 4
tokens (BENCHMARKS.md section 4). This times the bare matmuls of that model's shapes
(lm_head [M, 576] x [576, 49152]; MLP [M, 576] x [576, 1536] and [M, 1536] x [1536, 576])
for M = 1..N, interleaved per repeat, medians reported.

    PYTHONPATH=src python benchmarks/matmul_rows.py --max-rows 6 --out benchmarks/results/matmul-rows.json
    PYTHONPATH=src python benchmarks/matmul_rows.py --max-rows 16 --dtype float32 bfloat16 \
        --out benchmarks/results/matmul-rows-bf16.json

``--layouts`` compares ways to hold the same weight values (the results then differ by rounding
from one layout to another, so a layout is a choice for both paths that must agree):

- ``view``: ``F.linear(x, W)`` on the ``[out, in]`` weight as transformers keeps it (the GEMM
  reads ``W.t()``, a transposed view);
- ``contiguous``: ``x @ Wt`` with ``Wt = W.t().contiguous()``, the weight stored ``[in, out]``
  (what ``weight.data = W.t().contiguous().t()`` would give every caller, transformers included);
- ``packed``: MKL's packed GEMM (``torch.ops.mkl._mkl_linear``), packed once per row count M;
  its buffer's size is reported (float32 only; held beside the weight);
- ``onednn``: oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the path torch's own
  bfloat16 linear takes) on the ``[out, in]`` weight; ``onednn-packed``: the weight reordered once
  into oneDNN's blocked layout (held instead of the weight, so the same bytes). Float32 through
  oneDNN is not MKL's rounding: on CPUs where MKL's small-M GEMM is slow (the AMD EPYC measured
  in BENCHMARKS.md), this is the alternative kernel for the same values.

``--full-step`` times all 211 GEMMs of a SmolLM2 step as one group: 538 MB of float32 weights
stream from memory as in decoding, which the single shapes (a few MB, cache-resident) do not show::

    PYTHONPATH=src python benchmarks/matmul_rows.py --full-step --rows 1 2 3 4 5 6 8 \
        --layouts view contiguous packed --repeats 10 --out benchmarks/results/matmul-rows-layouts.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


#: SmolLM2-135M's linear layers (out, in): 30 decoder layers of q, k, v, o, gate, up, down, then the lm_head.
STEP_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 \
    + [(49152, 576)]


def layout_call(layout: str, x: torch.Tensor, w: torch.Tensor, m: int):
    """A zero-argument call computing ``x W^T`` with ``w`` held in ``layout``; and the bytes it holds."""
    if layout == "view":
        return (lambda: F.linear(x, w)), w.numel() * w.element_size()
    if layout == "contiguous":
        wt = w.t().contiguous()
        return (lambda: torch.mm(x, wt)), wt.numel() * wt.element_size()
    if layout == "onednn":  # oneDNN's matmul (the kernel torch uses for bfloat16) on the same [out, in] weight
        return (lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")), w.numel() * w.element_size()
    if layout == "onednn-packed":  # the weight reordered once into oneDNN's blocked layout (held instead of W)
        blocked = torch.ops.mkldnn._reorder_linear_weight(w, m)
        return (lambda: torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")), w.numel() * w.element_size()
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)  # MKL's packed sgemm, one pack per M
    return (lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, m)), packed.numel() * packed.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-rows", type=int, default=6)
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="row counts to time (default 1..--max-rows)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--layouts", nargs="+", default=["view"], choices=["view", "contiguous", "packed", "onednn", "onednn-packed"])
    ap.add_argument("--full-step", action="store_true",
                    help="time all 211 GEMMs of a SmolLM2 step together (weights stream from memory, as in "
                         "decoding) instead of the lm_head and MLP shapes one by one")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    if args.full_step:
        base = {"step": [torch.randn(o, i, generator=g) for o, i in STEP_SHAPES]}
    else:
        base = {"lm_head": [torch.randn(49152, 576, generator=g)], "mlp_up": [torch.randn(1536, 576, generator=g)],
                "mlp_down": [torch.randn(576, 1536, generator=g)]}
    row_counts = args.rows or list(range(1, args.max_rows + 1))
    calls = {}  # (matmul, dtype, rows, layout) -> a zero-argument call over the group's weights
    held: dict[tuple[str, str, str], float] = {}  # bytes a layout holds / the weights' bytes
    for dt in args.dtype:
        for name, ws in base.items():
            ws = [w.to(getattr(torch, dt)) for w in ws]
            for m in row_counts:
                xs = {k: torch.randn(m, k, generator=g).to(ws[0].dtype) for k in {w.shape[1] for w in ws}}
                for layout in args.layouts:
                    if layout == "packed" and dt != "float32":
                        continue
                    parts = [layout_call(layout, xs[w.shape[1]], w, m) for w in ws]
                    fns = [f for f, _ in parts]
                    calls[(name, dt, m, layout)] = lambda fns=fns: [f() for f in fns]
                    held[(name, dt, layout)] = sum(b for _, b in parts) / sum(w.numel() * w.element_size() for w in ws)
    times: dict[tuple, list[float]] = {key: [] for key in calls}
    with torch.inference_mode():
        for fn in calls.values():  # warm-up
            fn()
        for _ in range(args.repeats):
            for key, fn in calls.items():  # every layout and M interleaved per repeat
                t = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t)
    rows = [{"matmul": name, "dtype": dt, "rows": m, "layout": layout, "median_ms": 1e3 * statistics.median(ts)}
            for (name, dt, m, layout), ts in times.items()]
    pack_ratio = {f"{n} {d} {lay}": round(v, 2) for (n, d, lay), v in held.items()}
    for (name, dt, layout), ratio in held.items():
        mine = [r for r in rows if (r["matmul"], r["dtype"], r["layout"]) == (name, dt, layout)]
        print(f"{name:9s} {dt:8s} {layout:10s} (holds {ratio:.2f}x the weight bytes)",
              "  ".join(f"M={r['rows']}: {r['median_ms']:.3f}" for r in mine), "ms")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "benchmarks/matmul_rows.py", "args": vars(args) | {"out": str(args.out)},
                                        "results": rows, "bytes_held_over_weights": pack_ratio, "torch": torch.__version__, "threads": args.threads,
                                        "machine": platform.processor() or platform.machine()}, indent=2))


if __name__ == "__main__":
    main()
