"""Does llama.cpp's own confidence cut help an EAGLE-3 draft there? (BENCHMARKS.md 9z)

llama.cpp's `draft-eagle3` stops drafting at the first token whose own top probability is below
`--spec-draft-p-min` (our bench serves it at 0: every token drafted, as vLLM does; our engine's
`--draft-confidence` cuts on the product of the probabilities instead). This starts one
`llama-server` per setting (plain; the draft, q8_0 by default, at each ``--settings K:P``, with
`--spec-draft-n-min 0` so a short draft is kept) and times them side by side on the same
prompts, interleaved per prompt with a rotating order; greedy outputs must equal the plain
server's. llama-server's per-request `speculative.p_min` is not applied by `draft-eagle3` in
this build (drafted counts do not move), so each setting is its own server.

    DRAFTSMITH_LLAMACPP_DIR=.engines/llama.cpp PYTHONPATH=src python benchmarks/llamacpp_p_min.py \\
        --draft DRAFT --num-prompts 10 --settings 1:0 1:0.3 1:0.5 2:0 2:0.3 2:0.5 \\
        --out benchmarks/results/llamacpp-p-min-spr.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="a speculators-format EAGLE-3 draft directory")
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--settings", nargs="+", default=["1:0", "1:0.3", "1:0.5", "2:0", "2:0.3", "2:0.5"],
                    help="K:P pairs: draft length and --spec-draft-p-min")
    ap.add_argument("--draft-dtype", default="q8_0", help="GGUF type of the draft (f32 or q8_0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from draftsmith.bench.measure import environment, load_eval_prompts
    from draftsmith.engines.llamacpp import LlamaCppEngine, draft_gguf
    from draftsmith.models.verifier import load_verifier

    _, tok, _ = load_verifier(args.verifier)
    prompts = load_eval_prompts(args.dataset, tok, args.num_prompts)
    gguf = draft_gguf(args.draft, args.verifier, dtype=args.draft_dtype)
    settings = [(int(k), float(p)) for k, p in (s.split(":") for s in args.settings)]
    servers = {"plain": LlamaCppEngine(args.verifier, None, 1, threads=args.threads)}
    for k, p in settings:
        servers[f"k={k} p_min={p:g}"] = LlamaCppEngine(
            args.verifier, gguf, k, threads=args.threads,  # logs: the draftsmith cache
            extra_args=["--spec-draft-p-min", str(p), "--spec-draft-n-min", "0"])  # appended last: they win
    started = []
    try:
        for s in servers.values():
            started.append(s.__enter__())
        names = list(servers)
        for name in names:  # warm-up
            servers[name].generate(prompts[0][1], 16)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for i, (pid, ids) in enumerate(prompts):
            for name in names[i % len(names):] + names[:i % len(names)]:
                r = servers[name].generate(ids, args.max_new_tokens)
                c = r.counters
                runs[name].append({"prompt": pid, "tokens": r.token_ids, "seconds": r.seconds,
                                   "draft_tokens": c.draft_tokens if c else 0,
                                   "accepted_tokens": c.accepted_tokens if c else 0})
    finally:
        for s in started:
            s.__exit__(None, None, None)

    base = runs["plain"]
    rows = {}
    for name, v in runs.items():
        ratios = [(len(a["tokens"]) / a["seconds"]) / (len(b["tokens"]) / b["seconds"]) for a, b in zip(v, base)]
        rows[name] = {
            "tokens_per_second_median": statistics.median(len(x["tokens"]) / x["seconds"] for x in v),
            "speedup_median": statistics.median(ratios), "speedup_per_prompt": ratios,
            "identical": f"{sum(a['tokens'] == b['tokens'] for a, b in zip(v, base))}/{len(v)}",
            "draft_tokens": sum(x["draft_tokens"] for x in v), "accepted_tokens": sum(x["accepted_tokens"] for x in v)}
        print(f"{name:18s} {rows[name]['tokens_per_second_median']:6.1f} tok/s  {rows[name]['speedup_median']:.3f}x  "
              f"identical {rows[name]['identical']}  drafted {rows[name]['draft_tokens']} "
              f"accepted {rows[name]['accepted_tokens']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": vars(args) | {"out": str(args.out)}, "environment": environment(),
                                    "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows},
                                   indent=1, default=str))


if __name__ == "__main__":
    main()
