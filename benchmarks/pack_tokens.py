"""Training speed vs packed row length on real captured rows (``draftsmith train --pack-tokens``).

Builds a draft for the verifier, packs the same captured samples into rows of each
``--pack-tokens`` value and times full training steps (TTT unroll, KL loss, backward,
AdamW; bf16 autocast on CPUs with AMX, as ``precision: auto`` does), alternating the
settings per repeat so drift hits all alike. Prints tokens/s per setting and repeat.

Usage (the recorded run)::

    PYTHONPATH=src python benchmarks/pack_tokens.py --shards runs/orig-800/shards \\
        --pack-tokens 1024 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--shards", type=Path, required=True, help="captured shards (from `draftsmith data`)")
    ap.add_argument("--pack-tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per setting and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    from draftsmith.data.shards import load_shards
    from draftsmith.models.verifier import load_verifier
    from draftsmith.models.vocab import select_vocab, token_counts
    from draftsmith.train.loop import _target_head, _use_bf16, build_draft, target_logits
    from draftsmith.train.loss import ttt_loss
    from draftsmith.train.packing import collate, pack_rows

    torch.set_num_threads(args.threads)
    model, _, fingerprint = load_verifier(args.verifier, dtype="float32")
    samples = [s for _, s in zip(range(args.num_samples), load_shards(args.shards, fingerprint))]
    vocab = select_vocab(token_counts(samples, model.get_output_embeddings().weight.shape[0]),
                         args.draft_vocab_size)
    bf16 = _use_bf16("auto", torch.device("cpu"))
    weights = [0.8 ** j for j in range(args.ttt_steps)]
    setups = {}
    for p in args.pack_tokens:
        draft = build_draft(model, vocab, 0)
        head, softcap = _target_head(model, draft)
        rows = pack_rows(samples, list(range(len(samples))), p)
        if len(rows) < args.steps + 1:
            raise SystemExit(f"--pack-tokens {p}: only {len(rows)} rows; add --num-samples")
        batches = [collate(samples, r, p) for r in rows[:args.steps + 1]]
        opt = torch.optim.AdamW([q for q in draft.parameters() if q.requires_grad], lr=1e-3)
        setups[p] = (draft, head, softcap, batches, opt)

    def step(p: int, b) -> None:
        draft, head, softcap, _, opt = setups[p]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = draft(b.aux.float(), b.input_ids, b.position_ids, b.attn_mask, args.ttt_steps)
            with torch.no_grad():
                tl = target_logits(b.last, head, softcap)
            loss, _ = ttt_loss(logits, tl, b.next_tokens, b.mask, b.doc, draft.draft_to_target, weights)
        loss.backward()
        opt.step()

    results: dict[int, list[float]] = {p: [] for p in args.pack_tokens}
    for p in args.pack_tokens:
        step(p, setups[p][3][0])  # warm-up
    for rep in range(args.repeats):
        order = args.pack_tokens if rep % 2 == 0 else list(reversed(args.pack_tokens))
        for p in order:
            batches = setups[p][3][1:]
            t = time.perf_counter()
            for b in batches:
                step(p, b)
            results[p].append(sum(b.num_tokens for b in batches) / (time.perf_counter() - t))
    print(f"precision {'bf16' if bf16 else 'fp32'}, TTT {args.ttt_steps}, Vd {args.draft_vocab_size}, "
          f"{args.steps} steps per repeat")
    for p, v in results.items():
        print(f"pack {p:5d}: tok/s {', '.join(f'{x:.0f}' for x in v)}; median {statistics.median(v):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
