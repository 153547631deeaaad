"""The compiled CPU step's attention over the static cache (issue 20's context curve, `--compile`).

A compiled step attends over all S slots of its bucketed cache under a position mask
(``models/kv.py``, static mode, SDPA with ``enable_gqa``). Are other forms of that attention
faster once compiled? Two measurements, side by side in one run:

1. ``kernels``: one query (9 heads, 3 KV heads, head dim 64: SmolLM2-135M) over 30 layers'
   K/V of S slots, each form compiled as the engine compiles its steps
   (``decoding/runner.CompiledFn``), interleaved, medians:

   - ``kernel``: the engine's static path on the CPU, ``models/cpu_attention``'s C++ op (reads the
     slots up to the query's position only; the position is S - 10, so nearly all of them, or
     each of ``--cached``); ``--flush-mb`` reads that much memory before each timed pass, so the
     K/V come from memory as in a step (where the weights evict them);
   - ``kernel-baseline``: the same op built from another version of its source
     (``--baseline-kernel``, e.g. an older commit's), both in one process;
   - ``sdpa-gqa``: ``F.scaled_dot_product_attention(..., enable_gqa=True)`` with the mask
     (the static path on CUDA, and on the CPU before the kernel);
   - ``sdpa-fold``: SDPA with each KV head's query heads folded into one head's queries;
   - ``reduce``: products and reductions (float32 inside) that inductor fuses into loops,
     each KV head's slots read once for all its query heads;
   - ``split``: ``reduce`` split along the slots in chunks, combined by their softmax maxima
     (a "flash-decoding" pass: more parallel work for one query).

2. ``steps`` (the verifier, ``--verifier``): the compiled one-token step at each of
   ``--contexts`` cached tokens with each of ``--step-forms`` as the static path's attention
   (``kernel``: the engine's own; ``kernel-baseline``: the ``--baseline-kernel`` build; ``kernel-thp``: the kernel over buffers carved from one mapping in
   transparent huge pages; ``sdpa-gqa``: the cache's ``cpu_kernel = False``; the others
   replace ``KVCache.attend`` on the runner's cache),
   interleaved; ``--capacity shared`` sizes every context's cache to the largest (one bucket).
   Each (form, cache bucket) compiles its own graph: minutes of compile time before the timing
   starts.

    PYTHONPATH=src python benchmarks/decode_attention.py --threads 2 --out benchmarks/results/decode-attention.json

A kernel change against the committed one, from memory, then in the step::

    git show HEAD:src/draftsmith/models/cpu_attention.cpp > /tmp/kernel-head.cpp
    PYTHONPATH=src python benchmarks/decode_attention.py --threads 2 --baseline-kernel /tmp/kernel-head.cpp \
        --forms kernel kernel-baseline --slots 1536 --cached 128 1024 --flush-mb 640 \
        --step-forms kernel kernel-baseline --capacity shared
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def kernel(q, K, V, keep, scale):
    """The engine's static path on the CPU: the C++ kernel over the slots up to the query's position
    (``models/cpu_attention.py``); the position is the mask's last kept slot."""
    from draftsmith.models import cpu_attention

    pos = keep.sum(-1) - 1  # keep is [m, S], true up to each query's position
    return cpu_attention.decode_attention(q, K, V, pos, 0, scale)


BASELINE_NS = "draftsmith_baseline"


def build_baseline(source: Path):
    """Another version of the kernel's C++ source (e.g. ``git show REV:src/draftsmith/models/cpu_attention.cpp``),
    built as the engine builds its own but registered as ``draftsmith_baseline::decode_attention``, so both
    run in one process: form ``kernel-baseline``."""
    from draftsmith.models import cpp_ops, cpu_attention

    # the headers it includes ("cpu_vec.h"): from beside the source, else from this checkout's
    include = source.parent if (source.parent / "cpu_vec.h").exists() else Path(cpu_attention._SOURCE).parent
    try:
        cpp_ops.build_as(source, BASELINE_NS, include=include)
    except ValueError as e:
        sys.exit(str(e))
    torch.library.register_fake(f"{BASELINE_NS}::decode_attention")(cpu_attention._fake)


def kernel_baseline(q, K, V, keep, scale):
    """``kernel`` through the ``--baseline-kernel`` build."""
    from draftsmith.models import cpu_attention

    pos = keep.sum(-1) - 1
    return getattr(torch.ops, BASELINE_NS).decode_attention(q, K, V, pos, 0, scale, cpu_attention.CHUNK)


