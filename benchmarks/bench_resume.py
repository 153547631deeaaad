"""A bench killed with SIGKILL, then the same command: what it keeps, and what its checkpoint costs.

Starts ``draftsmith bench`` (SmolLM2-135M, the n-gram drafter at k = 2 and 3, ``--num-prompts``
MT-Bench prompts), kills it with SIGKILL ``--kill-after`` seconds after the ``--kill-at``-th prompt's
line is in ``OUT/bench-units.jsonl`` (mid-prompt), then runs the same command in this process with
every checkpoint write timed. Prints the units kept, the resumed run's wall time and each write's
milliseconds; the resumed report (``OUT/report.md``) says where the resume happened. BENCHMARKS 15l.

With ``--extend-to N`` the finished bench is then run once more with ``--num-prompts N``: it keeps
every prompt timed so far and times only the new ones; printed: the units timed, the wall time and
the drafter's speedup interval before and after. BENCHMARKS 15m.

    PYTHONPATH=src python benchmarks/bench_resume.py --out /tmp/bench-resume [--extend-to 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the bench's --out (emptied first)")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--kill-at", type=int, default=4, help="prompts every row has timed before the kill")
    ap.add_argument("--kill-after", type=float, default=3.0, help="seconds after that prompt (mid-prompt)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extend-to", type=int, default=None,
                    help="then extend the finished bench to this many prompts (more than --num-prompts)")
    args = ap.parse_args(argv)
    if args.extend_to is not None and args.extend_to <= args.num_prompts:
        ap.error("--extend-to must be more than --num-prompts")
    shutil.rmtree(args.out, ignore_errors=True)
    bench = ["bench", "--verifier", "smollm2-135m", "--drafter", "ngram", "--num-prompts", str(args.num_prompts),
             "--max-new-tokens", str(args.max_new_tokens), "--num-draft-tokens", "2", "3", "--threads",
             str(args.threads), "--no-progress", "--out", str(args.out)]
    from draftsmith.bench import resume

    units = args.out / resume.UNITS_FILE
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli", *bench], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    while not (units.exists() and len(units.read_text().splitlines()) >= args.kill_at):
        if proc.poll() is not None:
            sys.exit("the bench finished before the kill: raise --num-prompts")
        time.sleep(0.5)
    time.sleep(args.kill_after)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed after {len(units.read_text().splitlines())} prompts; {units.stat().st_size} bytes of units")

    from draftsmith.cli import main as cli

    took: list[float] = []
    add = resume.Checkpoint.add_unit

    def timed(self, state, n):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        add(self, state, n)
        took.append(time.perf_counter() - t)

    resume.Checkpoint.add_unit = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    rc = cli(bench)
    print(f"resumed: rc {rc}, wall {time.perf_counter() - t0:.1f} s; unit writes (ms): "
          + ", ".join(f"{1000 * x:.2f}" for x in took))
    if rc or args.extend_to is None:
        return rc

    def intervals() -> str:
        report = json.loads((args.out / "report.json").read_text())
        return "; ".join(f"{r['name']} {r['speedup']['median']:.3f}x [{r['speedup']['ci95'][0]:.3f}-"
                         f"{r['speedup']['ci95'][1]:.3f}]" for r in report["rows"] if (r.get("speedup") or {}).get("ci95"))

    before = intervals()
    took.clear()
    t0 = time.perf_counter()
    i = bench.index("--num-prompts")
    rc = cli([*bench[:i + 1], str(args.extend_to), *bench[i + 2:]])
    print(f"extended to {args.extend_to} prompts: rc {rc}, wall {time.perf_counter() - t0:.1f} s, "
          f"{len(took)} units timed\n  before: {before}\n  after:  {intervals() if rc == 0 else '-'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
