"""What inductor's C++ wrapper gives a compiled CPU step, against the Python wrapper, side by side.

A compiled step's host code calls its ~300 kernels (SmolLM2-135M) one by one and checks their
arguments; inductor writes it in Python by default, in C++ under ``cpp_wrapper``
(``decoding/runner.CPU_WRAPPER``; ``DRAFTSMITH_COMPILE_WRAPPER=cpp|python``). This loads the verifier
twice (and the draft twice, each bound to its copy), compiles one copy's steps under each wrapper in
one process, and measures, interleaved (the order alternates per repeat or prompt), medians:

1. ``compile``: seconds to compile each copy's steps (the one-token step, the verify candidates of
   lengths 2..k+1, the draft's steps), as ``generate`` reports them;
2. ``steps``: the one-token verifier step at each of ``--contexts`` cached tokens;
3. ``generate``: ``draftsmith.generate(..., compile=True)`` on ``--num-prompts`` MT-Bench prompts,
   plain and with the EAGLE-3 draft (``--draft DIR`` at ``--draft-precision``, else a random draft of
   the verifier's shape; k = ``--num-draft-tokens``, ``--draft-confidence`` floors), tokens per second
   per prompt, tokens identical under both wrappers.

The two copies are the arms ``--wrappers A B`` (loaded and compiled in that order; ratios are B / A):
``python cpp`` measures the C++ wrapper, ``cpp python`` the same with the load order swapped, and
``python python`` is the negative control (two copies alike: ratios ~1, whatever the second copy's
memory placement does).

    PYTHONPATH=src python benchmarks/compile_wrapper.py --threads 2 --draft DRAFT_DIR \\
        --out benchmarks/results/compile-wrapper-spr.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="an EAGLE-3 draft directory (default: random weights)")
    ap.add_argument("--draft-precision", default="int8", choices=["as-loaded", "int8"])
    ap.add_argument("--draft-confidence", type=float, nargs="+", default=[0.0],
                    help="the draft's stop floors per position (0: drafts k every round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 448],
                    help="cached tokens of the timed steps (past 447 the cache is a new shape: one more compile)")
    ap.add_argument("--step-repeats", type=int, default=15, help="interleaved repeats of 40 steps each")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=2)
    ap.add_argument("--wrappers", nargs=2, default=["python", "cpp"], choices=["python", "cpp"],
                    help="the two arms' wrappers, in load order (ratios: the second over the first)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    arms = tuple(f"{i}:{w}" for i, w in enumerate(args.wrappers))
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lean_engine import eagle3_draft

    from draftsmith.data.sources import eval_set
    from draftsmith.decoding.engine import generate
    from draftsmith.decoding.proposers import Eagle3Proposer
    from draftsmith.decoding.runner import _COMPILED, verifier_runner
    from draftsmith.models.quantize import quantize_draft
    from draftsmith.models.verifier import load_verifier

    def load():
        model, tok, fp = load_verifier(args.verifier, dtype="float32", device="cpu")
        if args.draft:
            from draftsmith.drafters import load_draft

            proposer = load_draft(args.draft, model, precision=args.draft_precision)
        else:
            torch.manual_seed(0)  # both arms draw the same random draft
            draft = eagle3_draft(model, 32000)
            proposer = Eagle3Proposer(quantize_draft(draft, args.draft_precision))
        proposer.min_confidence = args.draft_confidence
        return model, tok, fp, proposer

    k = args.num_draft_tokens
    setups: dict = {}
    for arm in arms:
        model, tok, fp, proposer = load()
        setups[arm] = (model, proposer)
    prompts = [ids for _, ids in eval_set("mt-bench", tok, limit=args.num_prompts + 1)]
    out: dict = {"verifier": f"{args.verifier} ({fp})", "draft": args.draft or "random (vocab 32000)",
                 "threads": args.threads, "torch": torch.__version__,
                 "cpu": platform.processor() or platform.machine(), "load_avg": os.getloadavg(),
                 "args": {a: str(v) for a, v in vars(args).items()}, "compile_seconds": {}, "steps": {},
                 "generate": {}}
    with torch.inference_mode():
        for w, (model, proposer) in setups.items():  # each copy's graphs compiled under its wrapper
            os.environ["DRAFTSMITH_COMPILE_WRAPPER"] = w.split(":")[1]
            t = time.perf_counter()
            a = generate(model, prompts[0], proposer=proposer, max_new_tokens=16, num_draft_tokens=k, compile=True)
            b = generate(model, prompts[0], max_new_tokens=16, compile=True)
            step = _COMPILED[model]
            out["compile_seconds"][w] = {"reported": a.stats["compile_seconds"] + b.stats["compile_seconds"],
                                         "wall": time.perf_counter() - t,
                                         "options": {"one-token": step.fn.options,
                                                     "draft": proposer._compiled.options if proposer._compiled else None},
                                         "verify_tiers": a.stats["verify_tiers"]}
            print(f"[compile] {w}: {out['compile_seconds'][w]['reported']:.1f} s "
                  f"(one-token step's options {step.fn.options})", flush=True)
        os.environ.pop("DRAFTSMITH_COMPILE_WRAPPER", None)

        # 2. the one-token step at each context length
        ids = torch.tensor([5])
        capacity = max(args.contexts) + 1
        for ctx in args.contexts:
            runners = {w: verifier_runner(m, capacity, compile=True, warmup_shapes=(1,)) for w, (m, _) in setups.items()}
            for r in runners.values():
                r.forward(torch.arange(ctx) % 1000 + 10, 1)
            times: dict[str, list[float]] = {w: [] for w in arms}
            for rep in range(args.step_repeats):
                for w in (arms if rep % 2 == 0 else arms[::-1]):
                    r = runners[w]
                    t = time.perf_counter()
                    for _ in range(40):
                        r.forward(ids, 1)
                        r.rollback(ctx)
                    times[w].append((time.perf_counter() - t) / 40 * 1e3)
            for r in runners.values():
                r.close()
            ratio = statistics.median(b / a for a, b in zip(times[arms[0]], times[arms[1]]))
            out["steps"][ctx] = {"ms": times, "median_ms": {w: statistics.median(v) for w, v in times.items()},
                                 "second_over_first": ratio}
            print(f"[step] {ctx} cached: " + ", ".join(f"{w} {statistics.median(times[w]):.2f} ms" for w in arms)
                  + f"; {arms[1]} / {arms[0]} per repeat {ratio:.4f}", flush=True)

        # 3. generate, plain and with the draft
        rows = ("plain", f"eagle3 k={k}")
        tps: dict = {(w, row): [] for w in arms for row in rows}
        identical = True
        for i, ids in enumerate(prompts[1:]):
            tokens = {}
            for row in rows:
                for w in (arms if i % 2 == 0 else arms[::-1]):
                    model, proposer = setups[w]
                    r = generate(model, ids, proposer=proposer if row != "plain" else None,
                                 max_new_tokens=args.max_new_tokens, num_draft_tokens=k, compile=True)
                    tps[(w, row)].append(r.stats["tokens_per_second"])
                    tokens[(w, row)] = r.token_ids
            identical &= len({tuple(v) for v in tokens.values()}) == 1
            print(f"[generate] prompt {i}: " + ", ".join(f"{w}/{row} {v[-1]:.2f}" for (w, row), v in tps.items()),
                  flush=True)
        for row in rows:
            ratios = [b / a for a, b in zip(tps[(arms[0], row)], tps[(arms[1], row)])]
            out["generate"][row] = {"tokens_per_second": {w: tps[(w, row)] for w in arms},
                                    "second_over_first_per_prompt": ratios,
                                    "median": statistics.median(ratios), "faster_prompts": sum(r > 1 for r in ratios)}
            print(f"[generate] {row}: {arms[1]} / {arms[0]} tok/s, per-prompt median {statistics.median(ratios):.4f} "
                  f"(faster on {sum(r > 1 for r in ratios)}/{len(ratios)})", flush=True)
        out["identical"] = identical
        print(f"tokens identical in both arms: {identical}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
