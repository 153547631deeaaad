"""The cpp layout's eager step without its small ops: the verifier's norms on the C++ kernel, then each
decoder layer as one C++ call (BENCHMARKS.md 15p).

Inside ``--weight-layout cpp`` (1) a transformers model's Llama-style RMSNorms (probed; not Gemma's)
run as one call of ``draftsmith::rms_norm`` (``models.verifier.CppNorm``) instead of transformers'
``LlamaRMSNorm.forward`` (8 ATen ops in bfloat16) or ``F.rms_norm`` (float32); a SmolLM2-135M step has
61 of them; and (2) each pre-norm layer of an eager step is one ``draftsmith::llama_layer`` call
(``models.lean.LeanDecoder.fused``) instead of the Python loop's ~40 ops, bitwise the same results.
This script builds three eager lean runners over the same weights in the same layout: ``own norms``
(``linears_cpp(model, norms=False)``: the step before both), ``C++ norms`` (the loop, fused layer
off) and ``fused layer`` (the default), and times one-token and 2-token steps at ``--context``
cached tokens in blocks of ``--steps``, the runners alternated block by block for ``--rounds`` rounds
(the order rotates each round), so the host's drift hits all alike. Reported per dtype: the median
step of each, its ratio to ``own norms`` (of medians, and the median of the per-round ratios), and
how far apart their logits are on the same input (the C++ norms add their sums of squares in
another order: within rounding; the fused layer against the loop with C++ norms: bitwise).

    PYTHONPATH=src python benchmarks/cpp_step.py --threads 2 --out benchmarks/results/cpp-step-epyc.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def timed(runner, ids: torch.Tensor, n: int) -> list[float]:
    """``n`` steps over ``ids`` at the runner's cached length, each rolled back after: seconds each."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        runner.forward(ids, 1, ())
        out.append(time.perf_counter() - t)
        runner.rollback(runner.length - ids.shape[0])
    return out


VARIANTS = ("own norms", "C++ norms", "fused layer")


def measure(args: argparse.Namespace, dtype: str) -> dict:
    from draftsmith.decoding.runner import verifier_runner
    from draftsmith.models.verifier import CppNorm, linears_cpp, load_verifier

    model, _, _ = load_verifier(args.verifier, dtype=dtype)
    prompt = torch.randint(100, 10000, (args.context,), generator=torch.Generator().manual_seed(0))
    capacity = args.context + 8
    runners = {}
    with torch.inference_mode():
        with linears_cpp(model, norms=False) as n_off:  # the control: the norms' own forwards, the loop
            runners["own norms"] = verifier_runner(model, capacity)
        with linears_cpp(model) as n_on:
            norms = sum(isinstance(m, CppNorm) for m in model.modules())
            runners["C++ norms"] = verifier_runner(model, capacity)
            runners["C++ norms"].decoder.fused = None  # the loop over the same kernels
            runners["fused layer"] = verifier_runner(model, capacity)
            fused = runners["fused layer"].decoder.fused is not None
            probe = torch.tensor([42, 43])
            logits = {}
            for name, r in runners.items():
                r.forward(prompt, 1, ())
                logits[name] = r.forward(probe, 2, ())[0].float()
                r.rollback(r.length - 2)
            ref = logits["own norms"]
            result: dict = {"dtype": dtype, "linears_switched": n_off, "norms_switched": norms,
                            "layers_switched": n_on, "fused": fused, "logits": {
                                name: {"bitwise_equal_to_own_norms": bool(torch.equal(v, ref)),
                                       "max_rel_diff_to_own_norms": float((v - ref).abs().max() / ref.abs().max()),
                                       "bitwise_equal_to_cpp_norms": bool(torch.equal(v, logits["C++ norms"]))}
                                for name, v in logits.items()}, "steps": {}}
            for m in (1, 2):
                ids = torch.tensor([7] * m)
                for r in runners.values():
                    timed(r, ids, args.steps)  # warm
                per: dict[str, list[float]] = {name: [] for name in runners}
                ratios: dict[str, list[float]] = {name: [] for name in runners}
                for i in range(args.rounds):
                    order = VARIANTS[i % 3:] + VARIANTS[:i % 3]
                    block = {name: statistics.median(timed(runners[name], ids, args.steps)) for name in order}
                    for name, t in block.items():
                        per[name].append(t)
                        ratios[name].append(t / block["own norms"])
                med = {name: statistics.median(v) for name, v in per.items()}
                result["steps"][str(m)] = {
                    "median_ms": {k: 1e3 * v for k, v in med.items()},
                    "ratio_of_medians": {k: v / med["own norms"] for k, v in med.items()},
                    "median_round_ratio": {k: statistics.median(v) for k, v in ratios.items()},
                    "round_ratio_quartiles": {k: statistics.quantiles(v, n=4)[::2] for k, v in ratios.items()}}
                print(f"[{dtype}] {m}-token step, ms (ratio to own norms; median per-round ratio): " + ", ".join(
                    f"{k} {1e3 * med[k]:.2f} ({med[k] / med['own norms']:.3f}; {statistics.median(ratios[k]):.3f})"
                    for k in VARIANTS), flush=True)
        for r in runners.values():
            r.close()
    print(f"[{dtype}] {norms} norms switched, layers fused: {fused}; logits vs own norms: " + ", ".join(
        f"{k} {v['max_rel_diff_to_own_norms']:.1e}" for k, v in result["logits"].items())
        + f"; fused layer bitwise the loop with C++ norms: {result['logits']['fused layer']['bitwise_equal_to_cpp_norms']}",
        flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=10, help="steps per block")
    ap.add_argument("--rounds", type=int, default=30, help="blocks per runner, alternated")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/cpp-step.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from draftsmith.bench.measure import environment

    out = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "environment": environment(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "load_average_start": os.getloadavg(), "results": [measure(args, d) for d in args.dtypes],
           "load_average_end": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
