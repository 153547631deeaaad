"""Where a one-token step's context cost goes (issue 20's "step at 1024 within 10% of 128").

Three measurements on the verifier (SmolLM2-135M float32 by default), side by side in one run:

1. ``steps``: the lean one-token step at each ``--contexts`` length, eager, with attention as the
   engine does it (SDPA with ``enable_gqa``, bitwise transformers' one-token step) and with each
   KV head's query heads folded into one call (``fold``: what transformers does for a masked
   one-token step; rounds differently from the unmasked one), interleaved, medians.
2. ``profile``: torch.profiler's self time per ATen op in a step at the smallest and the
   largest context: what grows with the context.
3. ``read``: the time to read the KV cache's bytes (every layer's K and V, ``sum`` over each,
   after a 400 MB write that evicts them from the caches): the memory floor of attending to
   them, against the step's growth.

    PYTHONPATH=src python benchmarks/context_attention.py --threads 2 --out benchmarks/results/context-attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def folded_read(orig):
    """KVCache._read with the one-token, unmasked, full-attention GQA call folded per KV head."""

    def read(self, i, q, start, scale):
        K, V, W = self.keys[i], self.values[i], self.windows[i]
        if q.shape[2] == 1 and W is None and q.shape[1] != K.shape[1]:
            nh, hd, end = q.shape[1], q.shape[3], start + 1
            out = F.scaled_dot_product_attention(q.reshape(1, K.shape[1], nh // K.shape[1], hd), K[:, :, :end],
                                                 V[:, :, :end], scale=scale)
            return out.reshape(1, nh, 1, hd)
        return orig(self, i, q, start, scale)
    return read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per point")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import draftsmith.models.kv as kv
    from draftsmith.decoding.runner import verifier_runner
    from draftsmith.models.verifier import load_verifier
    from torch.profiler import ProfilerActivity, profile

    model, _, fp = load_verifier(args.verifier, dtype="float32", device="cpu")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    orig = kv.KVCache._read
    variants = {"sdpa": orig, "fold": folded_read(orig)}
    out: dict = {"verifier": f"{args.verifier} ({fp})", "threads": args.threads, "steps": args.steps}
    with torch.inference_mode():
        runners = {}
        for C in args.contexts:
            r = verifier_runner(model, C + 8)
            r.forward(torch.randint(2, V, (C,), generator=g), 1)
            runners[C] = r
        tok = torch.randint(2, V, (1,), generator=g)

        def step(C: int) -> float:
            t0 = time.perf_counter()
            runners[C].forward(tok, 1)
            dt = time.perf_counter() - t0
            runners[C].rollback(C)
            return dt

        keys = [(v, C) for v in variants for C in args.contexts]
        times: dict = {k: [] for k in keys}
        for rep in range(args.steps + 2):  # 2 warm-up passes
            shift = rep % len(keys)
            for v, C in keys[shift:] + keys[:shift]:
                kv.KVCache._read = variants[v]
                dt = step(C)
                if rep >= 2:
                    times[(v, C)].append(dt)
        kv.KVCache._read = orig
        lo, hi = min(args.contexts), max(args.contexts)
        med = {v: {C: 1e3 * statistics.median(times[(v, C)]) for C in args.contexts} for v in variants}
        out["steps_ms"] = med
        out["ratio"] = {v: med[v][hi] / med[v][lo] for v in variants}

        ops = {}
        for C in (lo, hi):
            for _ in range(3):
                step(C)
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(20):
                    step(C)
            ops[C] = {e.key: e.self_cpu_time_total / 20 / 1e3 for e in p.key_averages()}  # ms per step
        grow = sorted(set(ops[lo]) | set(ops[hi]), key=lambda k: ops[lo].get(k, 0) - ops[hi].get(k, 0))[:6]
        out["profile_ms_per_step"] = {k: {str(lo): ops[lo].get(k, 0.0), str(hi): ops[hi].get(k, 0.0)} for k in grow}
        out["profile_total_ms"] = {str(C): sum(ops[C].values()) for C in (lo, hi)}

    flush = torch.empty(100_000_000)
    read = {}
    for C in (lo, hi):
        cache = runners[C].cache  # the lean runner's KVCache: what the step attends to
        tensors = [t[:, :, :C] for t in cache.keys + cache.values]
        ts = []
        for _ in range(15):
            flush.fill_(1.0)
            t0 = time.perf_counter()
            for t in tensors:
                t.sum()
            ts.append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        read[str(C)] = {"bytes": nbytes, "ms": 1e3 * statistics.median(ts)}
    out["read_kv"] = read
    out["target_within_10pct"] = out["ratio"]["sdpa"] <= 1.10
    for v in variants:
        print(f"[steps] {v:5s} " + "  ".join(f"{C}: {ms:.2f} ms" for C, ms in med[v].items())
              + f"  {hi}/{lo} = {out['ratio'][v]:.3f}")
    for k, d in out["profile_ms_per_step"].items():
        print(f"[profile] {k:50s} {d[str(lo)]:.2f} -> {d[str(hi)]:.2f} ms")
    for C, d in read.items():
        print(f"[read] {C}: {d['bytes'] / 1e6:.1f} MB in {d['ms']:.2f} ms")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
