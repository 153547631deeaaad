"""Training throughput: tokens/s and achieved FLOP/s of the EAGLE-3 TTT step vs a plain matmul.

Runs, side by side in one process, (a) a plain square matmul in the training
precision (the machine's practical FLOP/s ceiling for this library stack) and
(b) full training steps (TTT forward + loss + backward + AdamW) of a draft shaped
for SmolLM2-135M (H=576, 9 heads, 3 kv heads, 3 aux layers) on synthetic packed
rows. Interleaved repeats; medians reported.

    PYTHONPATH=src python benchmarks/train.py --out benchmarks/results/train-smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from draftsmith.models.eagle3 import Eagle3Config, Eagle3Draft
from draftsmith.train.loop import train_flops_per_token
from draftsmith.train.loss import ttt_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(n: int, dtype: torch.dtype, reps: int = 5, device: torch.device = torch.device("cpu")) -> float:
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def train_step_seconds(draft: Eagle3Draft, opt: torch.optim.Optimizer, L: int, steps: int, bf16: bool) -> float:
    Vd = draft.config.draft_vocab_size
    dev = draft.fc.weight.device
    aux = torch.randn(1, L, 3 * draft.config.verifier_hidden_size, device=dev)
    ids = torch.randint(0, Vd, (1, L), device=dev)
    pos = torch.arange(1, L + 1, device=dev)[None]
    mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None]
    target = torch.randn(1, L, Vd, device=dev)
    nxt = torch.randint(0, Vd, (1, L), device=dev)
    valid = torch.ones(1, L, dtype=torch.bool, device=dev)
    doc = torch.zeros(1, L, dtype=torch.long, device=dev)
    _sync(dev)
    t = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        logits = draft(aux, ids, pos, mask, steps)
        loss, _ = ttt_loss(logits, target, nxt, valid, doc, draft.draft_to_target, [0.8 ** j for j in range(steps)])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(dev)
    return time.perf_counter() - t


def smollm2_135m_config():
    """A verifier config shaped like SmolLM2-135M (no weights needed to time the draft)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, head_dim=64)


def llama_1b_config():
    """A verifier config shaped like Llama-3.2-1B (the GPU check's size)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, head_dim=64)


SHAPES = {"smollm2-135m": smollm2_135m_config, "llama-1b": llama_1b_config}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack-tokens", type=int, default=1024)
    ap.add_argument("--draft-vocab-size", type=int, nargs="+", default=[8192, 16384, 32000])
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="the verifier the draft is for")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    verifier_cfg = SHAPES[args.shape]()
    device = torch.device(args.device)
    results = []
    for vd in args.draft_vocab_size:
        for precision in args.precisions:
            bf16 = precision == "bf16"
            draft = Eagle3Draft(Eagle3Config.from_verifier(verifier_cfg, draft_vocab_size=vd))
            draft.set_vocab(torch.arange(vd))
            draft = draft.to(device)
            draft.lm_head.weight.requires_grad_(False)
            opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
            train_step_seconds(draft, opt, args.pack_tokens, args.ttt_steps, bf16)  # warm-up
            step_s, mm = [], []
            for _ in range(args.repeats):  # interleave: matmul ceiling, then a training step
                mm.append(matmul_flops(2048 if device.type == "cpu" else 8192, torch.bfloat16 if bf16 else torch.float32,
                                       device=device))
                step_s.append(train_step_seconds(draft, opt, args.pack_tokens, args.ttt_steps, bf16))
            s = statistics.median(step_s)
            flops_tok = train_flops_per_token(draft.config, args.ttt_steps, args.pack_tokens / 2)
            row = {"draft_vocab_size": vd, "precision": precision, "step_seconds": s,
                   "tokens_per_second": args.pack_tokens / s, "achieved_flops": flops_tok * args.pack_tokens / s,
                   "matmul_flops": statistics.median(mm)}
            row["fraction_of_matmul"] = row["achieved_flops"] / row["matmul_flops"]
            results.append(row)
            print(f"Vd={vd:6d} {precision}: {row['tokens_per_second']:7.0f} tok/s, "
                  f"{row['achieved_flops'] / 1e9:6.1f} GFLOP/s achieved vs matmul {row['matmul_flops'] / 1e9:6.1f} "
                  f"GFLOP/s ({100 * row['fraction_of_matmul']:.0f}%)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results,
                                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                                        "machine": platform.processor() or platform.machine(),
                                        "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
                                       indent=2))


if __name__ == "__main__":
    main()
