"""Training-step A/B: the TTT step as it was vs with blocked attention and the one-pass loss.

Arms, interleaved per repeat in one process (bf16 autocast as `precision: auto` picks on
AMX CPUs, a draft shaped for SmolLM2-135M, one packed row, full step = TTT forward, KL
loss, backward, AdamW):

- ``before``: one [L, (j+1)L] SDPA per unrolled step and the per-step loss as it was
  up to 2026-11-30 (boolean row selection, the verifier's log-softmax redone every step);
  kept below as ``loss_before`` for this comparison only.
- ``loss``: the current ``ttt_loss`` (verifier side once, index_select), one-block attention.
- ``loss+blocks``: the current ``ttt_loss`` and attention in blocks of ``--attn-chunk`` queries.

A realistic loss mask: ~62% of positions count (the share of loss tokens in the cut
`full` data) in three packed documents.

    PYTHONPATH=src python benchmarks/train_step_ab.py --ttt-steps 3 5 --repeats 5 \
        --out benchmarks/results/train-step-ab.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from draftsmith.models.eagle3 import Eagle3Config, Eagle3Draft
from draftsmith.train.loss import StepStats, shift_left, step_mask, ttt_loss
from train import smollm2_135m_config  # benchmarks/train.py (this script's directory is on sys.path)


def loss_before(step_logits, target_logits, next_tokens, mask, doc, draft_to_target, step_weights):
    """The per-step KL loss as it was before the one-pass rewrite (for the A/B only)."""
    total = step_logits[0].new_zeros(())
    stats = StepStats([], [], [])
    for j, logits in enumerate(step_logits):
        m = step_mask(mask, doc, j)
        n = int(m.sum())
        stats.count.append(n)
        lq = logits[m].float().log_softmax(-1)
        lp = shift_left(target_logits, j)[m].float().log_softmax(-1)
        kl = (lp.exp() * (lp - lq)).sum(-1).sum()
        total = total + step_weights[j] * kl / n
        with torch.no_grad():
            guess = draft_to_target[lq.argmax(-1)]
            stats.correct.append(int((guess == shift_left(next_tokens, j)[m]).sum()))
        stats.loss.append(float(kl.detach()))
    return total, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack-tokens", type=int, default=1024)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--attn-chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    vcfg = smollm2_135m_config()
    L, Vd = args.pack_tokens, args.draft_vocab_size
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config.from_verifier(vcfg, draft_vocab_size=Vd))
    draft.set_vocab(torch.arange(Vd))
    draft.lm_head.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)
    bounds = [0, L * 3 // 10, L * 8 // 10, L]
    doc = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]
    attn = ((doc[:, None] == doc[None, :]) & torch.ones(L, L, dtype=torch.bool).tril())[None]
    aux = torch.randn(1, L, 3 * 576, generator=g)
    ids = torch.randint(0, Vd, (1, L), generator=g)
    target = torch.randn(1, L, Vd, generator=g) * 3
    nxt = target.argmax(-1)
    valid = torch.rand(1, L, generator=g) < 0.62
    arms = {"before": (0, loss_before), "loss": (0, ttt_loss), "loss+blocks": (args.attn_chunk, ttt_loss)}

    def step(chunk: int, loss_fn, steps: int) -> float:
        draft.ttt_attn_chunk = chunk
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = draft(aux, ids, pos, attn, steps)
            loss, _ = loss_fn(logits, target, nxt, valid, doc[None], draft.draft_to_target,
                              [0.8 ** j for j in range(steps)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    results = []
    for steps in args.ttt_steps:
        for arm in arms.values():
            step(*arm, steps)  # warm-up
        times: dict[str, list[float]] = {a: [] for a in arms}
        for _ in range(args.repeats):
            for name, arm in arms.items():
                times[name].append(step(*arm, steps))
        base = statistics.median(times["before"])
        for name, ts in times.items():
            med = statistics.median(ts)
            row = {"ttt_steps": steps, "arm": name, "step_seconds": ts, "median_s": med,
                   "tokens_per_second": L / med, "speedup_vs_before": base / med}
            results.append(row)
            print(f"TTT {steps} {name:12s} {L / med:7.0f} tok/s  median {med:.3f} s  "
                  f"x{base / med:.2f} vs before  ({', '.join(f'{t:.3f}' for t in ts)})", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "benchmarks/train_step_ab.py", "args": vars(args) | {"out": str(args.out)},
                                        "results": results, "torch": torch.__version__,
                                        "threads": torch.get_num_threads(),
                                        "machine": platform.processor() or platform.machine()}, indent=2))


if __name__ == "__main__":
    main()
