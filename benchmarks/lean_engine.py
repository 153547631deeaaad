"""Lean engine benchmark (issue 20): the engine's own costs, side by side in one run.

Measurable with any draft, even an untrained one. Five sections, each interleaving
what it compares (the order rotates), on one verifier (SmolLM2-135M float32 by default):

1. ``plain``: our plain loop against ``transformers.generate`` on MT-Bench first
   turns (greedy), and against our loop on the transformers forward with a
   ``DynamicCache`` (``engine="hf-dynamic"``: the engine before issue 20), plus the
   compiled lean loop with ``--compile``. Per-prompt paired ratios; identical outputs.
   Target: ours / generate >= 1.25, every output identical.
2. ``context``: a one-token verifier step at C cached tokens for C in ``--contexts``,
   lean vs hf-dynamic (the curve); with ``--compile`` the compiled step with each context's cache
   sized to it and sized to the largest context (``--context-capacity``); with ``--weight-layout cpp``
   also the eager step with its attention on SDPA (``lean-sdpa``; cpp's is the C++ kernel). Target: lean step at
   1024 within 10% of the one at 128.
3. ``draft``: one cached EAGLE-3 draft step (random weights; draft vocab ``--draft-vocab``)
   against a verifier one-token step at the same context, and its share of the weights a
   verifier step reads (the floor a GEMV-bound step can reach). On CPU also the draft with
   int8 weights (``--draft-precision int8``; in the cpp layout on the few-row kernel's int8 form and on
   ATen's int8 kernel side by side), and with ``--compile`` every row compiled
   (compiled draft over compiled verifier). Target: <= 5%.
4. ``rss``: peak RSS of a child process that decodes to ``--rss-context`` tokens of
   context, plainly and with an EAGLE-3 draft, lean vs hf-dynamic (and, with
   ``--baseline-src``, an older checkout's engine). Target: lean <= 1.10x the old engine.
5. ``layout`` (not in the default set): verify steps of 1..N tokens with the verifier's weights
   as loaded, held ``[in, out]`` and multiplied by oneDNN (CPU; ``--weight-layout``),
   alternating per pass.

Timings on a shared machine are noise-bound; compare ratios within one run only.

Usage (SmolLM2, CPU, float32)::

    PYTHONPATH=src python benchmarks/lean_engine.py --threads 2 --out benchmarks/results/lean-engine.json

On a GPU (bfloat16, a random 1B-shaped Llama, compiled vs eager)::

    PYTHONPATH=src python benchmarks/lean_engine.py --verifier random-1b --device cuda --dtype bfloat16 \\
        --compile --out benchmarks/results/lean-engine-cuda.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

RANDOM_SHAPES = {  # a random Llama, for hosts without the packaged verifier or for GPU-sized runs
    "random-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
    "random-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512),
}


def load(args: argparse.Namespace):
    """(model, tokenizer or None, label)."""
    if args.verifier in RANDOM_SHAPES:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(**RANDOM_SHAPES[args.verifier], max_position_embeddings=8192, tie_word_embeddings=False,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1)
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        device = "cuda" if args.device in ("cuda", "auto") and torch.cuda.is_available() else args.device
        device = "cpu" if device == "auto" else device
        return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval(), None, args.verifier
    from draftsmith.models.verifier import load_verifier

    model, tok, fp = load_verifier(args.verifier, dtype=args.dtype, device=args.device)
    return model, tok, f"{args.verifier} ({fp})"


def prompts(args: argparse.Namespace, model, tok) -> list[list[int]]:
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(2, model.config.vocab_size, (int(n),), generator=g).tolist()
                for n in torch.randint(32, 160, (args.num_prompts,), generator=g)]
    from draftsmith.data.sources import eval_set

    return [ids for _, ids in eval_set("mt-bench", tok, limit=args.num_prompts)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eagle3_draft(model, vocab: int):
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Draft

    torch.manual_seed(1)
    cfg = Eagle3Config.from_verifier(model.config, draft_vocab_size=vocab)
    w = next(model.parameters())
    draft = Eagle3Draft(cfg).to(device=w.device, dtype=w.dtype).eval()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return draft


def random_draft_proposer(model, vocab: int, precision: str):
    """An EAGLE-3 proposer over :func:`eagle3_draft` at ``precision`` (``as-loaded`` or ``int8``)."""
    from draftsmith.decoding.proposers import Eagle3Proposer
    from draftsmith.models.quantize import quantize_draft

    return Eagle3Proposer(quantize_draft(eagle3_draft(model, vocab), precision))


def add_random_draft_args(ap, max_new_tokens: int) -> None:
    """The arguments of a probe that runs the verifier with a random draft (:func:`random_draft_proposer`)."""
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--draft-precision", default="int8", choices=["as-loaded", "int8"])
    ap.add_argument("--num-draft-tokens", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)


# ----------------------------------------------------------------------------------------- 1. plain loop
def section_plain(args, model, tok, out: dict) -> None:
    from draftsmith import generate
    from draftsmith.bench.stats import bootstrap_ci, paired_ratios, summarize

    device = next(model.parameters()).device
    gen_cfg = model.generation_config
    eos = gen_cfg.eos_token_id
    pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (
        eos if isinstance(eos, int) else (eos[0] if eos else 0))
    n = args.max_new_tokens

    def hf(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            seq = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                 temperature=None, top_k=None, top_p=None, pad_token_id=pad)
        return seq[0, len(ids):].tolist()

    def ours(engine: str, compile: bool = False) -> Callable[[list[int]], list[int]]:
        def run(ids: list[int]) -> list[int]:
            o = generate(model, ids, max_new_tokens=n, engine=engine, compile=compile)
            compile_s.setdefault(engine + ("+compiled" if compile else ""), []).append(o.stats["compile_seconds"])
            return o.token_ids
        return run

    compile_s: dict[str, list[float]] = {}
    rows: dict[str, Callable[[list[int]], list[int]]] = {
        "hf-generate": hf, "ours-lean": ours("auto"), "ours-hf-dynamic": ours("hf-dynamic")}
    if args.compile:
        rows["ours-lean-compiled"] = ours("auto", compile=True)
    if out.get("weight_layout") in ("onednn", "cpp"):  # also as loaded (MKL): what generate gives out of the box
        rows["hf-generate@out-in"] = as_loaded(model, hf)
        rows["ours-lean@out-in"] = as_loaded(model, ours("auto"))
    ps = prompts(args, model, tok)
    names = list(rows)
    for name in names:  # warm-up (and compile) on the first prompt, untimed
        rows[name](ps[0])
    tps: dict[str, list[list[float]]] = {k: [[] for _ in ps] for k in names}
    toks: dict[str, list[list[int]]] = {k: [[] for _ in ps] for k in names}
    for rep in range(args.repeats):
        for p, ids in enumerate(ps):
            shift = (p + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                sync(device)
                t0 = time.perf_counter()
                got = rows[name](ids)
                sync(device)
                tps[name][p].append(len(got) / (time.perf_counter() - t0))
                toks[name][p] = got
            print(f"  plain: rep {rep + 1}/{args.repeats} prompt {p + 1}/{len(ps)}", file=sys.stderr, flush=True)
    med = {k: [statistics.median(v) for v in tps[k]] for k in names}
    ratios = {}
    for num, den in [("ours-lean", "hf-generate"), ("ours-lean", "ours-hf-dynamic"),
                     ("ours-hf-dynamic", "hf-generate"), ("ours-lean-compiled", "ours-lean"),
                     ("ours-lean-compiled", "hf-generate"), ("ours-lean", "hf-generate@out-in"),
                     ("ours-lean@out-in", "hf-generate@out-in"), ("hf-generate", "hf-generate@out-in")]:
        if num in med and den in med:
            r = paired_ratios(med[num], med[den])
            ratios[f"{num} / {den}"] = {"median": float(np.median(r)), "ci95": list(bootstrap_ci(r)),
                                        "min": min(r), "max": max(r), "per_prompt": r}
    out["plain"] = {
        "prompts": len(ps), "max_new_tokens": n, "repeats": args.repeats,
        "tokens_per_second": {k: summarize(v) for k, v in med.items()},
        "ratios": ratios,
        "identical_to_hf_generate": {k: sum(a == b for a, b in zip(toks[k], toks["hf-generate"])) for k in names},
        "identical_to_hf_generate_as_loaded": (
            {k: sum(a == b for a, b in zip(toks[k], toks["hf-generate@out-in"])) for k in names}
            if "hf-generate@out-in" in toks else None),
        "compile_seconds": compile_s,
        "target_ours_over_generate_1.25": ratios["ours-lean / hf-generate"]["median"] >= 1.25,
    }


def as_loaded(model, fn: Callable[[list[int]], list[int]]) -> Callable[[list[int]], list[int]]:
    """``fn`` run with the Linear layers that ``--weight-layout onednn`` or ``cpp`` switched put back as
    loaded (MKL's GEMM) for the call, and switched again after."""
    from draftsmith.models.verifier import CppLinear, OneDNNLinear

    def run(ids: list[int]) -> list[int]:
        mods = [(m, type(m)) for m in model.modules() if type(m) in (OneDNNLinear, CppLinear)]
        for m, _ in mods:
            m.__class__ = torch.nn.Linear
        try:
            return fn(ids)
        finally:
            for m, kind in mods:
                m.__class__ = kind
    return run


# ----------------------------------------------------------------------------------------- 2. context curve
def section_context(args, model, out: dict) -> None:
    from draftsmith.decoding.runner import verifier_runner
    from draftsmith.models.kv import eager_cpu_attention

    device = next(model.parameters()).device
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    paths = ["lean", "hf-dynamic"]
    if args.weight_layout == "cpp":  # the eager steps' attention through the C++ kernel, and on SDPA beside it
        paths.insert(1, "lean-sdpa")
    if args.compile:
        paths += [p for p, mode in (("lean-compiled", "per-point"), ("lean-compiled-shared", "shared"))
                  if mode in args.context_capacity]
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        runners = {}
        for C in args.contexts:
            ctx = torch.randint(2, V, (C,), generator=g).to(device)
            for p in paths:
                compiled = p.startswith("lean-compiled")
                # per-point: each context its own cache, sized to it (its capacity bucket, hence its own graph);
                # shared: every context's cache sized to the largest, as one request growing to it sees
                capacity = (max(args.contexts) if p.endswith("-shared") else C) + 8
                r = verifier_runner(model, capacity, compile=compiled, mode="auto" if p.startswith("lean") else p,
                                    warmup_shapes=(1,), role=f"context-{p}-{C}")
                r.forward(ctx, 1)
                runners[(p, C)] = r
                times[(p, C)] = []
        tok = torch.randint(2, V, (1,), generator=g).to(device)
        keys = list(runners)
        for rep in range(args.step_repeats + 2):  # 2 warm-up passes
            shift = rep % len(keys)
            for key in keys[shift:] + keys[:shift]:
                r = runners[key]
                with eager_cpu_attention(False) if key[0] == "lean-sdpa" else contextlib.nullcontext():
                    sync(device)
                    t0 = time.perf_counter()
                    r.forward(tok, 1)
                    sync(device)
                if rep >= 2:
                    times[key].append(time.perf_counter() - t0)
                r.rollback(key[1])
    med = {f"{p}@{C}": 1e3 * statistics.median(v) for (p, C), v in times.items()}
    curve = {p: {C: med[f"{p}@{C}"] for C in args.contexts} for p in paths}
    ratio = {p: (curve[p][1024] / curve[p][128] if 1024 in curve[p] and 128 in curve[p] else None) for p in paths}
    slots = {p: {C: runners[(p, C)].cache.capacity for C in args.contexts} for p in paths if p.startswith("lean")}
    out["context"] = {"median_ms": curve, "step_1024_over_128": ratio, "repeats": args.step_repeats,
                      "cache_slots": slots,
                      "within_10pct": {p: r is not None and r <= 1.10 for p, r in ratio.items()},
                      "target_within_10pct": ratio.get("lean") is not None and ratio["lean"] <= 1.10}


def plot_context(out: dict, png: Path) -> Path | None:
    """The context section as a picture (issue 20: "show the curve"): each path's one-token step
    against the tokens cached, and the same over its own step at 128 with the 1.10 target."""
    c = out.get("context")
    if not c:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    left, right = fig.subplots(1, 2)
    for path, curve in c["median_ms"].items():
        xs = sorted(int(x) for x in curve)
        ms = [curve[str(x)] if str(x) in curve else curve[x] for x in xs]
        left.plot(xs, ms, "o-", label=path)
        if 128 in xs:
            right.plot(xs, [m / ms[xs.index(128)] for m in ms], "o-", label=path)
    right.axhline(1.10, color="gray", ls="--", lw=1, label="target at 1024: <= 1.10")
    right.axvline(1024, color="gray", ls=":", lw=1)
    cpu = (out.get("environment") or {}).get("cpu_model") or out.get("device", "")
    contexts = sorted({int(x) for curve in c["median_ms"].values() for x in curve})
    for ax, ylabel in ((left, "one-token step [ms], median"), (right, "step / its step at 128 cached")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(x) for x in contexts])
        ax.set(xlabel="tokens cached", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"One-token verifier step vs context: {out.get('verifier')} {out.get('dtype')}, "
                 f"weights {out.get('weight_layout')}, {cpu}")
    fig.tight_layout()
    fig.savefig(png, dpi=110, bbox_inches="tight")
    return png


