"""The data step's kernels side by side: a regeneration decode step and a capture-sized prefill,
in float32 (MKL, and oneDNN on the same weights) and bfloat16, on the packaged SmolLM2-135M.

What ``data.dtype auto`` (``utils.cpu_fast_bf16``) decides rests on this: on a CPU with AMX or
AVX-512 BF16, bfloat16 is faster than float32; without either, far slower. Each point is the
median of the timed steps; the configurations alternate over ``--passes`` and the median over
the passes is reported. Compare ratios within one run only.

    PYTHONPATH=src python benchmarks/data_step.py --threads 2 --batch 16 32 \\
        --out benchmarks/results/data-step-amd.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

CONFIGS = {"float32": ("float32", "out-in"), "float32-onednn": ("float32", "onednn"),
           "bfloat16": ("bfloat16", "out-in")}


def decode_step(model: torch.nn.Module, batch: int, context: int, reps: int) -> float:
    """Median seconds of one batched lean decode step (regeneration's) at ``context`` cached tokens."""
    from draftsmith.models.lean import LeanDecoder

    dec = LeanDecoder(model)
    cache = dec.new_batch_cache([0] * batch, context + reps + 4)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        dec.forward_batch(torch.randint(5, 1000, (batch, context), generator=g), cache)
        times = []
        for _ in range(reps + 2):
            ids = torch.randint(5, 1000, (batch, 1), generator=g)
            t0 = time.perf_counter()
            dec.forward_batch(ids, cache)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def prefill(model: torch.nn.Module, tokens: int, reps: int) -> float:
    """Fastest of ``reps`` one-sequence forwards over ``tokens`` tokens (capture's shape)."""
    ids = torch.randint(5, 1000, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    from draftsmith.bench.measure import environment
    from draftsmith.models.verifier import load_verifier, weight_layout
    from draftsmith.utils import cpu_fast_bf16, cpu_has_amx

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--context", type=int, default=200, help="cached tokens per row before the timed steps")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10, help="timed decode steps per point")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {dt: load_verifier("smollm2-135m", dtype=dt, device="cpu").model
              for dt in {CONFIGS[c][0] for c in args.configs}}
    seen: dict[str, dict[str, list[float]]] = {c: {} for c in args.configs}
    for p in range(args.passes):
        for c in args.configs[p % len(args.configs):] + args.configs[:p % len(args.configs)]:
            dtype, layout = CONFIGS[c]
            with weight_layout(models[dtype], layout):
                for b in args.batch:
                    seen[c].setdefault(f"decode_b{b}", []).append(decode_step(models[dtype], b, args.context,
                                                                              args.repeats))
                seen[c].setdefault("prefill", []).append(prefill(models[dtype], args.prefill_tokens, 3))
    med = {c: {k: statistics.median(v) for k, v in d.items()} for c, d in seen.items()}
    out = {"environment": environment(), "amx": cpu_has_amx(), "fast_bf16": cpu_fast_bf16(),
           "args": {k: str(v) for k, v in vars(args).items()}, "seconds": med}
    base = med.get("float32")
    for c, d in med.items():
        parts = [f"decode batch {k[8:]}: {1e3 * s:.1f} ms ({int(k[8:]) / s:.0f} tok/s)"
                 for k, s in d.items() if k.startswith("decode")]
        parts.append(f"prefill {args.prefill_tokens}: {1e3 * d['prefill']:.0f} ms")
        speed = (" | float32 / this: " + ", ".join(f"{base[k] / s:.2f}x" for k, s in d.items())) if base else ""
        print(f"{c:15s} " + "; ".join(parts) + speed)
    print(f"AMX {out['amx']}, fast bfloat16 {out['fast_bf16']} (data.dtype auto: "
          f"{'bfloat16' if out['fast_bf16'] else 'float32'})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
