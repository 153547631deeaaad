"""Memory of the compiled CPU engine: one packed copy of the weights per frozen graph, or one shared.

Each frozen CPU graph (``decoding/runner.CompiledFn``) packs the weights it reads into a constant of
its own; ``decoding/frozen.share_frozen_constants`` points equal constants of later graphs at the
first one's memory (``DRAFTSMITH_SHARE_CONSTANTS=1``, the default) instead of keeping each copy
(``0``). This runs the same work once per arm, each arm in a fresh process (the sharing is
process-wide), and reports, after each stage:

1. ``load``: the verifier (float32) and a random EAGLE-3 draft of its shape (``--draft-vocab``) at
   ``--draft-precision``;
2. ``eagle3``: ``generate(compile=True)`` with the draft at k = ``--num-draft-tokens`` on one
   MT-Bench prompt (compiles the one-token step, the verify candidates, the draft's steps);
3. ``plain``: the same prompt without the draft (no new graph);
4. ``long``: a prompt of ``--long-prompt`` tokens (a larger cache: the one-token step compiles again
   for its shape, the verify step too);

VmRSS and VmHWM (``/proc/self/status``; the high-water mark includes the compiles' transients), the
distinct storages the frozen graphs' constants hold (MiB), the graphs, compile seconds and the
tokens; the arms' tokens must be identical.

    PYTHONPATH=src python benchmarks/frozen_constants.py --out benchmarks/results/frozen-constants-epyc.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lean_engine import add_random_draft_args, random_draft_proposer  # noqa: E402


def _status() -> dict[str, int]:
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            k, v = line.split(":")
            out[k] = int(v.split()[0]) // 1024  # MiB
    return out


def _frozen() -> dict[str, float]:
    """The live frozen graphs and the distinct CPU storages their constants hold."""
    from draftsmith.decoding.frozen import compiled_graphs

    graphs = compiled_graphs()
    frozen = [g for g in graphs if getattr(g, "frozen_param_names", None)]
    storages = {}
    for g in frozen:
        for t in (g.constants or {}).values():
            if getattr(t, "device", None) is not None and t.device.type == "cpu":
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    return {"graphs": len(graphs), "frozen_graphs": len(frozen), "constants_mib": sum(storages.values()) / 2**20}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)

    from draftsmith.data.sources import eval_set
    from draftsmith.decoding.engine import generate
    from draftsmith.models.verifier import load_verifier

    stages: dict = {}

    def mark(name, **extra):
        gc.collect()
        before = _status()
        trimmed = {}
        if args.trim:  # what the heap holds free beside the live objects: glibc gives it back
            from draftsmith.decoding.frozen import release_free_heap

            release_free_heap()
            trimmed = {"VmRSS_trimmed": _status()["VmRSS"]}
        stages[name] = {**before, **trimmed, **_frozen(), **extra}
        print(f"[{args.child}] {name}: {stages[name]}", file=sys.stderr, flush=True)

    model, tok, _ = load_verifier(args.verifier, dtype="float32", device="cpu")
    proposer = random_draft_proposer(model, args.draft_vocab, args.draft_precision)
    prompt = eval_set("mt-bench", tok, limit=1)[0][1]
    mark("load")
    tokens = {}
    with torch.inference_mode():
        for name, ids, drafter in (("eagle3", prompt, proposer), ("plain", prompt, None),
                                   ("long", (prompt * (args.long_prompt // len(prompt) + 1))[:args.long_prompt], None)):
            t = time.perf_counter()
            r = generate(model, ids, proposer=drafter, max_new_tokens=args.max_new_tokens,
                         num_draft_tokens=args.num_draft_tokens, eos_token_id=[], compile=True)
            tokens[name] = r.token_ids
            mark(name, compile_seconds=r.stats["compile_seconds"], wall_seconds=time.perf_counter() - t)
    print(json.dumps({"stages": stages, "tokens": tokens}))


def timing(args) -> dict:
    """The one-token and verify steps of two copies of the verifier in one process, one compiled with
    its own packed weights per graph, one with them shared, timed interleaved (``--timing``)."""
    import statistics

    import torch

    torch.set_num_threads(args.threads)
    from draftsmith.decoding.runner import verifier_runner
    from draftsmith.models.verifier import load_verifier

    arms = {}
    for arm in args.arms:  # compiled in this order: the load order is the other run's
        os.environ["DRAFTSMITH_SHARE_CONSTANTS"] = arm
        model = load_verifier(args.verifier, dtype="float32", device="cpu")[0]
        with torch.inference_mode():
            arms[arm] = verifier_runner(model, 600, compile=True, warmup_shapes=(1, 3))
    ms: dict = {(a, m): [] for a in arms for m in (1, 3)}
    with torch.inference_mode():
        ctx = torch.arange(256) % 1000 + 10
        for r in arms.values():
            r.forward(ctx, 1)
        for rep in range(args.step_repeats):
            for a in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                r = arms[a]
                for m in (1, 3):
                    ids = torch.arange(m) + 5
                    t = time.perf_counter()
                    for _ in range(20):
                        r.forward(ids, m)
                        r.rollback(256)
                    ms[(a, m)].append((time.perf_counter() - t) / 20 * 1e3)
    a0, a1 = args.arms
    out = {}
    for m in (1, 3):
        ratio = statistics.median(b / a for a, b in zip(ms[(a0, m)], ms[(a1, m)]))
        out[f"{m} token(s)"] = {"median_ms": {a: statistics.median(ms[(a, m)]) for a in arms},
                                f"share={a1} / share={a0} per repeat": ratio, "ms": {a: ms[(a, m)] for a in arms}}
        print(f"[timing] {m}-token step at 256 cached: " + ", ".join(
            f"share={a} {statistics.median(ms[(a, m)]):.2f} ms" for a in arms) + f"; ratio {ratio:.4f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_random_draft_args(ap, max_new_tokens=32)
    ap.add_argument("--long-prompt", type=int, default=600, help="tokens of the stage-4 prompt (past 512 - new "
                    "tokens: the next cache size)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=["1", "0"], choices=["1", "0"],
                    help="DRAFTSMITH_SHARE_CONSTANTS of each arm, run in this order, each in its own process")
    ap.add_argument("--trim", action="store_true", help="also report VmRSS after glibc's malloc_trim(0) at each stage")
    ap.add_argument("--timing", action="store_true", help="instead: both arms' verifier steps in one process, "
                    "timed interleaved (the arms' order is the load order)")
    ap.add_argument("--step-repeats", type=int, default=15, help="--timing: interleaved repeats of 20 steps each")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    out: dict = {"verifier": args.verifier, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
                 "load_avg": os.getloadavg(), "args": {a: str(v) for a, v in vars(args).items()}, "arms": {}}
    if args.timing:
        if len(args.arms) != 2:
            ap.error("--timing compares two arms")
        out["timing"] = timing(args)
    else:
        memory(args, out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))


def memory(args, out: dict) -> None:
    """Each arm's stages in a process of its own (the default mode); the table, and whether the
    arms' tokens are identical, into ``out``."""
    for arm in args.arms:
        env = dict(os.environ, DRAFTSMITH_SHARE_CONSTANTS=arm)
        cmd = [sys.executable, __file__, "--child", arm, "--verifier", args.verifier, "--draft-vocab",
               str(args.draft_vocab), "--draft-precision", args.draft_precision, "--num-draft-tokens",
               str(args.num_draft_tokens), "--max-new-tokens", str(args.max_new_tokens), "--long-prompt",
               str(args.long_prompt), "--threads", str(args.threads)] + (["--trim"] if args.trim else [])
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        out["arms"][arm] = json.loads(p.stdout.strip().splitlines()[-1])
    arms = list(out["arms"])
    print(f"{'stage':8} " + " ".join(f"{'share=' + a + ' RSS/HWM/constants MiB, graphs':>42}" for a in arms))
    for stage in out["arms"][arms[0]]["stages"]:
        cells = []
        for a in arms:
            s = out["arms"][a]["stages"][stage]
            cells.append(f"{s['VmRSS']:>8} / {s['VmHWM']:>5} / {s['constants_mib']:>6.0f}, {s['frozen_graphs']:>2} frozen")
        print(f"{stage:8} " + " ".join(f"{c:>42}" for c in cells))
    out["identical"] = len({json.dumps(out["arms"][a]["tokens"]) for a in arms}) == 1
    print(f"tokens identical in every arm: {out['identical']}")


if __name__ == "__main__":
    main()
