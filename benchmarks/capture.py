"""Capture benchmark (issue 3): hidden-state capture against a plain batched verifier forward.

Acceptance: capture runs at >= 70% of the verifier's plain batched-forward token
throughput on the same machine (it must cost about one forward, nothing more).

On ShareGPT conversations with their *original* dataset replies, measures, interleaved
(the order alternates from repeat to repeat):

* ``forward``  the verifier over the same right-padded, length-grouped batches that
  capture uses, ``use_cache=False``, ``logits_to_keep=1``, no hidden states, inputs
  tokenized beforehand (the cheapest pass that reads every token);
* ``capture``  :func:`draftsmith.data.capture.capture_to_shards` end to end into a fresh
  temporary directory: tokenization with the chat template and loss mask, the forward
  with the aux layers' hidden states and the final hidden state, the copy to host
  memory in bfloat16, safetensors serialization, sha256, fsync and the manifest;

and reports tokens/s medians (tokens = unpadded sequence tokens, the same for both) and
their ratio. Also reported: the tokenization time alone, which the forward row does not pay.

Usage (the recorded run)::

    PYTHONPATH=src python benchmarks/capture.py --num-conversations 16 --max-length 512 \\
        --batch-size 8 --repeats 3 --out benchmarks/results/capture-smollm2-135m.json
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m", help="verifier spec (default: smollm2-135m)")
    ap.add_argument("--dataset", default="sharegpt", help="conversations with replies (default: sharegpt)")
    ap.add_argument("--num-conversations", type=int, default=16, help="conversations to capture")
    ap.add_argument("--max-length", type=int, default=512, help="tokens per sample")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes of each row")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (pin it on a shared machine)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument("--dtype", default="auto", help="verifier dtype: auto (float32 on CPU), float32, bfloat16")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/capture.json"), help="result JSON")
    args = ap.parse_args(argv)
    if min(args.num_conversations, args.max_length, args.batch_size, args.repeats) < 1:
        ap.error("--num-conversations, --max-length, --batch-size and --repeats must be >= 1")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from draftsmith.data import capture as C
    from draftsmith.data.sources import load_prompts
    from draftsmith.models.verifier import load_verifier
    from draftsmith.utils import environment_info

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, fp = load_verifier(args.verifier, dtype=args.dtype, device=args.device)
    convs = load_prompts(args.dataset, split="all", limit=args.num_conversations, require_responses=True)
    device = next(model.parameters()).device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    # The forward row's inputs: exactly the samples and batches capture makes (one window holds them all).
    plan = C._plan(model, tokenizer, convs, None, args.max_length, args.batch_size, torch.bfloat16)
    t0 = time.perf_counter()
    counts = C._Counts()
    samples = [s for c in convs if (s := C._tokenize(tokenizer, c, plan.max_length, counts)) is not None]
    tokenize_s = time.perf_counter() - t0
    batches = [C.right_padded([samples[i].input_ids for i in b], plan.pad_id)
               for b in C.length_batches([len(s.input_ids) for s in samples], args.batch_size)]
    tokens = sum(len(s.input_ids) for s in samples)
    padded = sum(ids.numel() for ids, _ in batches)

    def forward() -> float:
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            for ids, mask in batches:
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False, logits_to_keep=1)
        sync()
        return time.perf_counter() - t

    def capture() -> float:
        with tempfile.TemporaryDirectory(prefix="capture-bench-") as d:
            sync()
            t = time.perf_counter()
            C.capture_to_shards(model, tokenizer, convs, Path(d) / "shards", fingerprint=fp,
                                verifier_spec=args.verifier, max_length=args.max_length,
                                batch_size=args.batch_size, samples_per_shard=64, progress=False)
            sync()
            return time.perf_counter() - t

    forward()  # warm-up: allocator, kernels, first-call overheads
    rows: dict[str, list[float]] = {"forward": [], "capture": []}
    for r in range(args.repeats):
        for name in (("forward", "capture") if r % 2 == 0 else ("capture", "forward")):
            seconds = forward() if name == "forward" else capture()
            rows[name].append(seconds)
            print(f"repeat {r} {name:8s} {seconds:7.2f} s  {tokens / seconds:8.1f} tok/s", file=sys.stderr)
    tps = {k: [tokens / s for s in v] for k, v in rows.items()}
    med = {k: statistics.median(v) for k, v in tps.items()}
    ratio = med["capture"] / med["forward"]
    result = {
        "benchmark": "capture",
        "verifier": args.verifier,
        "fingerprint": fp,
        "dataset": args.dataset,
        "conversations": len(convs),
        "samples": len(samples),
        "tokens": tokens,
        "padded_tokens": padded,
        "max_length": plan.max_length,
        "batch_size": args.batch_size,
        "aux_layer_ids": plan.aux_layer_ids,
        "device": str(device),
        "model_dtype": str(next(model.parameters()).dtype),
        "seconds": rows,
        "tokens_per_s": tps,
        "median_tokens_per_s": med,
        "ratio_capture_over_forward": ratio,
        "target_ratio": 0.70,
        "passed": ratio >= 0.70,
        "tokenize_seconds": tokenize_s,
        "load_average": os.getloadavg(),
        "environment": environment_info(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"forward {med['forward']:.1f} tok/s, capture {med['capture']:.1f} tok/s, ratio {ratio:.3f} "
          f"(target >= 0.70: {'pass' if ratio >= 0.70 else 'FAIL'}); tokenization alone {tokenize_s:.2f} s; "
          f"{tokens} tokens ({padded} padded) -> {args.out}")
    return 0 if ratio >= 0.70 else 1


if __name__ == "__main__":
    sys.exit(main())
