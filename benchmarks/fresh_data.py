"""Fresh training data beyond what a run already used: regenerate and capture conversations
``[skip, skip + count)`` of the train split.

`draftsmith data` takes the first N conversations of the train split. To ask whether the
draft is limited by data (BENCHMARKS.md section 3), this script answers the *next* ``count``
conversations with the verifier, exactly as `draftsmith data` does (greedy, same length and
prompt limits, loop trimming), and captures them into shards that `draftsmith train --data`
takes next to the old ones. Resumable: regeneration and capture continue where they stopped.
It is now `draftsmith data --skip-conversations SKIP --num-conversations COUNT` with the `full`
preset's data settings (the shards land in OUT/shards, as before).

    PYTHONPATH=src python benchmarks/fresh_data.py --skip 3000 --count 1000 --out runs/fresh-1000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.cli import main as cli_main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", type=int, required=True, help="conversations of the train split already used")
    ap.add_argument("--count", type=int, required=True, help="new conversations to regenerate")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--verifier", default="smollm2-135m")
    args = ap.parse_args()
    # the settings of the `full` preset's data (runs/full/steps/regenerate-*/inputs.json)
    sys.exit(cli_main(["data", "--verifier", args.verifier, "--out", str(args.out),
                       "--skip-conversations", str(args.skip), "--num-conversations", str(args.count),
                       "--max-new-tokens", "320", "--max-prompt-tokens", "384", "--max-length", "768",
                       "--batch-size", "128"]))


if __name__ == "__main__":
    main()
