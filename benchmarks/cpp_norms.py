"""The cpp layout's verifier norms on the C++ kernel, against their own forwards (BENCHMARKS.md 15p).

Inside ``--weight-layout cpp`` a transformers model's Llama-style RMSNorms (probed; not Gemma's) run
as one call of ``draftsmith::rms_norm`` (``models.verifier.CppNorm``) instead of transformers'
``LlamaRMSNorm.forward`` (8 ATen ops in bfloat16) or ``F.rms_norm`` (float32). A SmolLM2-135M step
has 61 of them. This script builds two eager lean runners over the same weights in the same layout,
one with the norms switched (``linears_cpp(model)``) and one without (``linears_cpp(model,
norms=False)``), and times one-token and 2-token steps at ``--context`` cached tokens in blocks of
``--steps``, the two runners alternated block by block for ``--rounds`` rounds (the order flips each
round), so the host's drift hits both alike. Reported per dtype: the median step of each, the ratio
of medians, the median of the per-round ratios, and how far apart their logits are on the same input
(max |diff| over max |logit|; the switched norms add their sums of squares in another order).

    PYTHONPATH=src python benchmarks/cpp_norms.py --threads 2 --out benchmarks/results/cpp-norms-epyc.json
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


def measure(args: argparse.Namespace, dtype: str) -> dict:
    from draftsmith.decoding.runner import verifier_runner
    from draftsmith.models.verifier import CppNorm, linears_cpp, load_verifier

    model, _, _ = load_verifier(args.verifier, dtype=dtype)
    prompt = torch.randint(100, 10000, (args.context,), generator=torch.Generator().manual_seed(0))
    capacity = args.context + 8
    runners = {}
    with torch.inference_mode():
        with linears_cpp(model, norms=False) as n_off:  # the control: the norms' own forwards
            runners["own forward"] = verifier_runner(model, capacity)
            runners["own forward"].forward(prompt, 1, ())
        with linears_cpp(model) as n_on:
            norms = sum(isinstance(m, CppNorm) for m in model.modules())
            runners["C++ kernel"] = verifier_runner(model, capacity)
            runners["C++ kernel"].forward(prompt, 1, ())
            probe = torch.tensor([42, 43])
            logits = {}
            for name, r in runners.items():
                logits[name] = r.forward(probe, 2, ())[0].float()
                r.rollback(r.length - 2)
            ref = logits["own forward"]
            rel = float((logits["C++ kernel"] - ref).abs().max() / ref.abs().max())
            result: dict = {"dtype": dtype, "linears_switched": n_off, "norms_switched": norms,
                            "layers_switched": n_on, "logits_bitwise_equal": bool(torch.equal(logits["C++ kernel"], ref)),
                            "logits_max_rel_diff": rel, "steps": {}}
            for m in (1, 2):
                ids = torch.tensor([7] * m)
                for r in runners.values():
                    timed(r, ids, args.steps)  # warm
                per: dict[str, list[float]] = {name: [] for name in runners}
                ratios = []
                for i in range(args.rounds):
                    order = list(runners) if i % 2 == 0 else list(reversed(runners))
                    block = {name: statistics.median(timed(runners[name], ids, args.steps)) for name in order}
                    for name, t in block.items():
                        per[name].append(t)
                    ratios.append(block["C++ kernel"] / block["own forward"])
                med = {name: statistics.median(v) for name, v in per.items()}
                result["steps"][str(m)] = {"median_ms": {k: 1e3 * v for k, v in med.items()},
                                           "ratio_of_medians": med["C++ kernel"] / med["own forward"],
                                           "median_round_ratio": statistics.median(ratios),
                                           "round_ratio_iqr": statistics.quantiles(ratios, n=4)[::2]}
                print(f"[{dtype}] {m}-token step: own forward {1e3 * med['own forward']:.2f} ms, C++ norms "
                      f"{1e3 * med['C++ kernel']:.2f} ms ({med['C++ kernel'] / med['own forward']:.3f}x; per round "
                      f"{statistics.median(ratios):.3f}x)", flush=True)
        for r in runners.values():
            r.close()
    print(f"[{dtype}] {norms} norms switched; logits {'bitwise equal' if result['logits_bitwise_equal'] else 'differ'}"
          f" (max |diff| / max |logit| {rel:.2e})", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=10, help="steps per block")
    ap.add_argument("--rounds", type=int, default=30, help="blocks per runner, alternated")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/cpp-norms.json"))
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
