"""Is a draft's confidence worth reading? Calibration of an EAGLE-3 draft and the early stop it allows
(BENCHMARKS.md 9y).

Decodes the eval prompts greedily with the draft at k = ``--k`` and no stop rule (eager, untimed),
recording per round each drafted token's top probability and whether it was accepted (the
output is the verifier's, so token i passed iff it equals the output at its position). Then:

- calibration: acceptance of the first drafted token per bin of the draft's top probability
  (a draft whose confidence tracks its acceptance can be gated on it);
- a replay: the speedup over plain decoding each stop rule would give on these rounds, priced
  with step prices given on the command line (``--t-verify``, ms per verify of 1, 2, ... tokens;
  ``--draft-step``, ms per draft step), for ``--draft-confidence off``, the price-derived floors
  of ``costmodel.confidence_thresholds`` and a grid of single floors. The replay keeps each
  round where it started, which a shorter draft would move; it is an estimate, the bench's rows
  are the measurement.

    PYTHONPATH=src python benchmarks/draft_confidence.py --draft DRAFT --num-prompts 21 --k 3 \\
        --t-verify 24.8 32.2 34.0 37.4 --draft-step 1.1 --out benchmarks/results/draft-confidence.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def record(model, proposer, prompts, k: int, max_new_tokens: int) -> list[dict]:
    """Per round: the draft's top probability per drafted token and whether each was accepted."""
    from draftsmith.decoding.engine import generate

    tops: list[float] = []
    rounds: list[dict] = []
    choose, propose = proposer._choose, proposer.propose

    def choose_and_record(logits, sampling, generator):
        tok, q, _ = choose(logits, sampling, generator)
        p = torch.softmax(logits.float(), -1).max()
        tops.append(float(p))
        return tok, q, None

    def propose_and_record(ctx, kk, sampling, generator):
        tops.clear()
        out = propose(ctx, kk, sampling, generator)
        rounds.append({"at": int(ctx.tokens.shape[0]), "tokens": out.tokens.tolist(),
                       "tops": tops[:out.tokens.shape[0]]})
        return out

    proposer._choose, proposer.propose = choose_and_record, propose_and_record
    per_round = []
    try:
        for _, ids in prompts:
            rounds.clear()
            out = generate(model, ids, proposer, max_new_tokens=max_new_tokens, num_draft_tokens=k)
            seq = list(ids) + out.token_ids
            for r in rounds:
                passed, ok = [], True
                for i, t in enumerate(r["tokens"]):
                    ok = ok and r["at"] + i < len(seq) and seq[r["at"] + i] == t
                    passed.append(ok)
                per_round.append({"tops": r["tops"], "passed": passed})
    finally:
        del proposer._choose, proposer.propose
    return per_round


def replay(rounds: list[dict], floors: list[float], k: int, t_verify: list[float], draft_step: float) -> float:
    """Speedup over plain decoding of the stop rule ``floors`` on the recorded rounds: a round
    proposing l tokens costs T_verify(l + 1) and min(l + 1, k) draft steps, and emits its passed
    tokens + 1."""
    tokens = seconds = 0.0
    for r in rounds:
        sure, n = 1.0, 0
        for i, top in enumerate(r["tops"][:k]):
            sure *= top
            if sure < floors[min(i, len(floors) - 1)]:
                break
            n += 1
        tokens += sum(r["passed"][:n]) + 1
        seconds += t_verify[n] + draft_step * min(n + 1, k)
    return tokens * t_verify[0] / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="an exported EAGLE-3 draft directory")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=21)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--t-verify", type=float, nargs="+", required=True,
                    help="ms of a verify step of 1, 2, ... k + 1 tokens (e.g. a bench report's rows_prices)")
    ap.add_argument("--draft-step", type=float, required=True, help="ms of one draft step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if len(args.t_verify) < args.k + 1:
        ap.error(f"--t-verify needs k + 1 = {args.k + 1} prices")
    torch.set_num_threads(args.threads)

    from draftsmith.bench.costmodel import CostModel, confidence_thresholds
    from draftsmith.bench.measure import bench_prompts
    from draftsmith.drafters import build_proposer
    from draftsmith.models.verifier import load_verifier

    model, tokenizer, _ = load_verifier(args.verifier)
    prompts, _ = bench_prompts(args.dataset, tokenizer, args.num_prompts)
    proposer = build_proposer(args.draft, model, tokenizer)
    with torch.inference_mode():
        rounds = record(model, proposer, prompts, args.k, args.max_new_tokens)

    bins = {}
    for r in rounds:
        if r["tops"]:
            b = min(int(r["tops"][0] * 10), 9)
            n, a = bins.get(b, (0, 0))
            bins[b] = (n + 1, a + r["passed"][0])
    calibration = [{"top": f"{b / 10:.1f}-{(b + 1) / 10:.1f}", "rounds": n, "accepted": a / n}
                   for b, (n, a) in sorted(bins.items())]
    tv = args.t_verify
    costs = CostModel({i + 1: t for i, t in enumerate(tv)}, draft_per_token=args.draft_step)
    auto = confidence_thresholds(costs, args.k)
    rules = {"off": [0.0], "auto " + "/".join(f"{x:.2f}" for x in auto): auto}
    rules.update({f"{x:.2f} at every position": [x] for x in (0.1, 0.2, 0.3, 0.4, 0.5)})
    table = {name: {f"k={k}": replay(rounds, floors, k, tv, args.draft_step) for k in range(1, args.k + 1)}
             for name, floors in rules.items()}

    print(f"{len(rounds)} rounds. First drafted token: acceptance by the draft's top probability")
    for c in calibration:
        print(f"  {c['top']}: {c['rounds']:5d} rounds, accepted {c['accepted']:.2f}")
    print("replayed speedup over plain decoding (step prices as given):")
    for name, row in table.items():
        print(f"  {name:28s} " + "  ".join(f"{k} {s:.3f}x" for k, s in row.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": len(rounds),
                                        "calibration": calibration, "replay": table}, indent=1))


if __name__ == "__main__":
    main()
