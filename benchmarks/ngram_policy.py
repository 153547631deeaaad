"""Replay prompt-lookup draft-length policies offline (issue 2): how the adaptive length was chosen.

Greedy decoding is deterministic, so how many tokens of any draft the verifier accepts
follows from the greedy output alone. This script decodes MT-Bench first turns once,
measures the verifier's T_verify(n) on this machine, then replays drafting policies over
the recorded outputs and prices each round at T_verify(drafted + 1):
predicted speedup over plain decoding = tokens * T(1) / sum of round costs. No timing noise
between policies; the real measurement of the chosen policy is ``benchmarks/engine.py``.

Policies: ``hf`` (HF prompt lookup: n-grams 2..1, first match, k tokens on every match),
``fixed`` (our NgramProposer with adaptive=False), ``hf-schedule`` (ours, k +2 after a full
accept, -1 after a rejection: transformers' "heuristic" schedule for assistant models) and
``adaptive`` (our NgramProposer default: cap n + 1 after a rejection, doubled after a full accept).

Usage::

    PYTHONPATH=src python benchmarks/ngram_policy.py --num-prompts 10 --num-draft-tokens 10 \\
        --out benchmarks/results/ngram-policy-smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def hf_lookup(seq: list[int], k: int, max_ngram: int = 2) -> list[int]:
    """transformers' prompt lookup: the first earlier occurrence of the last n tokens."""
    T = len(seq)
    for n in range(max_ngram, 0, -1):
        suffix = seq[T - n:]
        for i in range(0, T - n):
            if seq[i:i + n] == suffix:
                return seq[i + n:min(i + n + k, T)]
    return []


def replay(prompt: list[int], out: list[int], t_verify: dict[int, float], propose, schedule: str,
           k_max: int) -> float:
    """Predicted speedup of one policy on one recorded greedy output."""
    seq, pos, cost, cap = list(prompt) + [out[0]], 1, 0.0, k_max
    while pos < len(out):
        k = min(cap, len(out) - pos)
        draft = propose(seq, k)
        n = 0
        while n < len(draft) and pos + n < len(out) and draft[n] == out[pos + n]:
            n += 1
        cost += t_verify[len(draft) + 1]
        seq += out[pos:pos + n + 1]
        pos += n + 1
        if draft and schedule == "hf-schedule":
            cap = min(k_max, cap + 2) if n == len(draft) else max(1, cap - 1)
    return len(out) * t_verify[1] / cost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ngram-policy.json"))
    args = ap.parse_args(argv)

    import torch

    from draftsmith.bench.measure import load_eval_prompts, measure_verify_costs
    from draftsmith.decoding.engine import generate
    from draftsmith.decoding.proposers import DraftContext, NgramProposer
    from draftsmith.decoding.sampling import SamplingParams
    from draftsmith.models.verifier import load_verifier

    model, tokenizer, fp = load_verifier(args.verifier, dtype="float32")
    prompts = load_eval_prompts("mt-bench", tokenizer, args.num_prompts)
    outs = [(pid, ids, generate(model, ids, max_new_tokens=args.max_new_tokens).token_ids) for pid, ids in prompts]
    context = prompts[0][1] + outs[0][2][: args.max_new_tokens // 2]
    t_verify = measure_verify_costs(model, context, range(1, args.num_draft_tokens + 2))

    def ours(adaptive: bool):
        prop = NgramProposer(adaptive=adaptive)  # fresh per replayed output: no state carries over

        def propose(seq: list[int], k: int) -> list[int]:
            return prop.propose(DraftContext(torch.tensor(seq)), k, SamplingParams(), None).tokens.tolist()
        return propose

    policies = {"hf": lambda: (hf_lookup, "fixed"), "fixed": lambda: (ours(False), "fixed"),
                "hf-schedule": lambda: (ours(False), "hf-schedule"), "adaptive": lambda: (ours(True), "fixed")}
    result = {"verifier": {"spec": args.verifier, "fingerprint": fp}, "num_draft_tokens": args.num_draft_tokens,
              "t_verify_seconds": t_verify, "predicted_speedup_vs_plain": {}}
    for name, make in policies.items():
        speedups = []
        for _, ids, out in outs:
            propose, schedule = make()
            speedups.append(replay(ids, out, t_verify, propose, schedule, args.num_draft_tokens))
        result["predicted_speedup_vs_plain"][name] = speedups
    hf = result["predicted_speedup_vs_plain"]["hf"]
    print("T_verify(n)/T(1): " + " ".join(f"{n}:{t / t_verify[1]:.2f}" for n, t in t_verify.items()))
    for name, v in result["predicted_speedup_vs_plain"].items():
        rel = [a / b for a, b in zip(v, hf)]
        print(f"  {name:12s} vs plain: median {statistics.median(v):.3f} (min {min(v):.2f})   "
              f"vs hf: median {statistics.median(rel):.3f} (min {min(rel):.2f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
