"""Verify-cost step on CPU: time of the verifier's matmuls for M = 1..N rows (float32 or bfloat16).

`draftsmith bench` measures T_verify(k+1) of SmolLM2-135M stepping up between 3 and 4
tokens (BENCHMARKS.md section 4). This times the bare matmuls of that model's shapes
(lm_head [M, 576] x [576, 49152]; MLP [M, 576] x [576, 1536] and [M, 1536] x [1536, 576])
for M = 1..N, interleaved per repeat, medians reported.

    PYTHONPATH=src python benchmarks/matmul_rows.py --max-rows 6 --out benchmarks/results/matmul-rows.json
    PYTHONPATH=src python benchmarks/matmul_rows.py --max-rows 16 --dtype float32 bfloat16 \
        --out benchmarks/results/matmul-rows-bf16.json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-rows", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    base = {"lm_head": torch.randn(49152, 576, generator=g), "mlp_up": torch.randn(1536, 576, generator=g),
            "mlp_down": torch.randn(576, 1536, generator=g)}
    weights = {(name, dt): w.to(getattr(torch, dt)) for dt in args.dtype for name, w in base.items()}
    inputs = {(name, dt, m): torch.randn(m, w.shape[1], generator=g).to(w.dtype) for (name, dt), w in weights.items()
              for m in range(1, args.max_rows + 1)}
    times: dict[tuple[str, str, int], list[float]] = {key: [] for key in inputs}
    for key, x in inputs.items():  # warm-up
        F.linear(x, weights[key[:2]])
    for _ in range(args.repeats):
        for key, x in inputs.items():
            t = time.perf_counter()
            F.linear(x, weights[key[:2]])
            times[key].append(time.perf_counter() - t)
    rows = [{"matmul": name, "dtype": dt, "rows": m, "median_ms": 1e3 * statistics.median(ts)}
            for (name, dt, m), ts in times.items()]
    for name, dt in weights:
        print(f"{name:9s} {dt:8s}", "  ".join(f"M={r['rows']}: {r['median_ms']:.3f} ms" for r in rows
                                            if (r["matmul"], r["dtype"]) == (name, dt)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "benchmarks/matmul_rows.py", "args": vars(args) | {"out": str(args.out)},
                                        "results": rows, "torch": torch.__version__, "threads": args.threads,
                                        "machine": platform.processor() or platform.machine()}, indent=2))


if __name__ == "__main__":
    main()
