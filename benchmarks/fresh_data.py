"""Fresh training data beyond what a run already used: regenerate and capture conversations
``[skip, skip + count)`` of the train split.

`draftsmith data` takes the first N conversations of the train split. To ask whether the
draft is limited by data (BENCHMARKS.md section 3), this script answers the *next* ``count``
conversations with the verifier, exactly as `draftsmith data` does (greedy, same length and
prompt limits, loop trimming), and captures them into shards that `draftsmith train --data`
takes next to the old ones. Resumable: regeneration and capture continue where they stopped.
The CLI does the same since: `draftsmith data --skip-conversations 3000 --num-conversations 1000
--max-new-tokens 320 --max-prompt-tokens 384 --max-length 768 --batch-size 128` (the recorded runs
used this script).

    PYTHONPATH=src python benchmarks/fresh_data.py --skip 3000 --count 1000 --out runs/fresh-1000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from draftsmith.data.capture import capture_to_shards, load_regenerated, read_manifest, regenerate
from draftsmith.data.prompts import load_prompts
from draftsmith.pipeline.steps import Verifier, data_dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", type=int, required=True, help="conversations of the train split already used")
    ap.add_argument("--count", type=int, required=True, help="new conversations to regenerate")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--verifier", default="smollm2-135m")
    # the settings of the `full` preset's data (runs/full/steps/regenerate-*/inputs.json)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--max-length", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    v = Verifier(args.verifier, data_dtype("auto", "auto"), "auto")
    convs = load_prompts("sharegpt", split="train", limit=args.skip + args.count, seed=args.seed)[args.skip:]
    t0 = time.perf_counter()
    regenerated = regenerate(v.model, v.tokenizer, convs, args.out / "regenerated.jsonl",
                             max_new_tokens=args.max_new_tokens, temperature=0.0, batch_size=args.batch_size,
                             max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, fingerprint=v.fingerprint)
    t1 = time.perf_counter()
    shards = capture_to_shards(v.model, v.tokenizer, load_regenerated(regenerated), args.out / "shards",
                               fingerprint=v.fingerprint, verifier_spec=v.spec, max_length=args.max_length,
                               batch_size=8, samples_per_shard=64, trim_loops=True)
    t2 = time.perf_counter()
    m = read_manifest(shards)
    summary = {"command": "benchmarks/fresh_data.py", "args": {k: str(x) for k, x in vars(args).items()},
               "conversations": len(convs), "tokens": m.get("total_tokens"), "loss_tokens": m.get("total_loss_tokens"),
               "regenerate_seconds": t1 - t0, "capture_seconds": t2 - t1, "dtype": v.dtype}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
