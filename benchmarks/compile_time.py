"""Compile time of the compiled CPU engine, with inductor's GEMM template texts parsed once or per use.

``decoding/kernel_templates.cache_kernel_templates`` memoizes inductor's ``KernelTemplate.
_template_from_string`` and ``parse_expr_with_index_symbols`` (``DRAFTSMITH_TEMPLATE_CACHE=1``, the
default); ``0`` leaves inductor parsing the same jinja2 sources and index texts for every GEMM it renders. Each run is a fresh process (the
cache, and dynamo's compiled graphs, are process-wide) that loads the verifier (float32) and a random
EAGLE-3 draft of its shape (``--draft-vocab``, ``--draft-precision``) and compiles, reporting each
stage's compile seconds (``generate``'s ``stats["compile_seconds"]``) and wall seconds:

1. ``eagle3``: ``generate(compile=True)`` with the draft at k = ``--num-draft-tokens`` on one MT-Bench
   prompt: the verifier's one-token step with the draft's aux layers, its verify candidates, the
   draft's steps;
2. ``plain``: the same prompt without the draft: the verifier's steps without aux outputs.

Runs go in the order ``--order`` gives (``ABBA`` by default: drift over the run hits both arms alike);
``--cold`` gives each run an empty inductor cache directory of its own (the C++ kernels built from
source, as on a machine's first compile), otherwise every run shares the machine's (kernels already
built load from it; frozen graphs themselves are never cached: ``runner.FROZEN_UNCACHED``). The
arms' tokens must be identical.

    PYTHONPATH=src python benchmarks/compile_time.py --out benchmarks/results/compile-time-epyc.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lean_engine import add_random_draft_args, random_draft_proposer  # noqa: E402

ARMS = {"A": "1", "B": "0"}  # arm -> DRAFTSMITH_TEMPLATE_CACHE


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)

    from draftsmith.data.sources import eval_set
    from draftsmith.decoding.engine import generate
    from draftsmith.decoding.kernel_templates import template_cache_info
    from draftsmith.models.verifier import load_verifier

    model, tok, _ = load_verifier(args.verifier, dtype="float32", device="cpu")
    proposer = random_draft_proposer(model, args.draft_vocab, args.draft_precision)
    prompt = eval_set("mt-bench", tok, limit=1)[0][1]
    stages, tokens = {}, {}
    with torch.inference_mode():
        for name, drafter in (("eagle3", proposer), ("plain", None))[:args.stages]:
            t = time.perf_counter()
            r = generate(model, prompt, proposer=drafter, max_new_tokens=args.max_new_tokens,
                         num_draft_tokens=args.num_draft_tokens, eos_token_id=[], compile=True)
            tokens[name] = r.token_ids
            stages[name] = {"compile_seconds": r.stats["compile_seconds"], "wall_seconds": time.perf_counter() - t,
                            "memos": template_cache_info()}
            print(f"[{args.child}] {name}: {stages[name]}", file=sys.stderr, flush=True)
    print(json.dumps({"stages": stages, "tokens": tokens}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_random_draft_args(ap, max_new_tokens=16)
    ap.add_argument("--stages", type=int, default=2, choices=[1, 2], help="1: only the eagle3 stage")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--order", default="ABBA", help="runs in this order; A: texts parsed once "
                    "(DRAFTSMITH_TEMPLATE_CACHE=1), B: parsed per use (0)")
    ap.add_argument("--cold", action="store_true", help="each run with an empty inductor cache directory of its own")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    if set(args.order) - set(ARMS):
        ap.error(f"--order: letters of {''.join(ARMS)}")
    out: dict = {"verifier": args.verifier, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
                 "load_avg": os.getloadavg(), "args": {a: str(v) for a, v in vars(args).items()}, "runs": []}
    for i, arm in enumerate(args.order):
        env = dict(os.environ, DRAFTSMITH_TEMPLATE_CACHE=ARMS[arm])
        with tempfile.TemporaryDirectory(prefix="inductor-cold-") if args.cold else contextlib.nullcontext() as cache_dir:
            if cache_dir is not None:
                env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
            cmd = [sys.executable, __file__, "--child", f"{i}{arm}", "--verifier", args.verifier, "--draft-vocab",
                   str(args.draft_vocab), "--draft-precision", args.draft_precision, "--num-draft-tokens",
                   str(args.num_draft_tokens), "--max-new-tokens", str(args.max_new_tokens), "--stages",
                   str(args.stages), "--threads", str(args.threads)]
            p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        out["runs"].append({"arm": arm, **json.loads(p.stdout.strip().splitlines()[-1])})
    stages = list(out["runs"][0]["stages"])
    summary = {}
    for arm in dict.fromkeys(args.order):
        runs = [r for r in out["runs"] if r["arm"] == arm]
        summary[arm] = {s: statistics.median(r["stages"][s]["compile_seconds"] for r in runs) for s in stages}
    out["summary_median_compile_seconds"] = summary
    if len(summary) == 2:
        out["ratio_A_over_B"] = {s: summary["A"][s] / summary["B"][s] for s in stages}
    out["identical"] = len({json.dumps(r["tokens"]) for r in out["runs"]}) == 1
    print(f"{'run':>4} {'arm':>3} " + " ".join(f"{s + ' compile s':>18}" for s in stages))
    for i, r in enumerate(out["runs"]):
        print(f"{i:>4} {r['arm']:>3} " + " ".join(f"{r['stages'][s]['compile_seconds']:>18.1f}" for s in stages))
    for arm, med in summary.items():
        print(f"median {arm} ({'parsed once' if ARMS[arm] == '1' else 'parsed per use'}): "
              + ", ".join(f"{s} {v:.1f} s" for s, v in med.items()))
    if "ratio_A_over_B" in out:
        print("A / B: " + ", ".join(f"{s} {v:.3f}" for s, v in out["ratio_A_over_B"].items()))
    print(f"tokens identical in every run: {out['identical']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
