"""The alternatives to a trained draft, side by side in one interleaved bench run (issue 22).

Rows (every one on the same prompts, the row order rotating per prompt):

- plain decoding of the full-precision verifier (the baseline of every speedup);
- the n-gram drafter;
- an off-the-shelf small model as the draft, with its own tokenizer (drafting through
  text, ``--drafter model:SPEC``; by default SmolLM2-135M for Gemma-3-270M);
- each EAGLE-3 draft directory given with ``--draft``;
- the verifier quantized (int8 on CPU, int4 on CUDA), plainly and with each drafter above.

The bench report (``report.md``, ``report.json``, plots) lands in ``--out``, with its
"Which to choose" table, and ``alternatives.json`` beside it holds the numbers this
comparison is about. Timings need a quiet machine: pin ``--threads`` and run nothing else.

Usage::

    PYTHONPATH=src python benchmarks/alternatives.py --threads 2 \\
        --out benchmarks/results/alternatives-gemma3-270m [--draft DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="gemma3-270m")
    ap.add_argument("--draft-model", default="smollm2-135m",
                    help="a small LM used as the draft as it is (its tokenizer may differ); 'none' to skip")
    ap.add_argument("--draft", action="append", default=[], help="EAGLE-3 draft directory (repeatable)")
    ap.add_argument("--quantize", nargs="*", default=None,
                    help="quantizations to measure (default: int8 on CPU, int4 on CUDA)")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, nargs="+", default=[3])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/alternatives"))
    args = ap.parse_args(argv)

    import torch

    from draftsmith.bench.run import BenchConfig, run_bench
    from draftsmith.utils import resolve_device

    quantize = args.quantize
    if quantize is None:
        quantize = ["int4"] if resolve_device(args.device).type == "cuda" else ["int8"]
    drafters = ["ngram"] + ([] if args.draft_model == "none" else [f"model:{args.draft_model}"])
    cfg = BenchConfig(verifier=args.verifier, out=args.out, drafter=drafters, draft=args.draft,
                      quantize=quantize, dataset=args.dataset, num_prompts=args.num_prompts,
                      max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                      repeats=args.repeats, threads=args.threads, device=args.device, hf_reference=False)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    run_bench(cfg)
    report = json.loads((args.out / "report.json").read_text())
    summary = {
        "verifier": args.verifier, "draft_model": args.draft_model, "drafts": args.draft, "quantize": quantize,
        "environment": report["environment"], "load_average": report["load_average"],
        "config": {k: report["config"][k] for k in ("dataset", "num_prompts", "max_new_tokens", "num_draft_tokens",
                                                    "repeats", "threads")},
        "rows": [{"name": r["name"], "kind": r["kind"], "quant": r.get("quant"),
                  "tokens_per_second": r["tokens_per_second"]["median"], "speedup": r["speedup"]["median"],
                  "speedup_ci95": r["speedup"]["ci95"],
                  "acceptance_length": (r.get("acceptance") or {}).get("acceptance_length"),
                  "outputs": r.get("outputs") and {k: r["outputs"][k] for k in ("identical", "tie", "mismatch")},
                  "reference": r.get("reference"), "quality": r.get("quality")} for r in report["rows"]],
        "which_to_choose": report["which_to_choose"],
    }
    (args.out / "alternatives.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}/alternatives.json and the bench report", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
