"""Make a real, small change to a verifier: a short supervised fine-tune, saved as an HF directory.

This is the "my model changed" event of the refresh story. The fine-tune trains
all weights with the causal-LM loss on the assistant tokens of ShareGPT
conversations (their original, human-collected replies — a different style from
the verifier's own), for a few dozen steps.

    PYTHONPATH=src python benchmarks/finetune_verifier.py --out runs/smollm2-135m-ft
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftsmith.data.sources import load_prompts
from draftsmith.data.tokenize import tokenize_conversations
from draftsmith.models.verifier import load_verifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=400, help="ShareGPT conversations (train split, skipped "
                    "past the ones the draft pipeline regenerates)")
    ap.add_argument("--skip", type=int, default=3000, help="start after this many conversations")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model, tok, fp = load_verifier(args.verifier, dtype="float32", device="cpu")
    convs = load_prompts("sharegpt", split="train", limit=args.skip + args.conversations,
                         require_responses=True)[args.skip:]
    samples, counts = tokenize_conversations(tok, convs, max_length=args.max_length, overflow="truncate")
    print(f"{len(samples)} samples ({counts})", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    t0 = time.time()
    g = torch.Generator().manual_seed(args.seed)
    log = []
    for step in range(args.steps):
        idx = torch.randint(0, len(samples), (args.batch,), generator=g).tolist()
        batch = [samples[i] for i in idx]
        width = max(len(s.input_ids) for s in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        att = torch.zeros((len(batch), width), dtype=torch.long)
        for b, s in enumerate(batch):
            n = len(s.input_ids)
            ids[b, :n] = torch.tensor(s.input_ids)
            att[b, :n] = 1
            lab = torch.tensor(s.input_ids)
            lab[torch.tensor(s.loss_mask) == 0] = -100
            labels[b, :n] = lab
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.append(float(loss))
        print(f"step {step + 1}/{args.steps} loss {float(loss):.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    from draftsmith.models.verifier import fingerprint

    info = {"base": args.verifier, "base_fingerprint": fp, "fingerprint": fingerprint(model),
            "args": {k: str(v) for k, v in vars(args).items()}, "loss": log, "seconds": time.time() - t0}
    (args.out / "finetune.json").write_text(json.dumps(info, indent=2))
    print(f"saved {args.out} (fingerprint {info['fingerprint']}, was {fp})")


if __name__ == "__main__":
    main()