def huge_page_buffers(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zeroed copies of ``tensors``' shapes, each its own storage, all carved in order from one private
    anonymous mapping advised for transparent huge pages and starting at a 2 MB boundary (Linux). Private:
    a shared anonymous mapping is shmem, whose huge pages follow ``shmem_enabled`` ([never] here)."""
    import mmap

    huge = 2 << 20
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // 64) * 64
    arena = mmap.mmap(-1, total + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    start = -torch.frombuffer(arena, dtype=torch.uint8, count=1).data_ptr() % huge
    return [torch.frombuffer(arena, dtype=t.dtype, count=t.numel(), offset=start + off).view(t.shape)
            for t, off in zip(tensors, offsets)]


def sdpa_gqa(q, K, V, keep, scale):
    return F.scaled_dot_product_attention(q, K, V, attn_mask=keep, scale=scale, enable_gqa=True)


def sdpa_fold(q, K, V, keep, scale):
    nh, m, hd = q.shape[1:]
    nkv = K.shape[1]
    rep = nh // nkv
    out = F.scaled_dot_product_attention(q.reshape(1, nkv, rep * m, hd), K, V,
                                         attn_mask=keep if m == 1 else keep.repeat(rep, 1), scale=scale)
    return out.reshape(1, nh, m, hd)


def reduce(q, K, V, keep, scale):
    """Queries ``[1, nh, m, hd]`` over all slots of ``K, V [1, nkv, S, hd]`` where ``keep [m, S]``."""
    nh, m, hd = q.shape[1], q.shape[2], q.shape[3]
    nkv = K.shape[1]
    rep = nh // nkv
    qg = q.reshape(nkv, rep * m, 1, hd).float()  # query heads of one KV head as rows r * m + j
    s = (qg * K[0].float()[:, None]).sum(-1) * scale  # [nkv, rep * m, S]
    s = s.masked_fill(~(keep if m == 1 else keep.repeat(rep, 1)), float("-inf"))
    out = (torch.softmax(s, -1)[..., None] * V[0].float()[:, None]).sum(-2)  # [nkv, rep * m, hd]
    return out.to(q.dtype).reshape(1, nh, m, hd)


def split(q, K, V, keep, scale, chunks: int = 8):
    """One query only: ``reduce`` over ``chunks`` runs of slots, combined exactly."""
    nh, hd = q.shape[1], q.shape[3]
    nkv, S = K.shape[1], K.shape[2]
    rep, c = nh // nkv, S // chunks
    qg = q.reshape(nkv, 1, rep, 1, hd).float()
    s = (qg * K[0].float().view(nkv, chunks, 1, c, hd)).sum(-1) * scale  # [nkv, chunks, rep, c]
    s = s.masked_fill(~keep.view(1, chunks, 1, c), float("-inf"))
    mx = s.amax(-1, keepdim=True).clamp_min(-1e30)  # a chunk wholly masked stays finite
    e = torch.exp(s - mx)
    o = (e[..., None] * V[0].float().view(nkv, chunks, 1, c, hd)).sum(-2)  # [nkv, chunks, rep, hd]
    w = torch.exp(mx.squeeze(-1) - mx.squeeze(-1).amax(1, keepdim=True))  # [nkv, chunks, rep]
    out = (o * w[..., None]).sum(1) / (e.sum(-1) * w).sum(1)[..., None]
    return out.to(q.dtype).reshape(1, nh, 1, hd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sections", nargs="+", default=["kernels", "steps"], choices=["kernels", "steps"])
    ap.add_argument("--slots", type=int, nargs="+", default=[512, 1536], help="S of the kernels section")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024], help="cached tokens of the steps section")
    ap.add_argument("--cached", type=int, nargs="+", default=None,
                    help="kernels section: cached positions to attend at (each below every --slots); default S - 9")
    ap.add_argument("--flush-mb", type=int, default=0,
                    help="kernels section: read this many MB (a sum, no writes) before each timed pass, so the "
                         "K/V come from memory as in a step, where the weights evict them (0: none)")
    ap.add_argument("--forms", nargs="+", default=["kernel", "sdpa-gqa", "sdpa-fold", "reduce", "split"],
                    choices=["kernel", "kernel-baseline", "sdpa-gqa", "sdpa-fold", "reduce", "split"],
                    help="forms of the kernels section")
    ap.add_argument("--step-forms", nargs="+", default=["kernel", "sdpa-gqa"],
                    choices=["kernel", "kernel-baseline", "kernel-thp", "sdpa-gqa", "sdpa-fold", "reduce", "split"],
                    help="attention forms of the steps section (kernel-thp: the kernel over the cache's buffers "
                         "carved from one mapping in transparent huge pages, K beside V per layer; BENCHMARKS 9n)")
    ap.add_argument("--baseline-kernel", type=Path, default=None,
                    help="another version of models/cpu_attention.cpp for the forms kernel-baseline (e.g. `git show "
                         "REV:src/draftsmith/models/cpu_attention.cpp > old.cpp`)")
    ap.add_argument("--capacity", choices=["per-point", "shared"], default="per-point",
                    help="steps section: each context's cache sized to it (its own capacity bucket and graph) or "
                         "every cache sized to the largest context (one graph, as one growing request sees)")
    ap.add_argument("--repeats", type=int, default=60, help="timed calls per point")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import draftsmith.models.kv as kv
    from draftsmith.decoding.runner import CompiledFn

    all_forms = {"kernel": kernel, "kernel-baseline": kernel_baseline, "sdpa-gqa": sdpa_gqa, "sdpa-fold": sdpa_fold,
                 "reduce": reduce, "split": split}
    forms = {name: all_forms[name] for name in args.forms}
    if any(f.startswith("kernel") for f in args.forms + args.step_forms):
        from draftsmith.models import cpu_attention

        t0 = time.perf_counter()
        if not cpu_attention.available():
            sys.exit("the CPU decode-attention kernel did not build (see the warning above)")
        out_build_s = time.perf_counter() - t0
    if "kernel-baseline" in args.forms + args.step_forms:
        if args.baseline_kernel is None:
            sys.exit("the form kernel-baseline needs --baseline-kernel")
        build_baseline(args.baseline_kernel)
    out: dict = {"threads": args.threads, "repeats": args.repeats, "loadavg_start": os.getloadavg()[0],
                 "baseline_kernel": str(args.baseline_kernel) if args.baseline_kernel else None,
                 "flush_mb": args.flush_mb, "capacity": args.capacity,
                 "torch": torch.__version__, "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE")}
    if any(f.startswith("kernel") for f in args.forms + args.step_forms):
        out["kernel_build_or_load_s"] = out_build_s
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        if "kernels" in args.sections:
            L, nkv, rep, hd = 30, 3, 3, 64
            res: dict = {}
            flush = torch.ones(args.flush_mb * 2**18) if args.flush_mb else None  # float32: MB * 2^18 values
            for S in args.slots:
                Ks = [torch.randn(1, nkv, S, hd, generator=g) for _ in range(L)]
                Vs = [torch.randn(1, nkv, S, hd, generator=g) for _ in range(L)]
                q = torch.randn(1, nkv * rep, 1, hd, generator=g)

                def layers(f):
                    def run(q, Ks, Vs, pos):
                        keep = torch.arange(Ks[0].shape[2])[None, :] <= pos[:, None]
                        return [f(q, K, V, keep, 0.125) for K, V in zip(Ks, Vs)]
                    return run

                comp = {name: CompiledFn(layers(f), cpu) for name, f in forms.items()}
                for C in args.cached or [S - 9]:
                    if not 1 <= C <= S:
                        sys.exit(f"--cached {C}: outside 1..{S} slots")
                    pos = torch.tensor([C - 1])
                    ref = layers(sdpa_gqa)(q, Ks, Vs, pos)
                    row: dict = {}
                    for name, f in comp.items():
                        t0 = time.perf_counter()
                        got = f(q, Ks, Vs, pos)
                        row[name] = {"first_call_s": time.perf_counter() - t0,
                                     "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(got, ref))}
                    times = {name: [] for name in comp}
                    for r in range(args.repeats + 3):
                        names = list(comp)[r % len(comp):] + list(comp)[:r % len(comp)]
                        for name in names:
                            if flush is not None:
                                flush.sum()
                            t0 = time.perf_counter()
                            comp[name](q, Ks, Vs, pos)
                            if r >= 3:
                                times[name].append(time.perf_counter() - t0)
                    for name, ts in times.items():
                        row[name]["median_ms"] = 1e3 * statistics.median(ts)
                    kv_mb = 2 * L * nkv * C * hd * 4 / 1e6  # what the kernel reads; SDPA reads all S slots
                    for name in row:
                        row[name]["GB_per_s"] = kv_mb / row[name]["median_ms"]
                    res[f"{S}@{C}"] = row
                    for name, d in row.items():
                        print(f"[kernels] S={S} cached {C} {name:15s} {d['median_ms']:6.3f} ms  {d['GB_per_s']:5.1f} GB/s "
                              f"of the cached K/V (first call {d['first_call_s']:.1f} s, max |diff| "
                              f"{d['max_abs_diff']:.1e})", flush=True)
            out["kernels"] = res

        if "steps" in args.sections:
            from draftsmith.decoding import runner as runner_mod
            from draftsmith.models.verifier import load_verifier

            model, _, fp = load_verifier(args.verifier, dtype="float32", device="cpu")
            out["verifier"] = f"{args.verifier} ({fp})"
            V = model.config.vocab_size

            def attend_with(form):
                def attend(cache, i, q, k, v, pos, scale):
                    """The static path with ``form``'s attention (a one-token step: m = 1); eager reads unchanged."""
                    if not cache.static or q.shape[2] != 1:
                        return kv.KVCache.attend(cache, i, q, k, v, pos, scale)
                    keep = cache.write_static(i, k, v, pos)
                    return form(q, cache.keys[i], cache.values[i], keep, scale)
                return attend

            variants = args.step_forms
            runners, compile_s = {}, {}
            for name in variants:
                runner_mod._COMPILED.pop(model, None)  # a compiled step (its own graphs) per form
                for C in args.contexts:
                    cap = (max(args.contexts) if args.capacity == "shared" else C) + 8
                    r = runner_mod.verifier_runner(model, cap, compile=True, role=f"{name}-{C}")
                    use = name.startswith("kernel")
                    r.cache.cpu_kernel = use  # the engine's default where the kernel builds
                    assert r.cache.cpu_kernel == use, "the kernel did not build"
                    if name == "kernel-thp":
                        bufs = huge_page_buffers([t for pair in zip(r.cache.keys, r.cache.values) for t in pair])
                        r.cache.keys, r.cache.values = bufs[0::2], bufs[1::2]
                    if name == "kernel-baseline":  # its static path with the baseline build's op
                        def attend(cache, i, q, k, v, pos, scale):
                            if not cache.static:
                                return kv.KVCache.attend(cache, i, q, k, v, pos, scale)
                            cache._write_slots(i, k, v, pos)
                            return getattr(torch.ops, BASELINE_NS).decode_attention(
                                q, cache.keys[i], cache.values[i], pos, cache.windows[i] or 0, scale,
                                cpu_attention.CHUNK)
                        r.cache.attend = attend.__get__(r.cache)
                    elif name not in ("kernel", "kernel-thp", "sdpa-gqa"):
                        r.cache.attend = attend_with(all_forms[name]).__get__(r.cache)
                    compile_s[f"{name}@{C}"] = r.step.warmup(r.cache, r.aux, (1,))
                    r.forward(torch.randint(2, V, (C,), generator=g), 1)
                    runners[(name, C)] = r
                    print(f"[steps] {name} at {C} cached ({r.cache.capacity} slots): compiled in "
                          f"{compile_s[f'{name}@{C}']:.0f} s", flush=True)
            tok = torch.randint(2, V, (1,), generator=g)
            keys = list(runners)
            times = {k: [] for k in keys}
            for rep in range(args.repeats + 2):
                shift = rep % len(keys)
                for key in keys[shift:] + keys[:shift]:
                    r = runners[key]
                    t0 = time.perf_counter()
                    r.forward(tok, 1)
                    if rep >= 2:
                        times[key].append(time.perf_counter() - t0)
                    r.rollback(key[1])
            med = {name: {C: 1e3 * statistics.median(times[(name, C)]) for C in args.contexts} for name in variants}
            lo, hi = min(args.contexts), max(args.contexts)
            out["steps"] = {"median_ms": med, "ratio_hi_over_lo": {n: med[n][hi] / med[n][lo] for n in med},
                            "compile_s": compile_s,
                            "capacity": {str(C): runners[(variants[0], C)].cache.capacity for C in args.contexts}}
            for name in variants:
                print(f"[steps] {name:15s} " + "  ".join(f"{C}: {ms:.2f} ms" for C, ms in med[name].items())
                      + f"  {hi}/{lo} = {med[name][hi] / med[name][lo]:.3f}", flush=True)
    out["loadavg_end"] = os.getloadavg()[0]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
