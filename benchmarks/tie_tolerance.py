"""How far apart do a one-token and a multi-token forward put the same logits, in ulps?

The tie tolerance of ``draftsmith.bench.verdict`` (``TIE_ULPS`` ulps of the run's dtype
at the top logit) must cover the rounding difference between the paths a greedy run
takes: plain decoding scores each position in a one-token forward on a cache; a
speculative round scores k+1 positions in one forward; the verdict rescoring scores
the whole prefix at once. This script decodes MT-Bench prompts plainly, then scores
the same sequences (a) in chunks of k+1 tokens on a cache, as verification does, and
(b) in one fresh forward, as the rescoring does, and reports, per position, the change
of the top-2 logit gap ``l[top1] - l[top2]`` (top-2 of the one-token path) in ulps at
the top logit's magnitude. A flip needs that change to exceed the gap.

    PYTHONPATH=src python benchmarks/tie_tolerance.py --dtype bfloat16 --num-prompts 8 \
        --out benchmarks/results/tie-tolerance-bf16.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="chunk of k+1 tokens scored at once, as a verify forward")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from transformers import DynamicCache

    from draftsmith.bench.measure import environment
    from draftsmith.bench.verdict import TIE_ULPS, ulp
    from draftsmith.data.sources import eval_set
    from draftsmith.models.verifier import load_verifier

    model, tok, fp = load_verifier(args.verifier, dtype=args.dtype)
    dtype = next(model.parameters()).dtype
    deltas = {"chunked": [], "fresh": []}
    with torch.inference_mode():
        for _, ids in eval_set("mt-bench", tok, args.num_prompts):
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
            one = [out.logits[0, -1].float()]
            seq = list(ids)
            for _ in range(args.max_new_tokens - 1):  # plain greedy: one-token forwards
                seq.append(int(one[-1].argmax()))
                out = model(input_ids=torch.tensor([[seq[-1]]]), cache=cache, use_cache=True)
                one.append(out.logits[0, -1].float())
            L, n = len(ids), len(one)
            fresh = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, L - 1:L - 1 + n].float()
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([ids[:-1]]), cache=cache, use_cache=True)
            chunks = []
            for s in range(L - 1, L - 1 + n, args.k + 1):
                piece = torch.tensor([seq[s:min(s + args.k + 1, L - 1 + n)]])
                chunks.append(model(input_ids=piece, cache=cache, use_cache=True).logits[0].float())
            chunked = torch.cat(chunks)[:n]
            for j, ref in enumerate(one):
                top2 = ref.topk(2).indices
                gap_ref = float(ref[top2[0]] - ref[top2[1]])
                u = ulp(dtype, float(ref[top2[0]]))
                for name, other in (("chunked", chunked[j]), ("fresh", fresh[j])):
                    deltas[name].append(abs(float(other[top2[0]] - other[top2[1]]) - gap_ref) / u)
    summary = {name: {"positions": len(v), "median_ulps": float(np.median(v)), "p99_ulps": float(np.percentile(v, 99)),
                      "max_ulps": float(np.max(v)), f"share_above_{TIE_ULPS:g}_ulps": float(np.mean(np.array(v) > TIE_ULPS))}
               for name, v in deltas.items()}
    result = {"verifier": args.verifier, "fingerprint": fp, "dtype": str(dtype), "k": args.k,
              "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "tie_ulps": TIE_ULPS,
              "summary": summary, "environment": environment()}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
