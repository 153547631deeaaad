"""A few-row float32 linear kernel against MKL and inductor's C++ GEMM template (BENCHMARKS.md 9t).

On the SPR a compiled verify of 2 / 3 / 4 tokens costs more than a one-token step (9q, 9r), though
its weight bytes are the same. The kernel was written to read each weight row once for all the
rows of a verify (8 output rows per block, 2 rows of x per tile, prefetched streams; each output
the same sum in the same order whatever the number of rows). It was not adopted for compiled
steps (9t); since 15g it is the eager steps' ``--weight-layout cpp`` (``draftsmith.models.cpu_linear``,
``src/draftsmith/models/cpu_linear.cpp``), and this script measures that op. Sections, rows
interleaved per repeat, medians:

- ``gemm``: the 211 GEMMs of a SmolLM2-135M step (538 MB of float32 weights streamed from memory)
  for 1..N rows: ``torch.mm`` (MKL) vs the kernel and (since 15g) oneDNN's matmul, and whether the
  kernel's rows are bitwise independent of how many rows it is given; ``--dtypes float32 bfloat16``
  repeats it in bfloat16 (269 MB; ``torch.mm`` is then ATen's bfloat16 GEMM, 15n).
- ``steps``: the compiled lean step of SmolLM2-135M at ``--context`` cached tokens, wall time per
  step, for the engine's C++ GEMM template tier, ATen (MKL, inductor without freezing) and the
  kernel (inductor without freezing, every plain Linear through the kernel); and whether a verify
  of 3 tokens gives bitwise the logits of 3 one-token steps.
- ``int8`` (not in the default set; since 15h): the 8 GEMMs of an int8 EAGLE-3 draft step, ATen's
  ``_weight_int8pack_mm`` vs the kernel's int8 form (``small_linear_i8``) vs the float32 kernel, warm
  and after a sweep of memory; with bfloat16 activations too where the kernel takes them (15o).

``--against REV`` compares two versions of the kernel's source, the working tree's and REV's (15o):
each runs the sections in a process of its own (``--kernel-source``), the two alternated
``--rounds`` times, and the medians over rounds are reported side by side with their ratio; the
in-process rows that do not use the kernel (MKL, oneDNN, ATen's int8) are the control for a host
that drifts between processes.

    PYTHONPATH=src python benchmarks/few_row_linear.py --threads 2 --out benchmarks/results/few-row-linear-spr.json
    PYTHONPATH=src python benchmarks/few_row_linear.py --sections gemm int8 --dtypes float32 bfloat16 \
        --against HEAD --rounds 4 --out runs/kernel-ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

H, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M
_ROUTED = False


def build(source: Path | None = None) -> None:
    from draftsmith.models import cpu_linear

    if source is not None:  # another version of the kernel (--kernel-source)
        cpu_linear._SOURCE = source
    if not cpu_linear.available():
        raise SystemExit("the kernel could not be built here (see the warning above)")
    torch.library.register_fake("draftsmith::small_linear")(lambda x, w, b: x.new_empty((*x.shape[:-1], w.shape[0])))


def rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.draftsmith.small_linear(x, w, b)


def gemm_section(rows: list[int], repeats: int, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(0)
    layers = [[(torch.randn(n, k, generator=g) * 0.02).to(dtype) for n, k in
               ((H, H), (KV, H), (KV, H), (H, H), (INTER, H), (INTER, H), (H, INTER))] for _ in range(LAYERS)]
    head = (torch.randn(VOCAB, H, generator=g) * 0.02).to(dtype)
    x = torch.randn(max(rows), H, generator=g).to(dtype)
    full = rows_linear(x, head)
    invariant = all(torch.equal(rows_linear(x[:m].contiguous(), head), full[:m]) for m in rows)
    ref = (x.double() @ head.double().t()).to(dtype)
    max_err = (full.double() - ref.double()).abs().max().item()

    def step(fn, xm, xi):
        for ws in layers:
            for w in ws:
                fn(xm if w.shape[1] == H else xi, w)
        fn(xm, head)

    fns = {"mkl": lambda a, w: torch.mm(a, w.t()), "kernel": lambda a, w: rows_linear(a, w)}
    from draftsmith.models.verifier import onednn_supports

    if onednn_supports(head.dtype):  # --weight-layout onednn's kernel (bfloat16 needs AVX-512)
        fns["onednn"] = lambda a, w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")
    seen: dict = {}
    names = list(fns)
    for rep in range(repeats + 1):
        for m in rows:
            xm, xi = torch.randn(m, H, generator=g).to(dtype), torch.randn(m, INTER, generator=g).to(dtype)
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                t = time.perf_counter()
                step(fns[name], xm, xi)
                if rep:  # the first pass warms up
                    seen.setdefault(name, {}).setdefault(m, []).append(1e3 * (time.perf_counter() - t))
    ms = {name: {m: statistics.median(v) for m, v in per.items()} for name, per in seen.items()}
    for name, per in ms.items():
        print(f"[gemm {str(dtype).removeprefix('torch.')} {name:6s}] " + "  ".join(f"{m} rows {t:.2f} ms ({t / per[rows[0]]:.2f}x)" for m, t in per.items()),
              flush=True)
    print(f"[gemm] kernel rows bitwise independent of the row count: {invariant}; max |err| vs float64 {max_err:.2e}")
    return {"ms": ms, "rows_bitwise_invariant": invariant, "max_abs_error_vs_float64": max_err}


def int8_section(rows: list[int], repeats: int, vocab: int = 8192) -> dict:
    """The 8 GEMMs of an EAGLE-3 draft step (SmolLM2-135M shapes, draft vocabulary ``vocab``) with int8
    weights: ATen's ``_weight_int8pack_mm`` (bfloat16 activations, the int8 draft in the other layouts)
    against the kernel's int8 form ``small_linear_i8`` (float32 activations, the cpp layout's; and,
    where the kernel takes them, bfloat16 ones: ``kernel-int8-bf16x``) and the float32 kernel on the
    same shapes; warm (the weights just read) and cold (after a 128 MB sweep, as a draft step after a
    verifier step finds them)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(H, 2 * H), (KV, 2 * H), (KV, 2 * H), (H, H), (INTER, H), (INTER, H), (H, INTER), (vocab, H)]
    w32 = [torch.randn(n, k, generator=g) * 0.02 for n, k in shapes]
    scales = [w.abs().amax(-1) / 127 for w in w32]
    q8 = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(w32, scales)]
    scales16 = [s.to(torch.bfloat16) for s in scales]
    sweep = torch.empty(32 * 1024 * 1024)
    fns = {
        "int8pack": lambda xs: [torch._weight_int8pack_mm(x.to(torch.bfloat16), q, s) for x, q, s in zip(xs, q8, scales16)],
        "kernel-int8": lambda xs: [torch.ops.draftsmith.small_linear_i8(x, q, s, None) for x, q, s in zip(xs, q8, scales)],
        "kernel-fp32": lambda xs: [torch.ops.draftsmith.small_linear(x, w, None) for x, w in zip(xs, w32)],
    }
    try:  # the int8 form with a bfloat16 model's activations (W8A16; since 15o)
        torch.ops.draftsmith.small_linear_i8(torch.zeros(1, H, dtype=torch.bfloat16), q8[3], scales[3], None)
        fns["kernel-int8-bf16x"] = lambda xs: [torch.ops.draftsmith.small_linear_i8(x.to(torch.bfloat16), q, s, None)
                                               for x, q, s in zip(xs, q8, scales)]
    except RuntimeError:  # an older kernel (--against)
        pass
    seen: dict = {}
    names = list(fns)
    for rep in range(repeats + 1):
        for m in rows:
            xs = [torch.randn(m, k, generator=g) for _, k in shapes]
            for cold in (False, True):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    if cold:
                        sweep.add_(1.0)
                    t = time.perf_counter()
                    fns[name](xs)
                    if rep:
                        key = f"{name}-{'cold' if cold else 'warm'}"
                        seen.setdefault(key, {}).setdefault(m, []).append(1e3 * (time.perf_counter() - t))
    ms = {name: {m: statistics.median(v) for m, v in per.items()} for name, per in seen.items()}
    for name, per in ms.items():
        print(f"[int8 {name:17s}] " + "  ".join(f"{m} rows {t:.3f} ms" for m, t in per.items()), flush=True)
    return {"ms": ms, "draft_vocab": vocab, "int8_bytes": sum(q.numel() for q in q8)}


