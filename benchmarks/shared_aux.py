"""What sharing the drafts' aux-output graphs saves a compiled bench, and what it costs a plain step.

``runner.shared_aux_outputs`` (``draftsmith bench --compile`` applies it with its EAGLE-3 drafts' aux
layers; ``DRAFTSMITH_SHARE_AUX=0`` turns it off) lets the verifier's compiled steps that ask for no aux
hidden states (the plain rows, the step table, an n-gram drafter's verify) run the graphs compiled for
the drafts, dropping the three hidden states they also return, instead of compiling graphs of their own.
Two sections:

1. ``step`` (one process): the verifier's compiled one-token step with its own graph (no aux outputs)
   and through the shared graph (aux outputs computed, dropped), at ``--context`` cached tokens,
   interleaved A B B A per repeat so drift hits both; median ms and their ratio; and a plain
   ``generate`` decode each way, whose tokens must be identical.
2. ``bench`` (fresh processes, in the order ``--order``; A: shared, B: ``DRAFTSMITH_SHARE_AUX=0``):
   ``draftsmith bench --compile`` of a random EAGLE-3 draft (exported once) at both precisions and
   k = 1 2, as BENCHMARKS 15d's bench of the memos; the report's compile seconds (the calibration's
   and every row's) and the wall time of the whole command; every row's output identical to the plain
   row's, in every run (the report's ``identical_prompts``).

    PYTHONPATH=src python benchmarks/shared_aux.py --out benchmarks/results/shared-aux-epyc.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lean_engine import add_random_draft_args, eagle3_draft  # noqa: E402

ARMS = {"A": "1", "B": "0"}  # arm -> DRAFTSMITH_SHARE_AUX


def section_step(args, out: dict) -> None:
    from draftsmith.data.sources import eval_set
    from draftsmith.decoding.engine import generate
    from draftsmith.decoding.runner import shared_aux_outputs, verifier_runner
    from draftsmith.models.verifier import load_verifier

    model, tok, _ = load_verifier(args.verifier, dtype="float32", device="cpu")
    aux = tuple(eagle3_draft(model, args.draft_vocab).config.aux_layer_ids)
    prompt = eval_set("mt-bench", tok, limit=1)[0][1]
    context = (prompt * (args.context // len(prompt) + 1))[:args.context]
    cap = args.context + 2
    arms: dict[str, object] = {}
    tokens: dict[str, list[int]] = {}
    t = time.perf_counter()
    with torch.inference_mode():
        arms["own"] = verifier_runner(model, cap, compile=True, warmup_shapes=(1,), role="own")
        tokens["own"] = generate(model, prompt, max_new_tokens=args.max_new_tokens, eos_token_id=[],
                                 compile=True).token_ids
        with shared_aux_outputs(model, aux):
            arms["shared"] = verifier_runner(model, cap, compile=True, warmup_shapes=(1,), role="shared")
            tokens["shared"] = generate(model, prompt, max_new_tokens=args.max_new_tokens, eos_token_id=[],
                                        compile=True).token_ids
        compile_s = time.perf_counter() - t
        ctx = torch.tensor(context)
        nxt = torch.tensor(prompt[:1])
        for r in arms.values():
            r.forward(ctx, 1)
        ms: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(args.warmup + args.repeats):
            for name in ("own", "shared", "shared", "own") if rep % 2 == 0 else ("shared", "own", "own", "shared"):
                r = arms[name]
                t0 = time.perf_counter()
                logits, hidden = r.forward(nxt, 1)
                float(logits[0, 0])
                dt = time.perf_counter() - t0
                r.rollback(args.context)
                assert hidden is None
                if rep >= args.warmup:
                    ms[name].append(1e3 * dt)
    med = {name: statistics.median(v) for name, v in ms.items()}
    out["step"] = {"aux_layer_ids": list(aux), "context": args.context, "median_ms": med,
                   "shared_over_own": med["shared"] / med["own"], "samples": len(ms["own"]),
                   "iqr_ms": {n: statistics.quantiles(v, n=4)[::2] for n, v in ms.items()},
                   "tokens_identical": tokens["own"] == tokens["shared"], "compile_and_decode_seconds": compile_s}
    print(f"one-token step at {args.context} cached: own graph {med['own']:.2f} ms, shared aux graph "
          f"{med['shared']:.2f} ms: {med['shared'] / med['own']:.4f}; plain tokens identical: "
          f"{tokens['own'] == tokens['shared']}", file=sys.stderr)


def section_bench(args, out: dict) -> None:
    from draftsmith.export import save_draft
    from draftsmith.models.verifier import load_verifier

    runs = []
    with tempfile.TemporaryDirectory(prefix="shared-aux-") as tmp:
        model, _, _ = load_verifier(args.verifier, dtype="float32", device="cpu")
        draft = eagle3_draft(model, args.draft_vocab)
        draft.set_vocab(torch.arange(args.draft_vocab))
        save_draft(draft, Path(tmp) / "draft", verifier_name=args.verifier, verifier=model)
        del model
        for i, arm in enumerate(args.order):
            dest = Path(tmp) / f"run{i}{arm}"
            cmd = [sys.executable, "-m", "draftsmith.cli", "bench", "--verifier", args.verifier, "--draft",
                   str(Path(tmp) / "draft"), "--dataset", "mt-bench", "--num-prompts", str(args.bench_prompts),
                   "--max-new-tokens", str(args.bench_tokens), "--num-draft-tokens", "1", "2", "--compile",
                   "--draft-precision", "as-loaded", "int8", "--threads", str(args.threads), "--no-progress",
                   "--out", str(dest)]
            t = time.perf_counter()
            subprocess.run(cmd, env=dict(os.environ, DRAFTSMITH_SHARE_AUX=ARMS[arm]), check=True,
                           stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t
            rep = json.loads((dest / "report.json").read_text())
            rows = {r["name"]: r.get("compile_seconds", 0.0) for r in rep["rows"]}
            runs.append({"arm": arm, "wall_seconds": wall, "costs_compile_seconds": rep["costs"]["compile_seconds"],
                         "rows_compile_seconds": rows,
                         "compile_seconds": rep["costs"]["compile_seconds"] + sum(rows.values()),
                         "identical_prompts": {r["name"]: r["identical_prompts"] for r in rep["rows"]
                                               if r["identical_output_rate"] is not None},
                         "all_identical": all(r["identical_output_rate"] in (None, 1.0) for r in rep["rows"])})
            print(f"[{i}{arm}] compile {runs[-1]['compile_seconds']:.1f} s, wall {wall:.1f} s", file=sys.stderr)
    summary = {arm: {k: statistics.median(r[k] for r in runs if r["arm"] == arm)
                     for k in ("compile_seconds", "wall_seconds")} for arm in dict.fromkeys(args.order)}
    out["bench"] = {"runs": runs, "median": summary, "identical": all(r["all_identical"] for r in runs)}
    if len(summary) == 2:
        out["bench"]["A_over_B"] = {k: summary["A"][k] / summary["B"][k] for k in summary["A"]}
    print(json.dumps({k: v for k, v in out["bench"].items() if k != "runs"}, indent=1), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_random_draft_args(ap, max_new_tokens=32)
    ap.add_argument("--sections", nargs="+", default=["step", "bench"], choices=["step", "bench"])
    ap.add_argument("--context", type=int, default=512, help="cached tokens for the step timing")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--order", default="ABBA", help="bench runs in this order; A: shared (DRAFTSMITH_SHARE_AUX=1), "
                    "B: own graphs (0)")
    ap.add_argument("--bench-prompts", type=int, default=2)
    ap.add_argument("--bench-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if set(args.order) - set(ARMS):
        ap.error(f"--order: letters of {''.join(ARMS)}")
    torch.set_num_threads(args.threads)
    out: dict = {"verifier": args.verifier, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
                 "load_avg": os.getloadavg(), "args": {a: str(v) for a, v in vars(args).items()}}
    if "step" in args.sections:
        section_step(args, out)
    if "bench" in args.sections:
        section_bench(args, out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
