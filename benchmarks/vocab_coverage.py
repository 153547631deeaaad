"""How much of the verifier's held-out replies a draft vocabulary can predict, and what growing it buys.

A draft can only propose tokens of its vocabulary (``t2d``), so the share of held-out reply
tokens outside it caps acceptance: a draft step on such a token is always rejected. This script

1. counts loss-masked tokens over the training captures (``--data``) and over the held-out
   replies cached by ``benchmarks/heldout_acceptance.py`` (``--cache``);
2. reports the held-out coverage of the ``--draft``'s vocabulary and of vocabularies grown from
   it to each ``--sizes`` with the training counts (``draftsmith.models.vocab.grow_vocab``, what
   ``draftsmith train --extend-vocab`` does);
3. scores each grown draft *without training* (``train.loop.extend_draft_vocab``: the new
   lm_head rows are the verifier's) by teacher-forced acceptance on the cached replies.

Usage (the recorded run)::

    PYTHONPATH=src python benchmarks/vocab_coverage.py --cache runs/eval-mtbench \\
        --draft runs/more-f-fresh7k/draft --sizes 12288 16384 24576 32000 \\
        --data runs/full-trimmed/shards runs/fresh-1000/shards runs/fresh-2000/shards \\
               runs/fresh-6000/shards runs/fresh-8000/shards
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft", type=Path, required=True, help="the EAGLE-3 draft to grow")
    ap.add_argument("--data", type=Path, nargs="+", required=True, help="training shard directories (the counts)")
    ap.add_argument("--cache", type=Path, required=True, help="heldout_acceptance.py's cache (replies + states)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32000])
    ap.add_argument("--vocab-of", type=Path, default=None,
                    help="also score the draft grown to exactly this other draft's vocabulary")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="JSON with every number")
    args = ap.parse_args(argv)

    import torch

    from draftsmith.data.shards import load_shards
    from draftsmith.models.speculators import read_draft
    from draftsmith.models.verifier import load_verifier
    from draftsmith.models.vocab import coverage, grow_vocab, token_counts
    from draftsmith.train.loop import extend_draft_vocab
    from heldout_acceptance import teacher_forced

    torch.set_num_threads(args.threads)
    model, _, fingerprint = load_verifier(args.verifier, dtype="float32")
    V = model.get_output_embeddings().weight.shape[0]
    train_counts = sum(token_counts(load_shards(d, fingerprint), V) for d in args.data)
    samples = list(load_shards(args.cache / "shards", fingerprint))
    held_counts = token_counts(samples, V)
    draft = read_draft(str(args.draft), device="cpu", dtype=torch.float32).eval()
    rows = []
    vocabs = [(grow_vocab(train_counts, draft.draft_to_target, size), None)
              for size in [draft.config.draft_vocab_size] + args.sizes]
    if args.vocab_of:
        other = read_draft(str(args.vocab_of), device="cpu", dtype=torch.float32)
        vocabs.append((other.draft_to_target, str(args.vocab_of)))
    for vocab, vocab_of in vocabs:
        size = int(vocab.numel())
        grown = extend_draft_vocab(draft, model, vocab).eval()
        per_pos, n, _ = teacher_forced(grown, samples, args.k)
        row = {"draft_vocab_size": size, "vocab_of": vocab_of, "train_coverage": coverage(train_counts, vocab),
               "heldout_coverage": coverage(held_counts, vocab), "acceptance_length": 1 + sum(per_pos),
               "per_position": per_pos}
        rows.append(row)
        print(f"Vd {size:6d}: held-out coverage {row['heldout_coverage']:.4f}, training coverage "
              f"{row['train_coverage']:.4f}, acceptance length {row['acceptance_length']:.3f} (untrained rows; "
              f"per position {[round(x, 3) for x in per_pos]})", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"draft": str(args.draft), "data": [str(d) for d in args.data],
                                        "cache": str(args.cache), "k": args.k, "train_loss_tokens": int(train_counts.sum()),
                                        "heldout_loss_tokens": int(held_counts.sum()), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
