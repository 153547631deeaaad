"""A real draft's MT-Bench acceptance in memory vs after export + load (issue 4).

Trains a few steps (warm-started from an existing draft, so acceptance is not zero) on
captured shards, keeps the in-memory draft, exports it in the speculators format, loads it
back with `load_draft`, and decodes the first MT-Bench prompts greedily with both and with
no draft: outputs must be identical and every acceptance statistic equal.

    PYTHONPATH=src python benchmarks/export_acceptance.py --shards RUN/steps/capture-*/shards \
        --init-from RUN/steps/train-*/train/draft --out benchmarks/results/export-acceptance.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from draftsmith import generate, load_draft
from draftsmith.data.prompts import eval_set
from draftsmith.export import save_draft
from draftsmith.decoding.proposers import Eagle3Proposer
from draftsmith.models.verifier import load_verifier
from draftsmith.train.loop import TrainConfig, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--shards", required=True, help="captured shards of this verifier")
    ap.add_argument("--init-from", required=True, help="a draft to warm-start from")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model, tok, fp = load_verifier(args.verifier, dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(verifier=args.verifier, data=args.shards, out=f"{tmp}/run", max_steps=args.steps,
                          val_fraction=0.0, init_from=args.init_from, draft_vocab_size=8192, pack_tokens=1024,
                          eval_every=10_000, checkpoint_every=10_000)
        in_memory = train(cfg, verifier=model, fingerprint=fp, progress=False).draft.eval()
        loaded = load_draft(save_draft(in_memory, Path(tmp) / "exported", verifier_name=args.verifier), model)
        rows = []
        for pid, ids in eval_set("mt-bench", tok, limit=args.num_prompts):
            plain = generate(model, ids, max_new_tokens=args.max_new_tokens).token_ids
            a, b = (generate(model, ids, proposer=p, max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k)
                    for p in (Eagle3Proposer(in_memory), loaded))
            drop = ("seconds", "prefill_seconds", "tokens_per_second")
            rows.append({"prompt": pid, "identical_outputs": a.token_ids == b.token_ids == plain,
                         "equal_stats": {x: v for x, v in a.stats.items() if x not in drop}
                         == {x: v for x, v in b.stats.items() if x not in drop},
                         "acceptance_length": [a.stats["acceptance_length"], b.stats["acceptance_length"]]})
            print(rows[-1], flush=True)
    result = {"verifier_fingerprint": fp, "k": args.k, "rows": rows,
              "all_identical": all(r["identical_outputs"] for r in rows),
              "all_stats_equal": all(r["equal_stats"] for r in rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
