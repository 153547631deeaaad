"""Engine benchmark (issue 2): our decoding loop against Hugging Face transformers.

Measures, side by side in one run and interleaved per prompt (the row order
rotates from prompt to prompt), on MT-Bench first turns with greedy decoding:

* ``hf-generate``        transformers ``model.generate`` (plain greedy)
* ``hf-prompt-lookup``   transformers ``generate(prompt_lookup_num_tokens=k)``
* ``ours-plain``         ``draftsmith.generate(proposer=None)``
* ``ours-ngram``         ``draftsmith.generate(proposer=NgramProposer())``, at most the same k
  (its draft length adapts to the last draft's fate, the proposer's default)
* ``ours-ngram-fixed``   (``--fixed-ngram-row``) the same lookup with ``adaptive=False``: k
  tokens on every match, HF's policy, to show what the adaptive length buys

and reports tokens/s medians, the paired per-prompt ratios ours-plain/hf-generate
and ours-ngram/hf-prompt-lookup (median, bootstrap 95% CI, worst prompt), and
whether every row produced the tokens of ``hf-generate``. Targets: ours-plain
within 10% of hf-generate (median ratio >= 0.90); ours-ngram never slower than
hf-prompt-lookup (every per-prompt ratio >= 1.0).

Usage (the recorded run)::

    PYTHONPATH=src python benchmarks/engine.py --num-prompts 10 --max-new-tokens 128 --threads 2 \\
        --repeats 2 --fixed-ngram-row --out benchmarks/results/engine-smollm2-135m-adaptive.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m", help="verifier spec (default: smollm2-135m)")
    ap.add_argument("--num-prompts", type=int, default=20, help="MT-Bench first turns to use")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--num-draft-tokens", type=int, default=10,
                    help="k for both n-gram rows (HF's prompt_lookup_num_tokens default is 10)")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over all prompts")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (pin it on a shared machine)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine.json"), help="result JSON")
    ap.add_argument("--fixed-ngram-row", action="store_true",
                    help="also time our n-gram with a fixed draft length (adaptive=False), HF's policy")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = ap.parse_args(argv)
    if min(args.num_prompts, args.max_new_tokens, args.num_draft_tokens, args.repeats) < 1:
        ap.error("--num-prompts, --max-new-tokens, --num-draft-tokens and --repeats must be >= 1")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    from draftsmith.bench.measure import BenchState, Row, environment, load_eval_prompts, measure_interleaved
    from draftsmith.bench.stats import bootstrap_ci, paired_ratios, summarize
    from draftsmith.decoding.proposers import NgramProposer
    from draftsmith.models.verifier import load_verifier

    import torch

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer, fp = load_verifier(args.verifier, dtype=args.dtype, device=args.device)
    prompts = load_eval_prompts("mt-bench", tokenizer, args.num_prompts)
    k = args.num_draft_tokens
    rows = [Row("hf-generate", "hf-generate", model), Row("hf-prompt-lookup", "hf-prompt-lookup", model, k=k),
            Row("ours-plain", "plain", model), Row("ours-ngram", "drafter", model, "ngram", k, NgramProposer())]
    if args.fixed_ngram_row:  # what the adaptive draft length buys: the same lookup at a fixed k
        rows.append(Row("ours-ngram-fixed", "drafter", model, "ngram-fixed", k, NgramProposer(adaptive=False)))
    state = BenchState(rows, prompts)
    try:
        measure_interleaved(state, args.max_new_tokens, 0.0, args.repeats, seed=0, progress=not args.no_progress)
    except KeyboardInterrupt:
        print("engine benchmark: interrupted; reporting the prompts measured so far", file=sys.stderr)

    idx = {r.name: i for i, r in enumerate(rows)}
    done = [p for p in range(len(prompts)) if all((i, p) in state.results for i in range(len(rows)))]
    if not done:
        print("engine benchmark: nothing measured", file=sys.stderr)
        return 1
    tps = {r.name: [statistics.median(x.tokens_per_second for x in state.results[(idx[r.name], p)])
                    for p in done] for r in rows}
    tokens = {r.name: [state.results[(idx[r.name], p)][0].token_ids for p in done] for r in rows}

    def compare(num: str, den: str) -> dict:
        ratios = paired_ratios(tps[num], tps[den])
        return {"median": float(np.median(ratios)), "ci95": list(bootstrap_ci(ratios)), "min": min(ratios),
                "max": max(ratios), "prompts_slower": sum(r < 1.0 for r in ratios), "per_prompt": ratios}

    plain_vs_hf = compare("ours-plain", "hf-generate")
    ngram_vs_pld = compare("ours-ngram", "hf-prompt-lookup")
    extra = {}
    if "ours-ngram-fixed" in tps:
        extra["ours-ngram-fixed / hf-prompt-lookup"] = compare("ours-ngram-fixed", "hf-prompt-lookup")
    extra["ours-ngram / ours-plain"] = compare("ours-ngram", "ours-plain")
    identical = {name: sum(a == b for a, b in zip(tokens[name], tokens["hf-generate"])) / len(done)
                 for name in tokens}
    targets = {"ours-plain within 10% of hf-generate (median ratio >= 0.90)": plain_vs_hf["median"] >= 0.90,
               "ours-ngram never slower than hf-prompt-lookup (min ratio >= 1.0)": ngram_vs_pld["min"] >= 1.0}
    result = {
        "partial": len(done) < len(prompts),
        "verifier": {"spec": args.verifier, "fingerprint": fp},
        "settings": {"dataset": "mt-bench (first turns)", "prompts": len(done), "max_new_tokens": args.max_new_tokens,
                     "num_draft_tokens": k, "repeats": args.repeats, "decoding": "greedy",
                     "torch_threads": torch.get_num_threads(),
                     "hf_max_matching_ngram_size": "transformers default (2)", "ours_max_ngram": 3,
                     "ours_ngram_draft_length": "adaptive (NgramProposer default), at most k"},
        "environment": environment(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "tokens_per_second": {name: summarize(v) for name, v in tps.items()},
        "ratios": {"ours-plain / hf-generate": plain_vs_hf, "ours-ngram / hf-prompt-lookup": ngram_vs_pld,
                   **extra},
        "identical_to_hf_generate": identical,
        "targets": targets,
        "per_prompt": [{"prompt": prompts[p][0], "new_tokens": {n: len(tokens[n][j]) for n in tokens},
                        "tokens_per_second": {n: tps[n][j] for n in tps}} for j, p in enumerate(done)],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{len(done)} MT-Bench prompts x {args.max_new_tokens} new tokens, greedy, k={k}, "
          f"{args.repeats} repeat(s); verifier {args.verifier} ({fp})")
    for name, v in tps.items():
        s = summarize(v)
        print(f"  {name:18s} {s['median']:8.1f} tok/s  [IQR {s['p25']:.1f}-{s['p75']:.1f}]  "
              f"identical to hf-generate: {100 * identical[name]:.0f}%")
    for label, c in result["ratios"].items():
        print(f"  {label:32s} median {c['median']:.3f}  95% CI [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]  "
              f"min {c['min']:.3f}  slower on {c['prompts_slower']}/{len(done)} prompts")
        print("    per prompt: " + " ".join(f"{r:.2f}" for r in c["per_prompt"]))
    for label, ok in targets.items():
        print(f"  [{'MET ' if ok else 'MISS'}] {label}")
    print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
