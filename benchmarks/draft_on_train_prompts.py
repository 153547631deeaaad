"""Does the engine use an EAGLE-3 draft as it was trained? (issue 3 diagnostic)

Decodes the first user turns of conversations the draft was trained on (the pipeline's
regenerate output) with the real engine and prints the draft's acceptance. If it is in line
with the training accuracy, the draft is used as trained and a lower acceptance on held-out
prompts (MT-Bench) is a data / domain gap, not a train-vs-inference mismatch.

Usage (the recorded run)::

    PYTHONPATH=src python benchmarks/draft_on_train_prompts.py \\
        --draft runs/full/steps/train-e2a0b38036582950/train/draft \\
        --conversations runs/full/steps/regenerate-b91430d86ce0f7db/regenerated.jsonl --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft", type=Path, required=True, help="EAGLE-3 draft directory")
    ap.add_argument("--conversations", type=Path, required=True, help="regenerated.jsonl of the draft's data")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-prompt-tokens", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)

    from draftsmith.data.chat import encode_prompt
    from draftsmith.decoding.engine import generate
    from draftsmith.drafters import load_draft
    from draftsmith.models.verifier import load_verifier

    model, tokenizer, _ = load_verifier(args.verifier, dtype=args.dtype)
    proposer = load_draft(str(args.draft), model)
    first, lengths = [], []
    with args.conversations.open() as f:
        for line in f:
            ids = encode_prompt(tokenizer, json.loads(line)["messages"][0]["content"], chat=True)
            if len(ids) > args.max_prompt_tokens:
                continue
            stats = generate(model, ids, proposer=proposer, max_new_tokens=args.max_new_tokens,
                             num_draft_tokens=args.num_draft_tokens).stats
            first.append(stats["per_position_acceptance"][0])
            lengths.append(stats["acceptance_length"])
            if len(first) == args.num_prompts:
                break
    print(f"{args.dtype}: acceptance length per prompt {[round(x, 2) for x in lengths]}; first-position "
          f"acceptance {[round(x, 2) for x in first]}, mean {statistics.mean(first):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
