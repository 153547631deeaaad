"""Regeneration throughput: in process (HF ``generate``) vs through a vLLM server (issue 21).

Answers the first N ShareGPT train prompts twice, with the same settings: once with
:func:`draftsmith.data.regenerate.regenerate` (batched ``generate`` in this process) and
once with :func:`draftsmith.data.endpoint.regenerate_via_endpoint` through a vLLM server
this script starts (``make setup-vllm``). Reports generated tokens/s of each (tokens =
the replies' ``completion_tokens``), the server's startup time (not in its tok/s), and
how many records are identical. A rough number: one run, not interleaved; it records the
load average, which says how shared the CPU was.

Usage (the recorded run)::

    PYTHONPATH=src python benchmarks/regenerate_endpoint.py --num-conversations 16 --max-new-tokens 64 \\
        --batch-size 16 --threads 1 --out benchmarks/results/regenerate-endpoint-smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _tokens(path: Path) -> tuple[int, list[dict]]:
    records = [json.loads(line) for line in open(path)]
    return sum(r["meta"]["completion_tokens"] for r in records), records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--num-conversations", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16, help="in-process batch = requests in flight")
    ap.add_argument("--dtype", default="float32", help="in-process verifier dtype")
    ap.add_argument("--server-dtype", default="float32", help="vLLM's --dtype")
    ap.add_argument("--threads", type=int, default=1,
                    help="in-process torch threads (vLLM's CPU worker runs one OpenMP thread on a 2-core machine: "
                         "it keeps the other core for its frontend; on a shared CPU more threads oversubscribe)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from draftsmith.data.regenerate import regenerate
    from draftsmith.data.endpoint import regenerate_via_endpoint
    from draftsmith.data.sources import load_prompts
    from draftsmith.engines.vllm import VllmEngine
    from draftsmith.models.verifier import load_verifier
    from draftsmith.utils import environment_info

    convs = load_prompts("sharegpt", split="train", limit=args.num_conversations)
    model, tok, fp = load_verifier(args.verifier, dtype=args.dtype, device="cpu")
    kw = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, fingerprint=fp, progress=False)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        load = {"before": os.getloadavg()}
        t0 = time.perf_counter()
        regenerate(model, tok, convs, tmp_path / "local.jsonl", **kw)
        s = time.perf_counter() - t0
        n, local = _tokens(tmp_path / "local.jsonl")
        rows["in_process"] = {"seconds": round(s, 2), "tokens": n, "tokens_per_second": round(n / s, 2),
                              "dtype": args.dtype, "torch_threads": torch.get_num_threads()}
        load["after_in_process"] = os.getloadavg()
        with VllmEngine(args.verifier, dtype=args.server_dtype, work_dir=tmp_path / "logs") as engine:
            t0 = time.perf_counter()
            regenerate_via_endpoint(engine.url, model, tok, convs, tmp_path / "served.jsonl", **kw)
            s = time.perf_counter() - t0
            n, served = _tokens(tmp_path / "served.jsonl")
            rows["vllm_endpoint"] = {"seconds": round(s, 2), "tokens": n, "tokens_per_second": round(n / s, 2),
                                     "dtype": args.server_dtype, "startup_seconds": round(engine.startup_seconds, 1),
                                     "note": "includes the two verifier probes (64 tokens)"}
        load["after_vllm"] = os.getloadavg()
        same = sum(a["messages"] == b["messages"] for a, b in zip(local, served))
    report = {"benchmark": "regenerate_endpoint", "settings": vars(args) | {"out": str(args.out)},
              "rows": rows, "identical_records": f"{same}/{len(local)}",
              "speedup_vllm_over_in_process": round(rows["vllm_endpoint"]["tokens_per_second"]
                                                    / rows["in_process"]["tokens_per_second"], 2),
              "load_average": load, "environment": environment_info()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