@contextlib.contextmanager
def routed(on: bool):
    global _ROUTED
    before, _ROUTED = _ROUTED, on
    try:
        yield
    finally:
        _ROUTED = before


def steps_section(verifier: str, tokens: list[int], context: int, repeats: int) -> dict:
    import draftsmith.decoding.runner as runner_mod
    import draftsmith.models.lean as lean
    from draftsmith.models.verifier import load_verifier

    plain = lean._linear_of

    def linear(module, x):  # the lean decoder's Linear, through the kernel while routed
        if _ROUTED and x.dtype == torch.float32:
            return rows_linear(x, module.weight, module.bias)
        return plain(module, x)

    lean._linear_of = linear
    tiers = {"template": runner_mod.CPU_COMPILE_TIERS[0], "aten": {"freezing": False},
             "kernel": {"freezing": False}}
    model, _, fp = load_verifier(verifier, dtype="float32", device="cpu")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    first = runner_mod.CPU_COMPILE_TIERS
    os.environ["DRAFTSMITH_VERIFY_TIER"] = "template"  # each tier compiles every step length itself
    runners, compile_s = {}, {}
    out: dict = {"verifier": f"{verifier} ({fp})", "context": context}
    try:
        with torch.inference_mode():
            prompt = torch.randint(2, V, (context,), generator=g)
            for name, tier in tiers.items():
                runner_mod.CPU_COMPILE_TIERS = (tier,) + first
                runner_mod._COMPILED.pop(model, None)  # a compiled step of its own per tier
                t = time.perf_counter()
                with routed(name == "kernel"):
                    r = runner_mod.verifier_runner(model, context + 16, compile=True, warmup_shapes=tuple(tokens),
                                                   role=f"tier-{name}")
                    r.forward(prompt, 1)
                compile_s[name] = time.perf_counter() - t
                runners[name] = r
            toks = {m: torch.randint(2, V, (m,), generator=g) for m in tokens}
            print("[warm] every tier compiled; measuring", flush=True)
            seen: dict = {}
            names = list(tiers)
            for rep in range(repeats + 2):
                for m in tokens:
                    for name in names[rep % len(names):] + names[:rep % len(names)]:
                        r = runners[name]
                        with routed(name == "kernel"):
                            t = time.perf_counter()
                            r.forward(toks[m], m)
                            dt = time.perf_counter() - t
                        r.rollback(context)
                        if rep >= 2:
                            seen.setdefault(name, {}).setdefault(m, []).append(1e3 * dt)
            bitwise = {}
            m = 3 if 3 in tokens else max(tokens)
            for name, r in runners.items():
                with routed(name == "kernel"):
                    verify, _ = r.forward(toks[m], m)
                    r.rollback(context)
                    one = torch.cat([r.forward(toks[m][j:j + 1], 1)[0] for j in range(m)])
                    r.rollback(context)
                bitwise[name] = {"bitwise": torch.equal(verify, one), "max_abs_diff": (verify - one).abs().max().item()}
    finally:
        runner_mod.CPU_COMPILE_TIERS = first
        lean._linear_of = plain
        os.environ.pop("DRAFTSMITH_VERIFY_TIER", None)
    ms = {name: {m: statistics.median(v) for m, v in per.items()} for name, per in seen.items()}
    for name, per in ms.items():
        print(f"[step {name:8s}] " + "  ".join(f"{m} tok {t:.2f} ms ({t / per[tokens[0]]:.2f}x)" for m, t in per.items())
              + f"  | verify of {m} = {m} one-token steps bitwise: {bitwise[name]['bitwise']} "
                f"(max diff {bitwise[name]['max_abs_diff']:.1e}); compile {compile_s[name]:.0f} s", flush=True)
    out.update(ms=ms, verify_vs_one_token=bitwise, compile_seconds=compile_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", choices=["gemm", "steps", "int8"], default=["gemm", "steps"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--context", type=int, default=117)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                    help="the gemm section's weight and activation dtypes (bfloat16: the kernel's bfloat16 form, "
                         "BENCHMARKS.md 15n)")
    ap.add_argument("--kernel-source", type=Path, default=None,
                    help="measure this cpu_linear.cpp (with the cpu_vec.h beside it) instead of the package's")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="compare the working tree's kernel with REV's (a git revision), each in processes of its "
                         "own, alternated --rounds times")
    ap.add_argument("--rounds", type=int, default=3, help="with --against: processes per version")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)  # --against's first pass
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.against:
        if args.kernel_source or args.rounds < 1:
            ap.error("--against compares REV with the working tree: no --kernel-source, and --rounds >= 1")
        return against(args)
    torch.set_num_threads(args.threads)
    build(args.kernel_source)
    if args.build_only:
        return
    out: dict = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                 "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "kernel_source": str(args.kernel_source or "package")}
    try:
        with open("/proc/cpuinfo") as f:
            out["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if "gemm" in args.sections:
        for i, name in enumerate(args.dtypes):
            out["gemm" if i == 0 and name == "float32" else f"gemm_{name}"] = gemm_section(
                args.rows, args.repeats, getattr(torch, name))
    if "steps" in args.sections:
        out["steps"] = steps_section(args.verifier, args.tokens, args.context, args.repeats)
    if "int8" in args.sections:
        out["int8"] = int8_section(args.rows, args.repeats)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    sys.exit(0)


def against(args) -> None:
    """The sections for REV's kernel and the working tree's, each version in ``--rounds`` processes of its
    own (alternated, the order swapped each round); medians over rounds side by side."""
    import subprocess
    import tempfile

    if "steps" in args.sections:
        raise SystemExit("--against times the gemm and int8 sections (the steps section compiles per process)")
    root = Path(__file__).resolve().parents[1]
    here = root / "src/draftsmith/models"
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        for name in ("cpu_linear.cpp", "cpu_vec.h"):
            got = subprocess.run(["git", "-C", str(root), "show", f"{args.against}:src/draftsmith/models/{name}"],
                                 capture_output=True, text=True)
            if got.returncode:
                raise SystemExit(f"--against {args.against}: {got.stderr.strip()}")
            (base / name).write_text(got.stdout)
        versions = {args.against: base / "cpu_linear.cpp", "working tree": here / "cpu_linear.cpp"}
        for v, src in versions.items():  # each built before any round, so no round times beside a compiler
            print(f"[against] building {v}'s kernel", flush=True)
            subprocess.run([sys.executable, __file__, "--build-only", "--kernel-source", str(src)], check=True,
                           stdout=subprocess.DEVNULL)
        runs: dict = {v: [] for v in versions}
        for rnd in range(args.rounds):
            order = list(versions) if rnd % 2 == 0 else list(versions)[::-1]
            for i, v in enumerate(order):
                out = Path(tmp) / f"r{rnd}-{i}.json"
                cmd = [sys.executable, __file__, "--sections", *args.sections, "--threads", str(args.threads),
                       "--rows", *map(str, args.rows), "--repeats", str(args.repeats), "--dtypes", *args.dtypes,
                       "--kernel-source", str(versions[v]), "--out", str(out)]
                print(f"[against] round {rnd + 1}/{args.rounds}: {v}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                runs[v].append(json.loads(out.read_text()))
    table: dict = {}
    for v, reps in runs.items():
        for section in reps[0]:
            if not isinstance(reps[0][section], dict) or "ms" not in reps[0][section]:
                continue
            for fn, per in reps[0][section]["ms"].items():
                for m in per:
                    vals = [r[section]["ms"][fn][m] for r in reps if fn in r[section]["ms"]]
                    table.setdefault(f"{section} {fn}", {}).setdefault(m, {})[v] = statistics.median(vals)
    base_v, new_v = list(versions)
    print(f"\nmedian over {args.rounds} processes each, ms: {base_v} -> working tree (ratio)")
    for key, per in table.items():
        cells = [f"{m} rows {d[base_v]:.2f} -> {d[new_v]:.2f} ({d[new_v] / d[base_v]:.2f}x)" if len(d) == 2
                 else f"{m} rows {next(iter(d.values())):.2f} ({next(iter(d))}'s only)" for m, d in per.items()]
        print(f"  {key:28s} " + "  ".join(cells))
    for v, reps in runs.items():  # what each version computed, not only how fast
        checks = {section: (all(r[section]["rows_bitwise_invariant"] for r in reps),
                            max(r[section]["max_abs_error_vs_float64"] for r in reps))
                  for section in reps[0] if isinstance(reps[0][section], dict) and "rows_bitwise_invariant" in reps[0][section]}
        print(f"  {v}: " + "; ".join(f"{sec} rows bitwise independent of the row count {inv}, max |err| vs "
                                     f"float64 {err:.2e}" for sec, (inv, err) in checks.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"against": args.against, "rounds": args.rounds, "median_ms": table,
                                        "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
