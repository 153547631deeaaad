"""Confidence-gated drafting, predicted offline: which gate tau and cap k pay most on this machine?

A gated EAGLE-3 proposer stops drafting at the first step whose top draft
probability is below ``tau`` (it may draft nothing at all). Low-confidence draft
tokens are mostly rejected, and each one costs a draft step and a wider
verification, so a gate can buy a longer cap k at the cost of a few lost
accepts. This script scores every (tau, k) on the teacher-forced MT-Bench cache
of ``heldout_acceptance.py``: per position it runs the draft's k steps, takes
the confidence and correctness of each, and applies the gate. With the costs a
``draftsmith bench`` report measured (T(1), T_verify(n), the draft's fixed and
per-token cost) it predicts the speedup of each policy:

    speedup = T(1) * E[1 + accepted] / E[T_verify(drafted + 1) + draft cost]

Teacher forcing feeds the true token after a wrong guess, so the confidence of
the steps after a first miss (they decide how much gets verified in vain) is an
approximation. Only a gated proposer run by ``draftsmith bench`` would measure the real thing;
none is built, because the best gate predicted here gains about 1% (BENCHMARKS.md section 4).

    PYTHONPATH=src python benchmarks/confidence_gate.py --cache runs/eval-mtbench \
        --draft runs/more-h-fresh11k-v20k/draft --costs benchmarks/results/bench-eagle3-v20k/report.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def chains(draft, samples: list[dict], k: int):
    """Per counted position: confidences ``[N, k]`` and correctness ``[N, k]`` of the k teacher-forced steps."""
    import torch

    from draftsmith.train.loop import chain_mask
    from draftsmith.train.loss import shift_left
    from heldout_acceptance import draft_steps

    confs, oks = [], []
    for b, logits in draft_steps(draft, samples, k):
        full = chain_mask(b, k)
        c = torch.stack([lg.float().softmax(-1).amax(-1) for lg in logits], -1)  # [1, L, k]
        ok = torch.stack([draft.draft_to_target[lg.argmax(-1)] == shift_left(b.next_tokens, j, fill=-1)
                          for j, lg in enumerate(logits)], -1)
        confs.append(c[full])
        oks.append(ok[full])
    return torch.cat(confs), torch.cat(oks)


def policy(conf, ok, tau: float, k: int):
    """Mean drafted tokens, mean accepted tokens and mean draft steps run, per round, of gate ``tau`` and cap ``k``."""
    import torch

    conf, ok = conf[:, :k], ok[:, :k]
    passed = torch.cumprod((conf >= tau).long(), -1)  # step j drafted iff steps 0..j all passed the gate
    drafted = passed.sum(-1)
    accepted = torch.cumprod((ok & passed.bool()).long(), -1).sum(-1)
    steps = torch.clamp(drafted + 1, max=k)  # the step that fails the gate was run too (unless the cap stopped it)
    return drafted, accepted, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft", type=Path, required=True, help="EAGLE-3 draft directory")
    ap.add_argument("--cache", type=Path, required=True, help="heldout_acceptance.py's cache (replies + states)")
    ap.add_argument("--costs", type=Path, required=True, help="a draftsmith bench report.json with measured costs")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--tau", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    from draftsmith.data.shards import load_shards
    from draftsmith.models.speculators import read_draft
    from draftsmith.models.verifier import load_verifier

    torch.set_num_threads(args.threads)
    report = json.loads(args.costs.read_text())
    costs = report["costs"]
    t1 = costs["t1_seconds"]
    tv = {int(n): s for n, s in costs["t_verify_seconds"].items()}
    be = next(iter(report["break_even"].values()))
    d_fixed, d_tok = be["draft_fixed_seconds"], be["draft_per_token_seconds"]
    kmax = max(args.k)
    if kmax + 1 > max(tv):
        raise SystemExit(f"--costs measured T_verify up to {max(tv)} tokens; k up to {max(tv) - 1} only")

    _, _, fingerprint = load_verifier(args.verifier, dtype="float32")
    samples = list(load_shards(args.cache / "shards", fingerprint))
    draft = read_draft(str(args.draft), device="cpu", dtype=torch.float32).eval()
    conf, ok = chains(draft, samples, kmax)
    rows = []
    for k in args.k:
        for tau in args.tau:
            drafted, accepted, steps = policy(conf, ok, tau, k)
            tv_mean = sum(tv[int(n) + 1] for n in drafted.tolist()) / len(drafted)
            cost = tv_mean + d_fixed + d_tok * float(steps.float().mean())
            tokens = 1 + float(accepted.float().mean())
            rows.append({"k": k, "tau": tau, "tokens_per_round": tokens,
                         "drafted_per_round": float(drafted.float().mean()),
                         "seconds_per_round": cost, "predicted_speedup": tokens * t1 / cost})
    best = max(rows, key=lambda r: r["predicted_speedup"])
    print(f"{args.draft}: {conf.shape[0]} positions; T(1) = {t1 * 1e3:.1f} ms")
    print("k  tau   tokens/round drafted/round predicted speedup")
    for r in rows:
        mark = "  <- best" if r is best else ""
        print(f"{r['k']}  {r['tau']:.2f}  {r['tokens_per_round']:.3f}        {r['drafted_per_round']:.2f}"
              f"          {r['predicted_speedup']:.3f}x{mark}")
    if args.out:
        args.out.write_text(json.dumps({"command": "benchmarks/confidence_gate.py", "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "verifier_fingerprint": fingerprint, "positions": conf.shape[0], "rows": rows, "best": best}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