def section_layout(args, model, out: dict) -> None:
    """Verify steps of M = 1..``--layout-rows`` tokens at ``--layout-context`` cached tokens, with the
    verifier's Linear weights as loaded (out-in), held [in, out] (``weights_in_out``) and multiplied
    by oneDNN (``linears_onednn``), the layouts alternating per pass (each pass re-lays the weights
    and builds its runners)."""
    from draftsmith.decoding.runner import verifier_runner
    from draftsmith.models.verifier import WEIGHT_LAYOUTS, weight_layout

    device = next(model.parameters()).device
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    C = args.layout_context
    ctx = torch.randint(2, V, (C,), generator=g).to(device)
    rows = list(range(1, args.layout_rows + 1))
    toks = {m: torch.randint(2, V, (m,), generator=g).to(device) for m in rows}
    layouts = list(WEIGHT_LAYOUTS) if device.type == "cpu" else ["out-in", "in-out"]  # oneDNN: CPU only
    times: dict[tuple[str, int], list[float]] = {(lay, m): [] for lay in layouts for m in rows}
    with torch.inference_mode():
        for rep in range(args.layout_passes):
            order = layouts if rep % 2 == 0 else layouts[::-1]
            for lay in order:
                with weight_layout(model, lay):
                    r = verifier_runner(model, C + 16, mode="auto", role="layout")
                    r.forward(ctx, 1)
                    for i in range(args.step_repeats // args.layout_passes + 2):  # 2 warm-up rounds
                        for m in rows[i % len(rows):] + rows[:i % len(rows)]:
                            sync(device)
                            t0 = time.perf_counter()
                            r.forward(toks[m], m)
                            sync(device)
                            if i >= 2:
                                times[(lay, m)].append(time.perf_counter() - t0)
                            r.rollback(C)
    med = {lay: {m: 1e3 * statistics.median(times[(lay, m)]) for m in rows} for lay in layouts}
    out["layout"] = {"context": C, "median_ms": med, "steps_per_point": len(times[("out-in", 1)]),
                     "over_one_token": {lay: {m: med[lay][m] / med[lay][1] for m in rows} for lay in med},
                     "over_out_in": {lay: {m: med[lay][m] / med["out-in"][m] for m in rows} for lay in layouts}}


# ----------------------------------------------------------------------------------------- 3. draft step
def old_draft_step(draft, input_ids, hidden, position_ids, cache: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft step before issue 20, for reference: the cache grows by concatenation and
    its KV heads are repeated for every step."""
    import torch.nn.functional as F

    layer = draft.layers[0]
    rep = layer.self_attn.nh // layer.self_attn.nkv

    def attend(q, k, v):
        if cache[0] is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        cache[0], cache[1] = k, v
        m, S = q.shape[2], k.shape[2]
        mask = torch.ones(m, S, dtype=torch.bool, device=q.device).tril(S - m) if m > 1 else None
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=mask, scale=draft.scale)
        return out.transpose(1, 2).reshape(1, m, -1)

    e = draft.embed_tokens(input_ids)
    cos, sin = draft.rope(position_ids, e)
    return draft.head(layer(e, hidden, cos, sin, attend))


def section_draft(args, model, out: dict) -> None:
    from draftsmith.decoding.proposers import Eagle3Proposer
    from draftsmith.models.quantize import Int8WeightLinear, quantize_draft
    from draftsmith.models.verifier import weight_layout
    from draftsmith.decoding.runner import verifier_runner
    from draftsmith.decoding.sampling import SamplingParams

    device = next(model.parameters()).device
    V, C = model.config.vocab_size, args.draft_context
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams()
    res: dict[str, Any] = {"context": C, "repeats": args.step_repeats, "weight_layout": args.weight_layout}
    with torch.inference_mode(), contextlib.ExitStack() as held:
        ctx = torch.randint(2, V, (C,), generator=g).to(device)
        verifiers = {"verifier": verifier_runner(model, C + 8)}
        if args.compile:
            verifiers["verifier-compiled"] = verifier_runner(model, C + 8, compile=True, warmup_shapes=(1,),
                                                             role="draft-section")
        for r in verifiers.values():
            r.forward(ctx, 1)
        tok = torch.randint(2, V, (1,), generator=g).to(device)
        proposers = {}

        def ready(d, compile: bool) -> Eagle3Proposer:
            """A proposer for ``d`` with the same ``C`` cached positions as the verifier."""
            prop = Eagle3Proposer(d)
            prop.reset()
            prop.prepare(C + 8, compile=compile)
            w = d.fc.weight
            prop._step(ctx[None], torch.randn(1, C, d.config.hidden_size, generator=g).to(device=device, dtype=w.dtype),
                       torch.arange(1, C + 1, device=device)[None])
            return prop

        for vd in args.draft_vocab:
            vd = str(vd)
            draft = eagle3_draft(model, min(int(vd), V))
            w = draft.fc.weight
            h = torch.randn(1, 1, draft.config.hidden_size, generator=g).to(device=device, dtype=w.dtype)
            # the same draft with int8 weights (--draft-precision int8) where asked; in the cpp layout its
            # step layers run the few-row kernel's int8 form (W8A32), and "-int8-aten" times the same int8
            # draft on ATen's _weight_int8pack_mm (W8A16, the other layouts' kernel) beside it
            variants = {vd: draft, **({f"{vd}-int8": quantize_draft(draft, "int8")} if args.draft_int8 else {})}
            if args.draft_int8 and args.weight_layout == "cpp":
                variants[f"{vd}-int8-aten"] = quantize_draft(draft, "int8")
            for name, d in variants.items():
                if not name.endswith("-aten"):
                    held.enter_context(weight_layout(d, args.weight_layout))  # as the verifier's (as the bench does)
                for compiled in (False, True) if args.compile else (False,):
                    proposers[name + ("-compiled" if compiled else "")] = (ready(d, compiled), h)
        # the old step on the first vocabulary's draft, from the same cached context
        old_vd = str(args.draft_vocab[0])
        old_prop, old_h = proposers[old_vd]
        old_cache: list = [None, None]
        old_draft_step(old_prop.draft, ctx[None], torch.randn(1, C, old_h.shape[-1], generator=g).to(old_h),
                       torch.arange(1, C + 1, device=device)[None], old_cache)
        # what each draft's projections multiply with (class name -> count), read inside the layouts
        res["layer_kinds"] = {f"draft-{name}": dict(collections.Counter(
            type(m).__name__ for m in p.draft.modules() if isinstance(m, (torch.nn.Linear, Int8WeightLinear))))
            for name, (p, _) in proposers.items()}
        names = [*verifiers, *(f"draft-{vd}" for vd in proposers), f"draft-{old_vd}-before-issue-20"]
        # per rep: a verifier step's time, or a draft chain's step times (a round drafts k in a row)
        times: dict[str, list[list[float]]] = {n: [] for n in names}
        K = args.draft_chain
        for rep in range(args.step_repeats + 2):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                if name in verifiers:
                    sync(device)
                    t0 = time.perf_counter()
                    verifiers[name].forward(tok, 1)
                    sync(device)
                    if rep >= 2:
                        times[name].append([time.perf_counter() - t0])
                    verifiers[name].rollback(C)
                    continue
                # a round starts after a verifier step (which evicts the draft's weights from the caches)
                verifiers["verifier"].forward(tok, 1)
                verifiers["verifier"].rollback(C)
                chain, t = [], tok
                if name.endswith("before-issue-20"):
                    prop, h = old_prop, old_h
                else:
                    prop, h = proposers[name.removeprefix("draft-")]
                for i in range(K):
                    p = torch.tensor([[C + 1 + i]], device=device)
                    sync(device)
                    t0 = time.perf_counter()
                    if name.endswith("before-issue-20"):
                        logits, h = old_draft_step(prop.draft, t.reshape(1, 1), h, p, old_cache)
                    else:
                        logits, h = prop._step(t.reshape(1, 1), h, p)  # one cached draft step ...
                    t = prop._choose(logits[0, -1], greedy, None)[0]  # ... and its token (argmax, d2t)
                    h = h[:, -1:]
                    sync(device)
                    chain.append(time.perf_counter() - t0)
                if rep >= 2:
                    times[name].append(chain)
                if name.endswith("before-issue-20"):
                    old_cache[:] = [old_cache[0][:, :, :C], old_cache[1][:, :, :C]]
                else:
                    prop.cache.rollback(C)
    first = {k: 1e3 * statistics.median(c[0] for c in v) for k, v in times.items()}
    mean = {k: 1e3 * statistics.median(statistics.fmean(c) for c in v) for k, v in times.items()}
    res["draft_chain"] = K
    res["median_ms"] = mean  # verifier: one step; drafts: the mean step of a chain of K after a verifier step
    res["first_step_ms"] = first  # drafts: the chain's first step (weights cold)
    if K > 1:  # drafts: the chain's later steps (what each extra drafted token costs)
        res["later_steps_ms"] = {k: 1e3 * statistics.median(statistics.fmean(c[1:]) for c in v)
                                 for k, v in times.items() if not k.startswith("verifier")}

    def over(ms: dict[str, float]) -> dict[str, float]:
        # a compiled draft step over the compiled verifier step, an eager one over the eager
        return {k: ms[k] / ms["verifier-compiled" if k.endswith("-compiled") else "verifier"]
                for k in ms if not k.startswith("verifier")}

    res["draft_over_verifier"] = over(mean)
    res["first_step_over_verifier"] = over(first)
    if K > 1:
        res["later_steps_over_verifier"] = over({**res["later_steps_ms"], **{v: mean[v] for v in verifiers}})
    res["target_5pct"] = {k: v <= 0.05 for k, v in res["draft_over_verifier"].items()}
    # The floor a step can reach: its share of the matmul weights a verifier step reads
    # (a one-token step is a chain of GEMVs, bound by the weights it reads).
    res["weight_share"] = {f"draft-{vd}": draft_step_params(p.draft) / linear_params(model)
                           for vd, (p, _) in proposers.items() if "-" not in vd}
    # int8 weights are a quarter of float32's bytes: the floor of a step that reads them
    res["weight_bytes_share"] = {**res["weight_share"], **{
        f"draft-{vd}": draft_step_bytes(p.draft) / linear_bytes(model)
        for vd, (p, _) in proposers.items() if vd.endswith("-int8")}}
    res["compile"] = bool(args.compile)
    out["draft"] = res


def linear_params(module: torch.nn.Module) -> int:
    """Parameters of the linear layers (output head included) a forward of ``module`` multiplies by."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def draft_step_params(draft) -> int:
    """Linear parameters one cached EAGLE-3 draft step uses: its layer and head, not ``fc``
    (which maps the verifier's hidden states in the first step of a round only)."""
    return linear_params(draft.layers) + draft.lm_head.weight.numel()


def linear_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights of every linear layer (float or int8 weight-only) a forward of ``module`` reads."""
    from draftsmith.models.quantize import Int8WeightLinear

    return sum(m.weight.numel() * m.weight.element_size() if isinstance(m, torch.nn.Linear)
               else m.qweight.numel() + m.scale.numel() * m.scale.element_size()
               for m in module.modules() if isinstance(m, (torch.nn.Linear, Int8WeightLinear)))


def draft_step_bytes(draft) -> int:
    """Weight bytes one cached EAGLE-3 draft step reads: its layer and head (see draft_step_params)."""
    return linear_bytes(draft.layers) + linear_bytes(draft.lm_head)


# ----------------------------------------------------------------------------------------- 4. peak RSS
def rss_child(args: argparse.Namespace) -> None:
    """Decode to ``--rss-context`` tokens of context once, then print the peak RSS (one JSON line)."""
    import inspect

    from draftsmith import generate

    model, _, _ = load(args)
    V = model.config.vocab_size
    n = args.max_new_tokens
    ids = torch.randint(2, V, (args.rss_context - n,), generator=torch.Generator().manual_seed(0)).tolist()
    proposer = None
    if args.rss_child.endswith("+eagle3"):
        try:
            from draftsmith.decoding.proposers import Eagle3Proposer
        except ImportError:  # an older checkout
            from draftsmith.models.eagle3 import Eagle3Proposer
        proposer = Eagle3Proposer(eagle3_draft(model, min(args.draft_vocab[0], V)))
    kw = {}
    if "engine" in inspect.signature(generate).parameters:
        kw["engine"] = args.rss_child.split("+")[0]
    before = _vm("VmRSS")
    out = generate(model, ids, proposer=proposer, max_new_tokens=n, eos_token_id=[], num_draft_tokens=3, **kw)
    print(json.dumps({"peak_rss": _vm("VmHWM"), "rss_before_generate": before, "new_tokens": len(out.token_ids),
                      "engine": out.stats.get("engine", "baseline")}))


def _vm(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) * 1024 if m else -1


def section_rss(args, out: dict) -> None:
    variants = [("lean", None), ("hf-dynamic", None)]
    if args.baseline_src:
        variants.append(("baseline", args.baseline_src))
    res: dict[str, Any] = {"context": args.rss_context}
    for kind in ("plain", "eagle3"):
        for name, src in variants:
            key = f"{name}+eagle3" if kind == "eagle3" else name
            env = dict(os.environ, PYTHONPATH=str(Path(src or "src").resolve()))
            cmd = [sys.executable, __file__, "--rss-child", key, "--verifier", args.verifier, "--dtype", args.dtype,
                   "--device", args.device, "--rss-context", str(args.rss_context), "--max-new-tokens",
                   str(args.max_new_tokens), "--draft-vocab", str(args.draft_vocab[0]),
                   *(["--threads", str(args.threads)] if args.threads is not None else [])]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            line = (p.stdout.strip().splitlines() or ["{}"])[-1]
            res[key] = json.loads(line) if p.returncode == 0 else {"error": p.stderr[-2000:]}
            print(f"  rss: {key}: {res[key].get('peak_rss', 'error')}", file=sys.stderr, flush=True)
    for kind in ("", "+eagle3"):
        for old in ("hf-dynamic", "baseline"):
            a, b = res.get("lean" + kind, {}), res.get(old + kind, {})
            if "peak_rss" in a and "peak_rss" in b:
                res[f"lean{kind} / {old}{kind}"] = a["peak_rss"] / b["peak_rss"]
    out["rss"] = res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m", help="verifier spec, or random-1b / random-tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--weight-layout", choices=["auto", "out-in", "in-out", "onednn", "cpp"], default="out-in",
                    help="how the plain, context and draft sections hold and multiply the Linear weights (as "
                         "loaded, [in, out], through oneDNN, through draftsmith's few-row kernel, or auto: the one "
                         "draftsmith bench's --weight-layout auto picks here, by its own probe); with onednn or "
                         "cpp (picked or asked) the plain section also runs generate and our loop as loaded")
    ap.add_argument("--layout-context", type=int, default=256, help="cached positions in the layout section")
    ap.add_argument("--layout-rows", type=int, default=6, help="verify steps of 1..N tokens (layout section)")
    ap.add_argument("--layout-passes", type=int, default=4, help="alternations of the two layouts (layout)")
    ap.add_argument("--sections", nargs="+", default=None, choices=["plain", "context", "draft", "rss", "layout"],
                    help="default: plain context draft, and rss on the CPU (it reads the process's resident "
                         "memory, which on a GPU holds neither the weights nor the cache)")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts (section plain)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--context-capacity", nargs="+", choices=["per-point", "shared"], default=["per-point", "shared"],
                    help="compiled rows of the context section: each context's cache sized to it (per-point: its "
                         "own capacity bucket and graph) and/or every cache sized to the largest context (shared: "
                         "one graph, as one request growing to it sees); the CPU kernel reads only the cached "
                         "slots, while CUDA's SDPA reads all of them")
    ap.add_argument("--step-repeats", type=int, default=60, help="timed steps per point (context, draft)")
    ap.add_argument("--draft-context", type=int, default=128, help="cached positions in the draft section")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[8192, 32000])
    ap.add_argument("--draft-chain", type=int, default=3,
                    help="draft steps timed in a row after each verifier step (section draft; a round's k)")
    ap.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=None,
                    help="also time each draft with int8 weights (--draft-precision int8; default: on CPU)")
    ap.add_argument("--rss-context", type=int, default=2048)
    ap.add_argument("--baseline-src", default=None, help="src/ of an older checkout for the RSS baseline")
    ap.add_argument("--compile", action="store_true", help="add compiled lean rows (plain, context, draft)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/lean-engine.json"))
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--plot", type=Path, default=None, metavar="JSON",
                    help="only draw JSON's context section (a report this script wrote) beside it as "
                         "*.context.png, and exit (a run draws its own)")
    args = ap.parse_args(argv)
    if args.plot is not None:
        print(f"wrote {plot_context(json.loads(args.plot.read_text()), args.plot.with_suffix('.context.png'))}")
        return 0
    if args.sections is None:
        args.sections = ["plain", "context", "draft"] + (["rss"] if args.device == "cpu" else [])

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(args)
        return 0
    from draftsmith.bench.measure import environment

    model, tok, label = load(args)
    if args.draft_int8 is None:
        args.draft_int8 = next(model.parameters()).device.type == "cpu"
    out: dict[str, Any] = {"verifier": label, "dtype": args.dtype, "device": str(next(model.parameters()).device),
                           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                           "environment": environment(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "load_average_start": os.getloadavg()}
    t0 = time.time()
    from draftsmith.models.verifier import weight_layout

    if args.weight_layout == "auto":
        from draftsmith.bench.measure import choose_weight_layout

        choice = choose_weight_layout(model, prompts(args, model, tok)[0], [1, 2, 3], args.max_new_tokens)
        out["weight_layout_choice"] = choice
        args.weight_layout = choice["layout"]
        print(f"weight layout: {choice['layout']} (auto; T(n) ms: " + "; ".join(
            f"{lay} " + " ".join(f"{n}:{1e3 * t:.1f}" for n, t in v.items()) for lay, v in choice["t_seconds"].items())
            + ")", file=sys.stderr)
    out["weight_layout"] = args.weight_layout
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(done: str | None = None) -> None:
        """Write what is measured so far: a run cut short (the GPU check's time limit) keeps its sections."""
        if done is not None:
            out.setdefault("sections_done", []).append(done)
        out["seconds"] = time.time() - t0
        out["load_average_end"] = os.getloadavg()
        args.out.write_text(json.dumps(out, indent=2) + "\n")

    out["complete"] = False
    save()
    with weight_layout(model, args.weight_layout):  # plain, context and draft sections
        for name, section in (("plain", lambda: section_plain(args, model, tok, out)),
                              ("context", lambda: section_context(args, model, out)),
                              ("draft", lambda: section_draft(args, model, out))):
            if name in args.sections:
                section()
                save(name)
                if name == "context":  # the picture is a bonus: a machine without matplotlib goes on without it
                    try:
                        print(f"context curve: {plot_context(out, args.out.with_suffix('.context.png'))}",
                              file=sys.stderr)
                    except Exception as e:  # noqa: BLE001
                        print(f"context curve not drawn ({type(e).__name__}: {e})", file=sys.stderr)
    if "layout" in args.sections:
        section_layout(args, model, out)
        save("layout")
    if "rss" in args.sections:
        section_rss(args, out)
        save("rss")
    out["complete"] = True
    save()
    report(out)
    print(f"wrote {args.out}")
    return 0


def report(out: dict) -> None:
    print(f"verifier {out['verifier']}, {out['dtype']} on {out['device']}; load average "
          f"{out['load_average_start'][0]:.1f} -> {out['load_average_end'][0]:.1f}")
    if "plain" in out:
        s = out["plain"]
        print(f"[plain] {s['prompts']} prompts x {s['max_new_tokens']} new tokens, {s['repeats']} repeat(s)")
        for k, v in s["tokens_per_second"].items():
            print(f"  {k:20s} {v['median']:7.1f} tok/s  identical to generate: "
                  f"{s['identical_to_hf_generate'][k]}/{s['prompts']}")
        for k, v in s["ratios"].items():
            print(f"  {k:40s} median {v['median']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}] "
                  f"min {v['min']:.3f}")
    if "context" in out:
        c = out["context"]
        for p, curve in c["median_ms"].items():
            ratio = c["step_1024_over_128"][p]
            print(f"[context] {p:20s} " + "  ".join(f"{C}: {ms:.1f} ms" for C, ms in curve.items())
                  + (f"   1024/128 = {ratio:.3f}" if ratio is not None else ""))
    if "draft" in out:
        d = out["draft"]
        print(f"[draft] at {d['context']} cached, mean step of a chain of {d.get('draft_chain', 1)} after a verifier "
              "step: " + "  ".join(f"{k}: {v:.2f} ms" for k, v in d["median_ms"].items()))
        print("  draft / verifier step: " + "  ".join(f"{k}: {100 * v:.1f}%" for k, v in d["draft_over_verifier"].items()))
        if "first_step_over_verifier" in d:
            print("  the chain's first step (weights cold) / verifier step: "
                  + "  ".join(f"{k}: {100 * v:.1f}%" for k, v in d["first_step_over_verifier"].items()))
        if "later_steps_over_verifier" in d:
            print("  the chain's later steps / verifier step: "
                  + "  ".join(f"{k}: {100 * v:.1f}%" for k, v in d["later_steps_over_verifier"].items()))
        print("  its share of the weights a verifier step reads (the floor): "
              + "  ".join(f"{k}: {100 * v:.1f}%" for k, v in d["weight_share"].items()))
    if "layout" in out:
        lay = out["layout"]
        print(f"[layout] verify step at {lay['context']} cached, ms (x one-token step), "
              f"{lay['steps_per_point']} steps per point:")
        for name, curve in lay["median_ms"].items():
            print(f"  {name:7s} " + "  ".join(f"M={m}: {ms:.1f} ({lay['over_one_token'][name][m]:.2f}x)"
                                           for m, ms in curve.items()))
        for name, ratios in lay["over_out_in"].items():
            if name != "out-in":
                print(f"  {name} / out-in: " + "  ".join(f"M={m}: {v:.3f}" for m, v in ratios.items()))
    if "rss" in out:
        r = out["rss"]
        for k, v in r.items():
            if isinstance(v, dict) and "peak_rss" in v:
                print(f"[rss] {k:20s} peak {v['peak_rss'] / 2**20:7.1f} MiB (before generate "
                      f"{v['rss_before_generate'] / 2**20:.1f})")
            elif isinstance(v, float):
                print(f"[rss] {k:40s} {v:.3f}")
            elif isinstance(v, dict):
                print(f"[rss] {k}: {str(v)[:300]}")


if __name__ == "__main__":
    sys.exit(main())
