"""Where a speculative round's time goes, against what the cost model prices (issue 20's per-round overhead).

BENCHMARKS.md 9s measured a compiled EAGLE-3 round at k = 2 ~1.5-2 ms (7-9% of a step) dearer
than the cost model's ``T_verify(k+1) + T_draft(k)``. This decodes prompts with an EAGLE-3 draft
(``--draft DIR``, or a random one of the verifier's shape: the overhead does not need a trained
draft, though the first draft step's length, n + 1 after n accepted, does follow acceptance) and
splits every round's wall time into:

- ``verify``: the verifier's forward of k + 1 tokens (with the aux hidden states the draft reads),
  of which ``verify.graph`` is the compiled graph's call itself;
- ``propose``: the drafter's whole call, of which ``propose.steps`` is its draft steps (``_step``)
  and ``propose.graph`` the compiled graphs' calls;
- ``loop``: the rest, the engine's own work between them (the accept decision and its host sync,
  rollback, bookkeeping).

Beside it two price lists: the bare table (``measure.measure_verify_costs``: each verify length
timed alone, no aux states), which the bench priced rounds with until BENCHMARKS 9w, and the
prices ``draftsmith bench`` uses since (``BenchState.drafter_costs``: ``T(1)`` from a plain
decode's steps, ``T_verify(n)`` from the drafter's own decodes, ``costmodel.in_situ_prices``),
both with ``measure_draft_costs``' propose prices, and the plain loop's time per token against both.

    PYTHONPATH=src python benchmarks/round_overhead.py --threads 2 --compile --ks 1 2 \
        --out benchmarks/results/round-overhead-spr.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lean_engine import eagle3_draft  # noqa: E402


class Clock:
    """Accumulates wall seconds per label while :attr:`on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)
        clock = self

        def timed(*a, **kw):
            if not clock.on:
                return inner(*a, **kw)
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                clock.seconds[label] += time.perf_counter() - t
                clock.calls[label] += 1

        setattr(owner, name, timed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="an EAGLE-3 draft directory (default: random weights)")
    ap.add_argument("--draft-precision", default="as-loaded", choices=["as-loaded", "int8"])
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary of the random draft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import draftsmith.decoding.runner as runner_mod
    from draftsmith.bench.costmodel import in_situ_prices
    from draftsmith.bench.measure import measure_draft_costs, measure_plain_steps, measure_verify_costs
    from draftsmith.data.sources import eval_set
    from draftsmith.decoding.engine import generate
    from draftsmith.decoding.proposers import Eagle3Proposer
    from draftsmith.models.verifier import load_verifier

    model, tok, fp = load_verifier(args.verifier, dtype="float32", device="cpu")
    if args.draft:
        from draftsmith.drafters import load_draft

        proposer = load_draft(args.draft, model, precision=args.draft_precision)
    else:
        draft = eagle3_draft(model, args.draft_vocab)
        if args.draft_precision == "int8":
            from draftsmith.models.quantize import quantize_draft

            draft = quantize_draft(draft, "int8")
        proposer = Eagle3Proposer(draft)
    prompts = [ids for _, ids in eval_set("mt-bench", tok, limit=args.num_prompts)]

    clock = Clock()
    clock.wrap(runner_mod.LeanRunner, "forward", "verifier.forward")
    clock.wrap(runner_mod._CompiledStep, "__call__", "verify.compiled_step")
    clock.wrap(runner_mod.CompiledFn, "_run", "graph")
    clock.wrap(Eagle3Proposer, "propose", "propose")
    clock.wrap(Eagle3Proposer, "_step", "propose.steps")

    out: dict = {"verifier": f"{args.verifier} ({fp})", "draft": args.draft or f"random (vocab {args.draft_vocab})",
                 "draft_precision": args.draft_precision, "compile": args.compile, "threads": args.threads,
                 "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": {}}
    with torch.inference_mode():
        # warm everything (compile) outside the clock
        for k in args.ks:
            generate(model, prompts[0], proposer=proposer, max_new_tokens=8, num_draft_tokens=k, compile=args.compile)
        generate(model, prompts[0], max_new_tokens=8, compile=args.compile)
        print("[warm] every step compiled; measuring", flush=True)
        ctx = list(prompts[0]) + [int(t) for t in generate(model, prompts[0], max_new_tokens=64,
                                                               compile=args.compile).token_ids]
        prices_verify = measure_verify_costs(model, ctx, sorted({1, *(k + 1 for k in args.ks)}), compile=args.compile)
        plain_steps = measure_plain_steps(model, prompts[0], 96, 0.0, 0, compile=args.compile)
        seen: dict[int, list[float]] = {}
        prices_draft = measure_draft_costs(model, proposer, prompts[0], args.ks, 96, 0.0, 0, compile=args.compile,
                                           verify_seconds=seen)
        plain_steps += measure_plain_steps(model, prompts[0], 96, 0.0, 0, compile=args.compile)
        in_situ = in_situ_prices(prices_verify, plain_steps, seen)
        out["priced_ms"] = {"verify": {n: 1e3 * s for n, s in prices_verify.items()},
                            "verify_in_situ": {n: 1e3 * s for n, s in in_situ.items()},
                            "draft": {k: 1e3 * s for k, s in prices_draft.items()}}
        rows = [("plain", None)] + [(f"eagle3 k={k}", k) for k in args.ks]
        for label, k in rows:
            clock.seconds.clear()
            clock.calls.clear()
            wall = prefill = 0.0
            rounds = tokens = 0
            for ids in prompts:
                clock.on = True
                res = generate(model, ids, proposer=proposer if k else None, max_new_tokens=args.max_new_tokens,
                               num_draft_tokens=k or 1, compile=args.compile)
                clock.on = False
                st = res.stats
                wall += st["seconds"]
                prefill += st["prefill_seconds"]
                rounds += st["verifier_forwards"] - 1
                tokens += st["new_tokens"]
            s = dict(clock.seconds)
            n_rounds = max(rounds, 1)
            verify_s = s.get("verifier.forward", 0.0)
            # the prefill is one verifier.forward call too: take it out
            verify_s -= prefill
            propose_s = s.get("propose", 0.0)
            steps_s = s.get("propose.steps", 0.0)
            graph_s = s.get("graph", 0.0)
            row = {
                "rounds": rounds, "new_tokens": tokens, "tokens_per_round": tokens / n_rounds,
                "ms_per_round": 1e3 * (wall - prefill) / n_rounds,
                "verify_ms": 1e3 * verify_s / n_rounds,
                "verify_compiled_step_ms": 1e3 * s.get("verify.compiled_step", 0.0) / n_rounds,
                "propose_ms": 1e3 * propose_s / n_rounds,
                "propose_steps_ms": 1e3 * steps_s / n_rounds,
                "graph_ms_all": 1e3 * graph_s / n_rounds,
                "loop_ms": 1e3 * (wall - prefill - verify_s - propose_s) / n_rounds,
            }
            if k:
                row["priced_round_ms"] = 1e3 * (prices_verify[k + 1] + prices_draft[k])
                row["priced_in_situ_round_ms"] = 1e3 * (in_situ[k + 1] + prices_draft[k])
                row["acceptance_length"] = tokens / n_rounds
            else:
                row["priced_round_ms"] = 1e3 * prices_verify[1]
                row["priced_in_situ_round_ms"] = 1e3 * in_situ[1]
            row["unpriced_ms"] = row["ms_per_round"] - row["priced_round_ms"]
            row["unpriced_in_situ_ms"] = row["ms_per_round"] - row["priced_in_situ_round_ms"]
            out["rows"][label] = row
            print(f"[{label:10s}] round {row['ms_per_round']:.2f} ms (priced bare {row['priced_round_ms']:.2f}, "
                  f"unpriced {row['unpriced_ms']:+.2f}; in situ {row['priced_in_situ_round_ms']:.2f}, "
                  f"unpriced {row['unpriced_in_situ_ms']:+.2f}) = verify {row['verify_ms']:.2f} "
                  f"(compiled step {row['verify_compiled_step_ms']:.2f}) + propose {row['propose_ms']:.2f} "
                  f"(steps {row['propose_steps_ms']:.2f}) + loop {row['loop_ms']:.2f}; graphs {row['graph_ms_all']:.2f}; "
                  f"{row['tokens_per_round']:.2f} tok/round", flush=True)
    print("priced (ms): bare verify " + ", ".join(f"T({n}) {v:.2f}" for n, v in out["priced_ms"]["verify"].items())
          + "; in situ " + ", ".join(f"T({n}) {v:.2f}" for n, v in out["priced_ms"]["verify_in_situ"].items())
          + "; draft " + ", ".join(f"k={k} {v:.2f}" for k, v in out["priced_ms"]["draft"].items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
