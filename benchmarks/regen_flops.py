"""Regeneration throughput against the FLOP bound of a plain matmul, per batch size (issue 18).

The data step regenerates replies with the verifier in left-padded batches
(``draftsmith.data.regenerate``). This times it at several batch sizes on the same
ShareGPT prompts, with each of ``generate_batch``'s engines side by side (``lean``:
our batched forward over a preallocated cache, continuous batching within a chunk of
``--chunk-batches`` batches; ``lean-c1`` is a chunk of one batch, so no row is refilled:
static batching; ``hf``: ``transformers.generate`` per batch), and counts how many replies
the engines agree on; and beside it, in the same run, the verifier's own linear layers
as bare matmuls (``F.linear`` on every weight shape, ``M`` rows): the FLOP rate the
hardware gives these shapes with nothing else around them.

- useful FLOPs of a regeneration: ``2 * P * (prompt tokens + reply tokens)``, with P the
  parameters of the verifier's linear layers (lm_head included); padding and the
  finished rows a batch keeps decoding are not counted (they are the batch's waste);
- the bound at batch size B: the seconds those FLOPs take as bare matmuls, the prompt
  tokens at the matmul rate of a prefill's shape (``M = B x mean prompt length``, at
  most 4096 rows) and the reply tokens at the rate of a decode step's (``M = B``);
- reported: reply tokens/s, useful FLOP/s, and bound seconds / measured seconds (the
  fraction of the bound reached; target >= 0.5).

To measure what a CPU without AMX gets on an AMX machine, limit the ISA of oneDNN,
ATen and MKL (draftsmith then also plans its data step in float32)::

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        PYTHONPATH=src python benchmarks/regen_flops.py --dtype float32 --out benchmarks/results/regen-flops-avx2.json

Usage::

    PYTHONPATH=src python benchmarks/regen_flops.py --threads 2 --dtype float32 bfloat16 \\
        --out benchmarks/results/regen-flops.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of the verifier, the output head included."""
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def matmul_rate(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of ``F.linear`` over all ``shapes`` at ``rows`` input rows (median of ``repeats``)."""
    g = torch.Generator().manual_seed(0)
    uniq = sorted(set(shapes))
    weights = {s: torch.randn(*s, generator=g).to(dtype) for s in uniq}
    inputs = {s: torch.randn(rows, s[1], generator=g).to(dtype) for s in uniq}
    count = {s: shapes.count(s) for s in uniq}
    flops = sum(2 * rows * o * i * count[(o, i)] for o, i in uniq)
    for s in uniq:  # warm-up
        F.linear(inputs[s], weights[s])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s in uniq:
            for _ in range(count[s]):
                F.linear(inputs[s], weights[s])
        times.append(time.perf_counter() - t0)
    return flops / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--engines", nargs="+", default=["lean", "hf"], choices=["lean", "hf"],
                    help="generate_batch engines, run side by side per batch size")
    ap.add_argument("--chunk-batches", type=int, nargs="+", default=[4],
                    help="lean: batches per chunk, one row per value (1: no refill, static batching)")
    ap.add_argument("--num-prompts", type=int, default=64, help="ShareGPT prompts regenerated per batch size")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--matmul-repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/regen-flops.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    from draftsmith.bench.measure import environment
    from draftsmith.data.regenerate import load_regenerated, regenerate
    from draftsmith.data.sources import load_prompts
    from draftsmith.models.verifier import load_verifier
    from draftsmith.utils import cpu_has_amx

    convs = load_prompts("sharegpt", split="train", limit=args.num_prompts, seed=0)
    out: dict = {"command": " ".join(["regen_flops.py", *(argv if argv is not None else sys.argv[1:])]),
                 "environment": environment(), "amx_in_use": cpu_has_amx(),
                 "isa_limits": {k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                                               "MKL_ENABLE_INSTRUCTIONS")},
                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": os.getloadavg(), "rows": []}
    rates: dict[tuple[str, int], float] = {}
    for dtype in args.dtype:
        model, tok, _ = load_verifier(args.verifier, dtype=dtype, device="cpu")
        shapes = linear_shapes(model)
        params = sum(o * i for o, i in shapes)
        replies: dict[tuple[str, int], list[str]] = {}
        runs = [(e, c) for e in args.engines for c in (args.chunk_batches if e == "lean" else [1])]
        for b, (engine, chunk) in [(b, r) for b in args.batch_sizes for r in runs]:
            label = f"lean-c{chunk}" if engine == "lean" else engine
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "r.jsonl"
                regenerate(model, tok, convs[:b], path, max_new_tokens=4, batch_size=b,
                           max_prompt_tokens=args.max_prompt_tokens, progress=False, engine=engine)  # warm-up
                path.unlink()
                t0 = time.perf_counter()
                regenerate(model, tok, convs, path, max_new_tokens=args.max_new_tokens, batch_size=b,
                           max_prompt_tokens=args.max_prompt_tokens, progress=False, engine=engine,
                           chunk_batches=chunk)
                seconds = time.perf_counter() - t0
                recs = load_regenerated(path)
                by_id = {r.id: r.messages[-1]["content"] for r in recs}  # chunks change the file order
                replies[label, b] = [by_id[k] for k in sorted(by_id)]
            prompt = sum(r.meta["prompt_tokens"] for r in recs)
            reply = sum(r.meta["completion_tokens"] for r in recs)
            useful = 2 * params * (prompt + reply)
            prefill_rows = min(4096, max(b, round(b * prompt / max(len(recs), 1))))
            for rows in (prefill_rows, b):
                if (dtype, rows) not in rates:
                    rates[dtype, rows] = matmul_rate(shapes, rows, getattr(torch, dtype), args.matmul_repeats)
            rate_prefill, rate_decode = rates[dtype, prefill_rows], rates[dtype, b]
            bound = 2 * params * prompt / rate_prefill + 2 * params * reply / rate_decode
            row = {"dtype": dtype, "engine": label, "chunk_batches": chunk, "batch_size": b, "conversations": len(recs), "seconds": seconds,
                   "prompt_tokens": prompt, "reply_tokens": reply, "reply_tokens_per_s": reply / seconds,
                   "useful_flops_per_s": useful / seconds, "matmul_flops_per_s_prefill": rate_prefill,
                   "prefill_rows": prefill_rows, "matmul_flops_per_s_decode": rate_decode,
                   "bound_seconds": bound, "fraction_of_bound": bound / seconds}
            out["rows"].append(row)
            first = f"lean-c{runs[0][1]}" if runs[0][0] == "lean" else runs[0][0]
            if label != first and (first, b) in replies:
                row["same_replies_as_" + first] = sum(x == y for x, y in zip(replies[first, b], replies[label, b]))
            print(f"{dtype:9s} {label:7s} batch {b:3d}: {row['reply_tokens_per_s']:7.1f} reply tok/s, "
                  f"{row['useful_flops_per_s'] / 1e9:6.1f} GFLOP/s useful; matmuls {rate_prefill / 1e9:6.1f} "
                  f"GFLOP/s at M={prefill_rows}, {rate_decode / 1e9:6.1f} at M={b}: bound {bound:.1f} s of "
                  f"{seconds:.1f} s -> {row['fraction_of_bound']:.0%} of the bound", flush=True)
        del model
    out["load_average_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
