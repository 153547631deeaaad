"""How far a calibration-sized window's step prices wander from a bench-sized window's (BENCHMARKS.md 9x).

The bench prices a round before timing from a short calibration (``measure.measure_costs``: 3
passes over the first prompts, 64 tokens each, plain decoding and each drafter), and again after
timing from the rows' own steps (``report._priced_by_rows``). On a shared host the first can miss
the second by 10% while the second matches the measured speedup within 1%. This alternates the
two windows in one compiled process, with no bench around them: blocks like the calibration
(prompts 0-2, ``--calib-tokens``) and blocks like the rows (the next ``--row-prompts`` prompts,
``--row-tokens``), each a plain decode then the drafter at k = 1 per prompt, and prints per block
the trimmed-mean one-token step ``T(1)``, the 2-token verify ``T(2)`` of the rounds, their ratio
(the cost model's verify price at k = 1) and the propose call. A third block, ``paired``, is the
calibration as ``measure_costs`` now takes it: the calibration's prompts and tokens, the drafter
alone with a plain step every ``CALIBRATION_PLAIN_EVERY``-th round, each decode scaled to the
pooled ``T(1)`` of those steps (``costmodel.paired_prices``).

    PYTHONPATH=src python benchmarks/calibration_noise.py --draft DRAFT --draft-precision int8 --threads 2 \\
        --out benchmarks/results/calibration-noise.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="an exported EAGLE-3 draft directory")
    ap.add_argument("--draft-precision", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="pairs of (calibration-like, rows-like) blocks")
    ap.add_argument("--calib-tokens", type=int, default=64)
    ap.add_argument("--row-tokens", type=int, default=128)
    ap.add_argument("--row-prompts", type=int, default=6)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--weight-layout", default="out-in",
                    help="the verifier's and draft's weight layout: out-in (as loaded), in-out, onednn, cpp")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from draftsmith.bench.costmodel import paired_prices, trimmed_mean
    from draftsmith.bench.measure import (CALIBRATION_PLAIN_EVERY, bench_prompts, environment, measure_plain_steps,
                                          time_drafter)
    from draftsmith.drafters import load_draft
    from draftsmith.models.verifier import load_verifier, weight_layouts

    model, tok, fp = load_verifier(args.verifier, dtype="float32", device="cpu")
    prop = load_draft(args.draft, model, args.draft_precision)
    prompts = bench_prompts("mt-bench", tok, 3 + args.row_prompts)[0]
    windows = (("calibration", range(3), args.calib_tokens),
               ("paired", range(3), args.calib_tokens),
               ("rows", range(3, 3 + args.row_prompts), args.row_tokens))
    out = {"command": vars(args) | {"draft": str(args.draft), "out": str(args.out)}, "verifier": fp,
           "cpu": environment().get("cpu_model"), "blocks": []}
    with torch.inference_mode(), weight_layouts([model, prop.draft], args.weight_layout):
        t = time.perf_counter()
        measure_plain_steps(model, prompts[0][1], 16, 0.0, 0, args.compile)
        time_drafter(model, prop, prompts[0][1], 1, 16, 0.0, 0, args.compile)
        out["compile_seconds"] = time.perf_counter() - t
        print(f"compiled in {out['compile_seconds']:.0f} s", flush=True)
        for i in range(args.rounds):
            for name, ps, n in windows:
                t1, t2, calls = [], [], []
                start = time.perf_counter()
                if name == "paired":
                    decodes = [(1, *time_drafter(model, prop, prompts[p][1], 1, n, 0.0, 0, args.compile,
                                                 plain_every=CALIBRATION_PLAIN_EVERY)) for p in ps]
                    scaled_calls, scaled = paired_prices(decodes)
                    t1, t2, calls = scaled.get(1, []), scaled.get(2, []), scaled_calls.get(1, [])
                else:
                    for p in ps:
                        t1 += measure_plain_steps(model, prompts[p][1], n, 0.0, 0, args.compile)
                        c, steps = time_drafter(model, prop, prompts[p][1], 1, n, 0.0, 0, args.compile)
                        t2 += steps.get(2, [])
                        calls += c
                a, b = trimmed_mean(t1), trimmed_mean(t2)
                block = {"round": i, "window": name, "seconds": time.perf_counter() - start, "t1_ms": 1e3 * a,
                         "t2_ms": 1e3 * b, "ratio": b / a, "propose_ms": 1e3 * trimmed_mean(calls),
                         "samples": [len(t1), len(t2)]}
                out["blocks"].append(block)
                print(f"{i} {name:11s} {block['seconds']:5.1f} s  T(1) {block['t1_ms']:.2f} ms  T(2) "
                      f"{block['t2_ms']:.2f} ms  ratio {b / a:.3f}  propose {block['propose_ms']:.2f} ms", flush=True)
    for name, _, _ in windows:
        r = [b["ratio"] for b in out["blocks"] if b["window"] == name]
        out[f"{name}_ratio"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
        print(f"{name}: T(2)/T(1) median {statistics.median(r):.3f}, range {min(r):.3f}-{max(r):.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
