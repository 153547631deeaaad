"""The compiled verify step's cost per token count under each CPU compile tier (BENCHMARKS.md 9q).

On the SPR a compiled verify of 2 / 3 tokens cost 1.18x / 1.50x a one-token step with the
engine's first tier (frozen weights, inductor's C++ GEMM template), 1.06x / 1.16x compiled
without freezing (ATen's GEMMs, i.e. MKL). This measures that, side by side in one process: for
each tier a compiled lean step with graphs per token count (``--static-counts``, default) or one
graph dynamic in it, torch.profiler's total self time per step at ``--context`` cached tokens.
The ``engine`` form is the engine as it is since 9r: its tiers for one token, and for each verify
length the candidate it timed faster (``runner._CompiledStep._choose``); it prints its choice.

    PYTHONPATH=src python benchmarks/verify_tiers.py --threads 2 --out benchmarks/results/verify-tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

TIERS = {
    "cpp": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},  # the engine's first
    "cpp-aten": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
    "frozen": {"freezing": True},
    "aten": {"freezing": False},
    "engine": None,  # the engine as it is: its tiers for one token, verify lengths timed per candidate
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiers", nargs="+", choices=list(TIERS), default=["cpp", "aten", "engine"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--context", type=int, default=117)
    ap.add_argument("--steps", type=int, default=10, help="profiled steps per point")
    ap.add_argument("--static-counts", action=argparse.BooleanOptionalAction, default=True,
                    help="a graph per token count (default) instead of one dynamic in it")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from torch.profiler import ProfilerActivity, profile

    import draftsmith.decoding.runner as runner_mod
    from draftsmith.models.verifier import load_verifier

    if args.static_counts:
        torch._dynamo.mark_dynamic = lambda *a, **k: None  # the step marks a verify's length dynamic
        # and dynamo makes a dimension dynamic by itself the second time its size changes (found in
        # BENCHMARKS 9x: before this line, 9r's "per token count" graphs were dynamic from the 2nd on)
        torch._dynamo.config.automatic_dynamic_shapes = False
    model, _, fp = load_verifier(args.verifier, dtype="float32", device="cpu")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    first_tiers = runner_mod.CPU_COMPILE_TIERS
    out: dict = {"verifier": f"{args.verifier} ({fp})", "threads": args.threads, "context": args.context,
                 "static_counts": args.static_counts, "total_ms": {}}
    with torch.inference_mode():
        for name in args.tiers:
            engine = TIERS[name] is None
            runner_mod.CPU_COMPILE_TIERS = first_tiers if engine else (TIERS[name],) + first_tiers
            # a tier compiles every step (no per-length choice); "engine" chooses as the engine does
            os.environ["DRAFTSMITH_VERIFY_TIER"] = "auto" if engine else "template"
            runner_mod._COMPILED.pop(model, None)  # a compiled step of its own per tier
            r = runner_mod.verifier_runner(model, args.context + 16, compile=True, warmup_shapes=tuple(args.tokens),
                                           role=f"tier-{name}")
            if not engine and r.step.fn.options != TIERS[name]:
                sys.exit(f"tier {name} did not compile (fell back to {r.step.fn.options})")
            if engine:
                out.setdefault("engine_choice", {}).update(r.verify_tiers)
                print("[engine  ] chose: " + ", ".join(f"{m} tok {c['tier']}" for m, c in r.verify_tiers.items()))
            r.forward(torch.randint(2, V, (args.context,), generator=g), 1)
            row = {}
            for m in args.tokens:
                tok = torch.randint(2, V, (m,), generator=g)
                for _ in range(3):
                    r.forward(tok, m)
                    r.rollback(args.context)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(args.steps):
                        r.forward(tok, m)
                        r.rollback(args.context)
                row[m] = sum(e.self_cpu_time_total for e in prof.key_averages()) / args.steps / 1e3
            out["total_ms"][name] = row
            print(f"[{name:8s}] " + "  ".join(f"{m} tok: {ms:.2f} ms ({ms / row[args.tokens[0]]:.2f}x)"
                                             for m, ms in row.items()), flush=True)
    runner_mod.CPU_COMPILE_TIERS = first_tiers
    os.environ.pop("DRAFTSMITH_VERIFY_TIER", None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
