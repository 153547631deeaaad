"""What dynamo's guard check costs a compiled step, and what skipping it on seen signatures gives back.

``decoding/runner.CompiledFn`` checks every guard of a compiled step on the first call of each call
signature (shapes, strides, offsets, dtypes, caches, autograd mode) and, on its repeats, only the
guards that tell the step's graphs apart (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``;
``DRAFTSMITH_COMPILE_GUARDS``). This probe runs each measurement both ways, side by side in one
process (the shared ``CompiledFn``'s ``skip_guards`` switched per call), interleaved, medians:

1. ``steps``: the compiled one-token verifier step at each of ``--contexts`` cached tokens, and the
   compiled EAGLE-3 draft step (a random draft shaped for the verifier, as loaded and int8) at
   ``--contexts[0]``, each a chain of ``--draft-chain`` steps after a verifier step;
2. ``generate``: ``draftsmith.generate(..., compile=True)`` on ``--num-prompts`` MT-Bench prompts,
   plain and with the int8 random draft (k = ``--num-draft-tokens``: a round's cost, whatever it
   accepts), tokens per second, tokens identical both ways.

    PYTHONPATH=src python benchmarks/compile_guards.py --threads 2 --out benchmarks/results/compile-guards.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--step-repeats", type=int, default=60)
    ap.add_argument("--draft-chain", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-draft-tokens", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts in `generate`")
    ap.add_argument("--sections", nargs="+", default=["steps", "generate"], choices=["steps", "generate"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lean_engine import eagle3_draft

    from draftsmith.decoding.proposers import Eagle3Proposer
    from draftsmith.decoding.runner import _COMPILED, verifier_runner
    from draftsmith.models.quantize import quantize_draft
    from draftsmith.models.verifier import load_verifier

    model, tok, fp = load_verifier(args.verifier, dtype="float32", device="cpu")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict = {"verifier": f"{args.verifier} ({fp})", "threads": args.threads, "torch": torch.__version__,
                 "cpu": platform.processor() or platform.machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    t_start = time.time()
    draft = eagle3_draft(model, min(args.draft_vocab, V))
    drafts = {"as-loaded": draft, "int8": quantize_draft(draft, "int8")}
    modes = {"full": False, "skip": True}

    if "steps" in args.sections:
        with torch.inference_mode():
            runners = {}
            for C in args.contexts:
                r = verifier_runner(model, C + 8, compile=True, warmup_shapes=(1,), role=f"guards-{C}")
                r.forward(torch.randint(2, V, (C,), generator=g), 1)
                runners[C] = r
            step_fn = _COMPILED[model].fn
            C0 = args.contexts[0]
            props = {}
            for name, d in drafts.items():
                p = Eagle3Proposer(d)
                p.prepare(C0 + 8, compile=True)
                p._step(torch.randint(2, V, (1, C0), generator=g), torch.randn(1, C0, d.config.hidden_size, generator=g),
                        torch.arange(1, C0 + 1)[None])
                props[name] = p
            tok1 = torch.randint(2, V, (1,), generator=g)
            keys = [(f"verifier@{C}", m) for C in args.contexts for m in modes] + \
                   [(f"draft-{n}", m) for n in props for m in modes]
            times: dict = {k: [] for k in keys}
            for rep in range(args.step_repeats + 2):
                shift = rep % len(keys)
                for key in keys[shift:] + keys[:shift]:
                    what, mode = key
                    step_fn.skip_guards = modes[mode]
                    if what.startswith("verifier@"):
                        C = int(what.split("@")[1])
                        t0 = time.perf_counter()
                        runners[C].forward(tok1, 1)
                        dt = time.perf_counter() - t0
                        runners[C].rollback(C)
                    else:
                        runners[C0].forward(tok1, 1)  # a round starts after a verifier step
                        runners[C0].rollback(C0)
                        p = props[what.removeprefix("draft-")]
                        p._compiled.skip_guards = modes[mode]
                        h = torch.randn(1, 1, p.draft.config.hidden_size, generator=g)
                        t, chain = tok1, []
                        for i in range(args.draft_chain):
                            t0 = time.perf_counter()
                            logits, h = p._step(t.reshape(1, 1), h, torch.tensor([[C0 + 1 + i]]))
                            t = logits[0, -1].argmax()
                            h = h[:, -1:]
                            chain.append(time.perf_counter() - t0)
                        dt = statistics.fmean(chain)
                        p.cache.rollback(C0)
                    if rep >= 2:
                        times[key].append(dt)
            med = {f"{w}/{m}": 1e3 * statistics.median(v) for (w, m), v in times.items()}
            res = {"median_ms": med, "repeats": args.step_repeats,
                   "skip_over_full": {w: med[f"{w}/skip"] / med[f"{w}/full"] for w, _ in keys[::2]}}
            if len(args.contexts) > 1:
                hi, lo = args.contexts[-1], args.contexts[0]
                res["context_curve"] = {m: med[f"verifier@{hi}/{m}"] / med[f"verifier@{lo}/{m}"] for m in modes}
            res["draft_over_verifier"] = {f"{n}/{m}": med[f"draft-{n}/{m}"] / med[f"verifier@{C0}/{m}"]
                                          for n in props for m in modes}
            out["steps"] = res
            print(json.dumps(res, indent=1), flush=True)

    if "generate" in args.sections:
        from draftsmith import generate
        from draftsmith.data.sources import eval_set

        prompts = [ids for _, ids in eval_set("mt-bench", tok, limit=args.num_prompts)]
        prop = Eagle3Proposer(drafts["int8"])
        rows = {"plain": None, "eagle3-int8": prop}
        tps: dict = {(r, m): [[] for _ in prompts] for r in rows for m in modes}
        toks: dict = {}
        for r, pr in rows.items():  # compile every graph the rows need, once, before timing
            for ids in prompts:
                generate(model, ids, proposer=pr, max_new_tokens=args.max_new_tokens,
                         num_draft_tokens=args.num_draft_tokens, compile=True)
        keys = list(tps)
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                shift = (rep * len(prompts) + i) % len(keys)
                for key in keys[shift:] + keys[:shift]:
                    r, m = key
                    _COMPILED[model].fn.skip_guards = modes[m]
                    if prop._compiled is not None:
                        prop._compiled.skip_guards = modes[m]
                    t0 = time.perf_counter()
                    o = generate(model, ids, proposer=rows[r], max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=args.num_draft_tokens, compile=True)
                    tps[key][i].append(len(o.token_ids) / (time.perf_counter() - t0))
                    toks.setdefault((r, i), o.token_ids)
                    assert toks[(r, i)] == o.token_ids, (key, i)
                print(f"  generate: rep {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompts)}", file=sys.stderr)
        per = {f"{r}/{m}": [statistics.median(v) for v in tps[(r, m)]] for r, m in keys}
        ratio = {r: statistics.median(a / b for a, b in zip(per[f"{r}/skip"], per[f"{r}/full"])) for r in rows}
        ratio["eagle3-int8 / plain (skip)"] = statistics.median(
            a / b for a, b in zip(per["eagle3-int8/skip"], per["plain/skip"]))
        res = {"tokens_per_second_median": {k: statistics.median(v) for k, v in per.items()},
               "skip_over_full_per_prompt_median": ratio, "identical_both_ways": "asserted per call",
               "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
        out["generate"] = res
        print(json.dumps(res, indent=1), flush=True)

    out["seconds"] = time.time() - t_start
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
