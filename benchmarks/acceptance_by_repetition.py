"""How much of a draft's acceptance comes from replies that repeat themselves? (issue 3 diagnostic)

Small verifiers often loop in long greedy replies, and a draft predicts a loop easily. This
script splits captured samples by the share of the reply's 4-grams that already occurred
earlier in the reply, and reports the draft's teacher-forced acceptance (the training
loop's ``simulated_acceptance``, k = ``--k``) in each group, pooled over positions as the
training validation pools them.

``--split val`` takes the training run's validation split (the same seeded hash split
``draftsmith train`` uses); ``--split all`` takes every sample (e.g. held-out eval shards
from ``benchmarks/heldout_acceptance.py``).

Usage (the recorded runs)::

    PYTHONPATH=src python benchmarks/acceptance_by_repetition.py \\
        --draft runs/full/steps/train-e2a0b38036582950/train/draft \\
        --shards runs/full/steps/capture-cfacb09dd85df178/shards --split val
    PYTHONPATH=src python benchmarks/acceptance_by_repetition.py \\
        --draft runs/full/steps/train-e2a0b38036582950/train/draft --shards runs/eval-mtbench/shards --split all
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def repeated_share(tokens: list[int], n: int = 4) -> float:
    """Share of the n-grams of ``tokens`` that occurred earlier in ``tokens``."""
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        repeats += g in seen
        total += 1
        seen.add(g)
    return repeats / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--shards", type=Path, required=True)
    ap.add_argument("--split", choices=["val", "all"], default="val")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threshold", type=float, default=0.1, help="repeated 4-gram share splitting the groups")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from heldout_acceptance import teacher_forced

    from draftsmith.data.shards import load_shards
    from draftsmith.models.speculators import read_draft
    from draftsmith.train.loop import _split

    torch.set_num_threads(args.threads)
    draft = read_draft(str(args.draft), device="cpu", dtype=torch.float32).eval()
    samples = list(load_shards(args.shards))
    if args.split == "val":
        samples = [samples[i] for i in _split(len(samples), args.val_fraction, args.seed)[1]]
    groups: dict[str, list[dict]] = {"all": samples, "low": [], "high": []}
    shares = []
    for s in samples:
        share = repeated_share(s["input_ids"][s["loss_mask"].bool()].tolist())
        shares.append(share)
        groups["low" if share < args.threshold else "high"].append(s)
    print(f"{args.shards} ({args.split}): {len(samples)} replies, repeated 4-gram share median "
          f"{statistics.median(shares):.2f}; {len(groups['high'])} replies at >= {args.threshold}")
    for name, group in groups.items():
        if not group:
            continue
        per_pos, n, per_sample = teacher_forced(draft, group, args.k)
        label = {"all": "all", "low": f"share < {args.threshold}", "high": f"share >= {args.threshold}"}[name]
        print(f"  {label:>14}: {len(group):4d} replies, {n:6d} positions, acceptance length {1 + sum(per_pos):.2f} "
              f"(first position {per_pos[0]:.2f}); per-reply median {statistics.median(per_sample):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
