"""EAGLE-3 drafts on held-out prompts in seconds: teacher-forced acceptance on the verifier's replies.

Greedy decoding is deterministic, so which draft tokens the engine would accept follows from
the verifier's greedy reply alone: the draft's step j at position t is accepted when steps
0..j all equal the reply's tokens (the training loop's ``simulated_acceptance``, the same
TTT unroll the draft was trained with). This script

1. answers the eval prompts once with the verifier (greedy, float32, cached in ``--cache``)
   and captures its hidden states over prompt + reply;
2. reports every ``--draft``'s acceptance length and per-position acceptance at k = ``--k``
   over all prompts (about 15 s per draft for MT-Bench's 80 on 2 CPU cores, against ~10 min
   for a ``draftsmith bench`` of 80 prompts);
3. with ``--check-engine N``, decodes the first N prompts with the real engine and the first
   draft and prints both numbers per prompt, so the shortcut is checked, not assumed.

It measures acceptance only, never speed: ``draftsmith bench`` stays the judge of speedup.

Usage (the recorded run)::

    PYTHONPATH=src python benchmarks/heldout_acceptance.py --cache runs/eval-mtbench --check-engine 8 \\
        --draft runs/full/steps/train-e2a0b38036582950/train/draft runs/old-draft
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def draft_steps(draft, samples: list[dict], k: int):
    """Per sample: its one-sample batch and the draft's k teacher-forced step logits over it."""
    import torch

    from draftsmith.train.packing import collate

    for s in samples:
        b = collate([s], [0], s["input_ids"].shape[0])
        with torch.no_grad():
            yield b, draft.forward_ttt(b.aux.float(), b.input_ids, b.position_ids, b.attn_mask, k)


def teacher_forced(draft, samples: list[dict], k: int) -> tuple[list[float], int, list[float]]:
    """Pooled per-position acceptance over ``samples``, positions counted, and each sample's length."""
    import torch

    from draftsmith.train.loop import simulated_acceptance

    acc = torch.zeros(k, dtype=torch.long)
    n = 0
    per_sample = []
    for b, logits in draft_steps(draft, samples, k):
        a, c = simulated_acceptance(logits, b, draft.draft_to_target)
        acc += a
        n += int(c)
        per_sample.append(1 + sum(a.tolist()) / max(int(c), 1))
    return [x / max(n, 1) for x in acc.tolist()], n, per_sample


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft", type=Path, nargs="+", required=True, help="EAGLE-3 draft directories")
    ap.add_argument("--dataset", default="mt-bench", help="held-out prompts (first user turns)")
    ap.add_argument("--cache", type=Path, required=True, help="where the replies and captured states are kept")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5, help="draft tokens per round")
    ap.add_argument("--check-engine", type=int, default=0, metavar="N",
                    help="also decode the first N prompts with the real engine and the first draft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="JSON with every number")
    args = ap.parse_args(argv)

    import torch

    from draftsmith.data.capture import capture_to_shards
    from draftsmith.data.regenerate import load_regenerated, regenerate
    from draftsmith.data.shards import load_shards
    from draftsmith.decoding.engine import generate
    from draftsmith.drafters import load_draft
    from draftsmith.models.speculators import read_draft
    from draftsmith.data.sources import load_prompts
    from draftsmith.models.verifier import load_verifier

    torch.set_num_threads(args.threads)
    model, tokenizer, fingerprint = load_verifier(args.verifier, dtype="float32")
    shards = args.cache / "shards"
    if not (shards / "manifest.json").is_file():
        convs = load_prompts(args.dataset, split="all", exclude_eval=False, dedupe=False)
        replies = regenerate(model, tokenizer, convs, args.cache / "regenerated.jsonl",
                             max_new_tokens=args.max_new_tokens, batch_size=16, fingerprint=fingerprint)
        capture_to_shards(model, tokenizer, load_regenerated(replies), shards, fingerprint=fingerprint,
                          verifier_spec=args.verifier, max_length=4096, batch_size=8, samples_per_shard=256)
    samples = list(load_shards(shards, fingerprint))
    result: dict = {"verifier_fingerprint": fingerprint, "dataset": args.dataset, "prompts": len(samples),
                    "k": args.k, "drafts": {}}
    for path in args.draft:
        draft = read_draft(str(path), device="cpu", dtype=torch.float32).eval()
        per_pos, n, per_sample = teacher_forced(draft, samples, args.k)
        result["drafts"][str(path)] = {"acceptance_length": 1 + sum(per_pos), "per_position": per_pos,
                                       "positions": n, "per_sample": per_sample}
        print(f"{path}: acceptance length {1 + sum(per_pos):.3f} (k={args.k}, {len(samples)} prompts, "
              f"{n} positions); per position {[round(x, 3) for x in per_pos]}")

    if args.check_engine:
        proposer = load_draft(str(args.draft[0]), model)
        sim = result["drafts"][str(args.draft[0])]["per_sample"][:args.check_engine]
        real = []
        for s in samples[:args.check_engine]:
            ids = s["input_ids"][: int(s["loss_mask"].int().argmax())].tolist()  # prompt + generation prompt
            real.append(generate(model, ids, proposer=proposer, max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=args.k).stats["acceptance_length"])
        result["engine_check"] = {"draft": str(args.draft[0]), "engine": real, "teacher_forced": sim}
        print(f"engine vs teacher-forced, first {len(real)} prompts: "
              + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(real, sim))
              + f"; means {statistics.mean(real):.3f} / {statistics.mean(sim):.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
