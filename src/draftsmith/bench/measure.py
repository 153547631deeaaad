"""Measurement: rows (ways of decoding), timed runs interleaved per prompt, step costs.

Every row runs on the same prompts, interleaved per prompt (the row order rotates)
so that machine drift hits every row alike; results land in a :class:`BenchState`
as they come, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from draftsmith.bench.costmodel import (MIN_IN_SITU, CostModel, DrafterProfile, best_k, confidence_thresholds,
                                        fit_draft_cost, in_situ_prices, monotone_fit, paired_prices, predict,
                                        trimmed_mean)
from draftsmith.bench.verdict import OutputVerdict, compare_outputs, model_scorer
from draftsmith.decoding.proposers import DraftContext, Proposal, Proposer
from draftsmith.decoding.sampling import SamplingParams
from draftsmith.engines import OURS
from draftsmith.errors import DraftsmithError
from draftsmith.utils import progress_bar


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``), after a garbage collection.

    A step that ran before the bench in the same process (training, in a pipeline) leaves its
    freed tensors' pages in the heap, still resident: without this, the peak RSS measured
    after a reset starts from them.
    """
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextlib.contextmanager
def frozen_heap():
    """Keep the objects alive now out of the garbage collector's passes until the block ends.

    Every timed run starts with a full collection (:func:`reset_peak_memory`), and a full
    collection walks every object in the process: 0.23 s with one small verifier loaded, ~1 s
    in a process that has compiled graphs, per run, which made a bench of 78 short prompts
    spend 70% of its time in ``gc.collect``. After a full collection here, ``gc.freeze`` moves
    what is alive (models, modules, libraries) to a generation no pass walks, so each run's
    collection covers only what was made since. Reference counting still frees frozen objects;
    only cycles among them wait for the block's end. A process that froze objects itself
    keeps its own arrangement (nothing is frozen or unfrozen here).
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (not Linux, or not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def reset_peak_memory(device: torch.device) -> bool:
    """Reset the peak RSS (Linux ``clear_refs``) and CUDA peak counters; True if RSS could be reset.

    Freed heap pages are released first (:func:`release_freed_memory`), so the new peak
    starts from what is in use.
    """
    release_freed_memory()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached from earlier runs would count in this run's reserved peak
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5 = reset the peak resident set size (VmHWM)
        return True
    except OSError:
        return False


def peak_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(peak RSS bytes, peak CUDA bytes reserved or None).

    On CUDA the peak *reserved* by the caching allocator, not allocated: a compiled step's CUDA graphs
    keep their memory in private pools, which count as reserved and not as allocated once recorded, so
    allocated bytes would show a compiled row lighter than it is."""
    cuda = int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        if m:
            return int(m.group(1)) * 1024, cuda
    except OSError:
        pass  # not Linux: fall back to getrusage, a process-lifetime peak
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), cuda


class RecordingProposer(Proposer):
    """Wraps a proposer to record, per call, the requested k, the proposed length and
    (with ``timing``) the wall time; used for draft-length distributions and draft costs.

    With ``plain_every`` = p > 0, every p-th round proposes nothing without asking the wrapped
    drafter: the engine verifies the pending token alone, a plain one-token step between
    drafted rounds (the calibration's ``T(1)``, paired with the verifies and propose calls
    around it, :func:`time_drafter`). Such a round is recorded as ``(0, 0, 0.0)``; the
    verifier states it was shown are held and passed on with the next call's, so the drafter
    sees every position (the :class:`~draftsmith.decoding.proposers.DraftContext` contract).
    """

    def __init__(self, inner: Proposer, timing: bool = False, device: torch.device | None = None,
                 plain_every: int = 0) -> None:
        if plain_every < 0 or plain_every == 1:
            raise ValueError(f"plain_every must be 0 (off) or >= 2, got {plain_every}")
        self.inner, self.timing, self.device, self.plain_every = inner, timing, device, plain_every
        # The engine reads these; mirror the wrapped drafter's declaration.
        self.requires_hidden_states = inner.requires_hidden_states
        self.aux_layer_ids = inner.aux_layer_ids
        self.calls: list[tuple[int, int, float]] = []
        self._rounds, self._held = 0, []

    def reset(self) -> None:
        self.inner.reset()
        self._rounds, self._held = 0, []

    def prepare(self, max_length: int, compile: bool = False, num_draft_tokens: int = 1) -> None:
        self.inner.prepare(max_length, compile, num_draft_tokens)

    @property
    def compile_seconds(self) -> float:  # type: ignore[override]
        return float(getattr(self.inner, "compile_seconds", 0.0))

    def check_compatible(self, verifier: torch.nn.Module) -> None:
        self.inner.check_compatible(verifier)

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        if self.plain_every:
            self._rounds += 1
            if ctx.hidden_states is not None:
                self._held.append(ctx.hidden_states)
            if self._rounds % self.plain_every == 0:  # a plain step: nothing proposed, the drafter not asked
                self.calls.append((0, 0, 0.0))
                return Proposal(ctx.tokens[:0], None)
            if len(self._held) > 1:
                ctx = DraftContext(ctx.tokens, torch.cat(self._held))
            self._held = []
        if not self.timing:
            proposal = self.inner.propose(ctx, k, sampling, generator)
            self.calls.append((k, int(proposal.tokens.shape[0]), 0.0))
            return proposal
        if self.device is not None:
            _sync(self.device)
        t0 = time.perf_counter()
        proposal = self.inner.propose(ctx, k, sampling, generator)
        if self.device is not None:
            _sync(self.device)
        self.calls.append((k, int(proposal.tokens.shape[0]), time.perf_counter() - t0))
        return proposal


@dataclass
class RunResult:
    """One timed generation of one row on one prompt."""

    token_ids: list[int]
    seconds: float
    stats: dict[str, Any] | None = None
    draft_calls: list[tuple[int, int, float]] = field(default_factory=list)
    peak_rss: int | None = None
    peak_cuda: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")


class Row:
    """Something to measure: a decoding method of the verifier.

    Attributes:
        name: label in the report.
        kind: plain | quantized (plain decoding of a quantized verifier) | drafter | hf-generate
            | hf-prompt-lookup.
        drafter: drafter label (rows of one drafter at several k share it).
        k: draft length (None for rows without drafting).
        engine: what decodes: ``draftsmith`` (this process) or a serving engine's name.
        quant: the verifier's quantization (:data:`~draftsmith.models.quantize.QUANTIZATIONS`),
            None for the full-precision verifier.
    """

    engine = OURS

    def __init__(self, name: str, kind: str, model: torch.nn.Module, drafter: str | None = None,
                 k: int | None = None, proposer: Proposer | None = None, quant: str | None = None,
                 compile: bool = False) -> None:
        self.name, self.kind, self.model, self.drafter, self.k, self.proposer = name, kind, model, drafter, k, proposer
        self.quant, self.compile = quant, compile

    def __call__(self, ids: torch.Tensor, max_new_tokens: int, temperature: float,
                 seed: int) -> tuple[list[int], dict[str, Any] | None, list[tuple[int, int, float]]]:
        """Generate; returns (new token ids, engine stats or None, proposer calls)."""
        if self.kind.startswith("hf-"):
            return self._hf(ids, max_new_tokens, temperature, seed), None, []
        from draftsmith.decoding.engine import generate

        # On a CPU, each step is timed too (two clock reads; the rows' own step prices, see
        # report._break_even); on CUDA that would take a device sync per step, so not there.
        timed = ids.device.type != "cuda"
        rec = RecordingProposer(self.proposer, timing=timed) if self.proposer is not None else None
        out = generate(self.model, ids, proposer=rec, max_new_tokens=max_new_tokens, temperature=temperature,
                       num_draft_tokens=self.k or 1, seed=seed, compile=self.compile, time_steps=timed)
        return out.token_ids, out.stats, rec.calls if rec is not None else []

    def _hf(self, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int) -> list[int]:
        gen_cfg = self.model.generation_config
        eos = gen_cfg.eos_token_id
        pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (
            eos if isinstance(eos, int) else (eos[0] if eos else 0))
        kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "pad_token_id": pad}
        if temperature > 0:
            torch.manual_seed(seed)
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if self.kind == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = self.k
        with torch.inference_mode():
            seq = self.model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), **kw)
        return seq[0, ids.shape[0]:].tolist()


class EngineRow(Row):
    """A row a serving engine decodes, in its own process (vLLM, llama.cpp): plain or with a draft.

    Its stats are the engine's own counters for the request (vLLM's definitions); greedy only.
    """

    def __init__(self, name: str, kind: str, model: torch.nn.Module, server: Any, engine: str,
                 drafter: str | None = None, k: int | None = None) -> None:
        super().__init__(name, kind, model, drafter, k)
        self.server, self.engine = server, engine

    def __call__(self, ids: torch.Tensor, max_new_tokens: int, temperature: float,
                 seed: int) -> tuple[list[int], dict[str, Any] | None, list[tuple[int, int, float]]]:
        res = self.server.generate(ids.tolist(), max_new_tokens)
        c = res.counters
        stats = None if c is None else {
            "drafts": c.drafts, "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
            "per_position_acceptance": c.per_position_acceptance, "new_tokens": len(res.token_ids)}
        return res.token_ids, stats, []


def ks_of(label: str, ks: Sequence[int], chosen: Mapping[str, int] | None) -> list[int]:
    """The k a drafter's rows are measured at: its ``chosen`` one (``--choose-k``), else every k of ``ks``."""
    return [chosen[label]] if chosen and label in chosen else list(ks)


def precision_label(label: str, precisions: Sequence[str], precision: str) -> str:
    """A draft's row label at ``precision``: the first of ``precisions`` keeps ``label``, the others
    are ``LABEL@PRECISION`` (our engine's rows and the serving engines' alike)."""
    return label if precision == precisions[0] else f"{label}@{precision}"


def engine_rows(stack: contextlib.ExitStack, engines: Sequence[str], model: torch.nn.Module, verifier: str,
                drafts: dict[str, Path], ks: Sequence[int], work_dir: Path,
                threads: int | None = None, precisions: Sequence[str] = ("as-loaded",),
                chosen: Mapping[str, int] | None = None) -> list[Row]:
    """Start each serving engine plainly and with each draft at each k (stopped by ``stack``);
    a draft whose row label is in ``chosen`` (``--choose-k``) only at that k.

    ``precisions`` as ``--draft-precision``: llama.cpp serves ``int8`` as a q8_0 GGUF of the
    draft (labelled as our engine's int8 rows); vLLM serves the draft as loaded only.
    """
    from draftsmith.engines import open_engine

    rows: list[Row] = []
    param = next(model.parameters())
    dtype, device = str(param.dtype).removeprefix("torch."), param.device
    share = None
    if device.type == "cuda" and "vllm" in engines:
        # every vLLM server runs at once (the rows are timed in turn per prompt): each gets an equal
        # part of the memory free now, which vLLM checks at its start against its share of the whole
        servers = 1 + sum(len(ks_of(label, ks, chosen)) for label in drafts)
        free, total = torch.cuda.mem_get_info(device)
        share = 0.9 * free / total / servers
    for engine in engines:
        if engine == OURS:
            continue
        start = lambda d=None, k=3: stack.enter_context(open_engine(  # noqa: E731
            engine, verifier, d, k, work_dir=work_dir, threads=threads, dtype=dtype, device=device.type,
            gpu_share=share))
        print(f"bench: starting {engine} (plain) ...", file=sys.stderr)
        rows.append(EngineRow(f"{engine} plain", "plain", model, start(), engine))
        for label, d in drafts.items():
            for precision in precisions:
                name = precision_label(label, precisions, precision)
                served: Any = d
                if precision == "int8":
                    if engine != "llama.cpp":
                        print(f"bench: {engine} serves drafts as loaded; no {name} rows there", file=sys.stderr)
                        continue
                    from draftsmith.engines.llamacpp import draft_gguf

                    served = draft_gguf(d, verifier, dtype="q8_0")
                for k in ks_of(name, ks, chosen):
                    print(f"bench: starting {engine} with {name} at k={k} ...", file=sys.stderr)
                    rows.append(EngineRow(f"{engine} {name} k={k}", "drafter", model, start(served, k), engine,
                                          drafter=name, k=k))
    return rows


def baseline_index(rows: Sequence[Row], r: int) -> int:
    """The full-precision plain row of row ``r``'s engine: what its speedup is measured against."""
    engine = rows[r].engine
    return next(i for i, row in enumerate(rows) if row.kind == "plain" and row.engine == engine)


def reference_index(rows: Sequence[Row], r: int) -> int:
    """The row whose outputs row ``r`` must reproduce: plain decoding of the same verifier by the
    same implementation (the quantized plain row for a drafter on a quantized verifier; HF
    ``generate`` for HF's prompt lookup, where it is measured: the same forward and kernels, so
    only a verify's rounding can part them; else :func:`baseline_index`)."""
    quant = rows[r].quant
    if rows[r].kind == "hf-prompt-lookup":
        hf = [i for i, row in enumerate(rows) if row.kind == "hf-generate"]
        if hf:
            return hf[0]
    if quant is None:
        return baseline_index(rows, r)
    return next(i for i, row in enumerate(rows) if row.kind == "quantized" and row.quant == quant)


def quantized_rows(model: torch.nn.Module, proposers: dict[str, Proposer], ks: Sequence[int],
                   methods: Sequence[str], chosen: Mapping[str, int] | None = None) -> list[Row]:
    """Per quantization: plain decoding of the quantized verifier, and each drafter on it at each k
    (at its ``chosen`` k only, where it has one)."""
    from draftsmith.models.quantize import quantize_verifier

    rows: list[Row] = []
    for method in methods:
        qmodel = quantize_verifier(model, method)
        rows.append(Row(f"{method} plain", "quantized", qmodel, quant=method))
        for name, prop in proposers.items():
            rows += [Row(f"{method} + {name} k={k}", "drafter", qmodel, drafter=f"{name} @{method}", k=k,
                         proposer=prop, quant=method) for k in ks_of(name, ks, chosen)]
    return rows


def timed_run(row: Row, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int) -> RunResult:
    """Run ``row`` once on ``ids``, timing wall-clock (prefill included) and peak memory."""
    device = ids.device
    reset_peak_memory(device)
    _sync(device)
    t0 = time.perf_counter()
    tokens, stats, calls = row(ids, max_new_tokens, temperature, seed)
    _sync(device)
    # compiling a shape first seen here is one-off work, reported apart (``compile_seconds``)
    seconds = time.perf_counter() - t0 - float((stats or {}).get("compile_seconds", 0.0))
    rss, cuda = peak_memory(device)
    return RunResult(tokens, seconds, stats, calls, rss, cuda)


def measure_verify_costs(model: torch.nn.Module, context: Sequence[int], ns: Sequence[int],
                         repeats: int = 9, warmup: int = 2, compile: bool = False,
                         on_compile: Callable[[float], None] | None = None) -> dict[int, float]:
    """Median seconds of a verifier forward on n tokens after ``context`` is cached, for each n,
    made non-decreasing in n by :func:`monotone_fit`.

    The same call the engine makes (cache append, logits of n positions), rolled back
    after each timing; n values are interleaved so drift spreads over all of them.
    """
    from draftsmith.decoding.runner import verifier_runner

    device = next(model.parameters()).device
    ctx = torch.as_tensor(list(context), dtype=torch.long, device=device)
    probe = ctx[-max(ns):] if ctx.shape[0] >= max(ns) else ctx.repeat(max(ns) // ctx.shape[0] + 1)[:max(ns)]
    times: dict[int, list[float]] = {n: [] for n in ns}
    with torch.inference_mode():
        # the engine's path and cache (compiled: one graph for one token, one for every longer step,
        # and on the CPU the verify candidates chosen per length, in the warm-up)
        runner = verifier_runner(model, ctx.shape[0] + max(ns), compile=compile,
                                 warmup_shapes=tuple(sorted({1, *ns})))
        runner.forward(ctx, 1)
        for rep in range(warmup + repeats):
            for n in ns:
                _sync(device)
                t0 = time.perf_counter()
                runner.forward(probe[:n], n)
                _sync(device)
                if rep >= warmup:
                    times[n].append(time.perf_counter() - t0)
                runner.rollback(ctx.shape[0])
        if on_compile is not None:
            on_compile(runner.compile_seconds)
        runner.close()
    return monotone_fit({n: statistics.median(v) for n, v in times.items()})


def pool_steps(pool: dict[int, list[float]], steps: Mapping[int, Sequence[float]]) -> None:
    """Append a generation's ``stats["step_seconds"]`` (tokens verified -> seconds) to ``pool``."""
    for n, v in steps.items():
        pool.setdefault(int(n), []).extend(v)


def time_drafter(model: torch.nn.Module, proposer: Proposer, prompt: Sequence[int], k: int, max_new_tokens: int,
                 temperature: float, seed: int, compile: bool = False,
                 on_compile: Callable[[float], None] | None = None,
                 plain_every: int = 0) -> tuple[list[float], dict[int, list[float]]]:
    """One decode of ``prompt`` at draft length ``k``: the seconds of its propose calls that asked
    for k (the first call left out: it includes one-off work, a draft model's prompt prefill,
    that is not a per-round cost), and of its verifier forwards after the prompt's by the number
    of tokens each verified (aux hidden states included: the verify prices as rounds pay them).

    With ``plain_every`` = p (:class:`RecordingProposer`), every p-th round is a plain one-token
    step: the one-token forwards are then ``T(1)`` timed between the drafted rounds, a few
    tens of milliseconds from the verifies and calls they are compared with. A call that
    follows such a step caught up one position more than a round does, and is left out.
    """
    from draftsmith.decoding.engine import generate

    device = next(model.parameters()).device
    rec = RecordingProposer(proposer, timing=True, device=device, plain_every=plain_every)
    res = generate(model, prompt, proposer=rec, max_new_tokens=max_new_tokens, temperature=temperature,
                   num_draft_tokens=k, seed=seed, compile=compile, time_steps=True)
    if on_compile is not None:
        on_compile(float(res.stats.get("compile_seconds", 0.0)))
    calls = rec.calls
    times = [s for i, (req, _, s) in enumerate(calls) if i > 0 and req == k and calls[i - 1][0] != 0]
    return times or [s for req, _, s in calls if req], res.stats["step_seconds"]


def measure_draft_costs(model: torch.nn.Module, proposer: Proposer, prompt: Sequence[int], ks: Sequence[int],
                        max_new_tokens: int, temperature: float, seed: int, compile: bool = False,
                        on_compile: Callable[[float], None] | None = None,
                        verify_seconds: dict[int, list[float]] | None = None) -> dict[int, float]:
    """Seconds of one propose call at each k (:func:`~draftsmith.bench.costmodel.trimmed_mean`
    of the calls), timed inside a real generation at that k (:func:`time_drafter`); with
    ``verify_seconds``, those generations' verifier forwards are appended to it too
    (tokens verified -> seconds)."""
    out: dict[int, float] = {}
    for k in ks:
        times, steps = time_drafter(model, proposer, prompt, k, max_new_tokens, temperature, seed, compile,
                                    on_compile)
        if verify_seconds is not None:
            pool_steps(verify_seconds, steps)
        if times:
            out[k] = trimmed_mean(times)
    return out


def measure_plain_steps(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int, temperature: float,
                        seed: int, compile: bool = False,
                        on_compile: Callable[[float], None] | None = None) -> list[float]:
    """Seconds of each one-token step of a plain decode of ``prompt`` (the prompt's forward left out):
    ``T(1)`` as the plain loop pays it."""
    from draftsmith.decoding.engine import generate

    res = generate(model, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                   compile=compile, time_steps=True)
    if on_compile is not None:
        on_compile(float(res.stats.get("compile_seconds", 0.0)))
    return list(res.stats["step_seconds"].get(1, []))


def load_eval_prompts(dataset: str, tokenizer: object, limit: int | None) -> list[tuple[str, list[int]]]:
    """Eval prompts as ``(prompt id, token ids)`` from the dataset registry (first user turns)."""
    from draftsmith.data.sources import eval_set

    return eval_set(dataset, tokenizer, limit)



def bench_prompts(dataset: str, tokenizer: object, num_prompts: int,
                  pilot: int = 0) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
    """The first ``num_prompts`` of the eval set (timed and judged) and, when ``pilot`` > 0, its
    last ``pilot`` prompts after those (``--choose-k``'s pilot decode; fewer when the set is short,
    none when the first ones take it all)."""
    if pilot <= 0:
        return load_eval_prompts(dataset, tokenizer, num_prompts), []
    every = load_eval_prompts(dataset, tokenizer, None)
    return every[:num_prompts], every[num_prompts:][-pilot:]


def choose_ks(state: BenchState, proposers: dict[str, Proposer], ks: Sequence[int],
              pilot: Sequence[tuple[str, list[int]]], max_new_tokens: int, temperature: float, seed: int,
              compile: bool = False) -> dict[str, dict[str, Any]]:
    """``--choose-k``: per drafter, the k of ``ks`` with the best predicted speedup.

    Each drafter decodes the ``pilot`` prompts at the largest k (untimed; the prompts are
    not among those timed and judged); its pooled acceptance per position and draft
    lengths, with the step costs already in ``state`` (:func:`measure_costs`), give the
    break-even model's prediction at every k of ``ks`` (:func:`costmodel.predict`, no
    extrapolation: the pilot drafted the longest).

    Returns:
        drafter -> ``{"k", "predicted_speedup" (per k), "pilot_k", "pilot_prompts",
        "acceptance_length", "per_position_acceptance", "length_counts"}``.
    """
    from draftsmith.bench.report import pooled_acceptance

    if state.costs is None:
        raise ValueError("choose_ks needs the step costs: call measure_costs first")
    model = state.rows[0].model
    device = next(model.parameters()).device
    k = max(ks)
    out: dict[str, dict[str, Any]] = {}
    for name, prop in proposers.items():
        row = Row(f"pilot {name} k={k}", "drafter", model, drafter=name, k=k, proposer=prop, compile=compile)
        with frozen_heap():
            runs = [timed_run(row, torch.as_tensor(ids, dtype=torch.long, device=device), max_new_tokens,
                              temperature, seed + i) for i, (_, ids) in enumerate(pilot)]
        acc = pooled_acceptance(runs, k)
        profile = DrafterProfile(k, acc["per_position_acceptance"], acc["length_counts"])
        preds = [predict(profile, state.drafter_costs(name), kk) for kk in sorted(set(ks))]
        out[name] = {"k": best_k(preds).k, "predicted_speedup": {str(p.k): p.speedup for p in preds},
                     "pilot_k": k, "pilot_prompts": [pid for pid, _ in pilot],
                     "acceptance_length": acc["acceptance_length"],
                     "per_position_acceptance": acc["per_position_acceptance"],
                     "length_counts": acc["length_counts"]}
    return out


#: ``--weight-layout auto``: a layout whose one-token step is within this fraction of the fastest
#: one counts as tied with it for plain decoding; among tied ones the cheapest verify steps win.
LAYOUT_TIE = 0.03
#: ``--weight-layout auto``'s probe: passes over the candidates, and timed repeats per step size
LAYOUT_PASSES, LAYOUT_REPEATS = 2, 5


def layout_candidates(model: torch.nn.Module, compiled: bool = False) -> list[str]:
    """The layouts ``--weight-layout auto`` times for ``model``: as loaded; on a CPU whose torch has
    oneDNN, oneDNN's matmul on the same weights, where it multiplies their dtype; on a CPU with float32 or bfloat16 weights, draftsmith's
    few-row kernel (``cpp``, built here on first use; left out, with a warning, where it cannot be).
    ``in-out`` is left out: it holds the weights twice. On any other device only the loaded layout
    applies, and so it does for compiled steps: a compiled CPU step freezes the weights as loaded
    and packs them for its own GEMM kernel (:data:`draftsmith.decoding.runner.CPU_COMPILE_TIERS`),
    which the other kernels would bypass."""
    p = next(model.parameters())
    if compiled or p.device.type != "cpu" or not p.is_floating_point():
        return ["out-in"]
    out = ["out-in"]
    from draftsmith.models.verifier import onednn_supports

    if onednn_supports(p.dtype):  # bfloat16 needs AVX-512 (absent on an AVX2-only CPU)
        out.append("onednn")
    if p.dtype in (torch.float32, torch.bfloat16):
        from draftsmith.models import cpu_linear

        if cpu_linear.available():
            out.append("cpp")
    return out


def pick_layout(t: Mapping[str, Mapping[int, float]], ks: Sequence[int], tie: float = LAYOUT_TIE) -> str:
    """The layout ``--weight-layout auto`` measures with, from its step times ``t[layout][n]``.

    Plain decoding is the baseline every speedup divides by, so it must not be made slower to
    flatter a draft: only layouts whose one-token step T(1) is within ``tie`` of the fastest
    qualify; among those, the one whose verify steps of ``k + 1`` tokens (``k`` in ``ks``) cost
    least in sum wins, and on equal sums the first in ``t``'s order (as loaded first).
    """
    fastest = min(v[1] for v in t.values())
    close = [lay for lay, v in t.items() if v[1] <= fastest * (1 + tie)]
    return min(close, key=lambda lay: sum(t[lay][k + 1] for k in ks))


def choose_weight_layout(model: torch.nn.Module, prompt: Sequence[int], ks: Sequence[int], max_new_tokens: int,
                         passes: int = LAYOUT_PASSES, repeats: int = LAYOUT_REPEATS,
                         compiled: bool = False) -> dict[str, Any]:
    """``--weight-layout auto``: time the verifier's steps in each of :func:`layout_candidates` and
    :func:`pick_layout` the one to measure with.

    Each candidate's one-token step and verify steps of ``k + 1`` tokens are timed as the bench's
    step costs are (:func:`measure_verify_costs`, at the same context), the candidates
    alternating over ``passes`` so drift hits both alike; per layout and n, the median of the
    passes. Eager steps: the kernel's cost is what differs between layouts. ``compiled``: the
    bench's steps are compiled, and only the loaded layout applies (nothing is timed).

    Returns:
        ``{"layout", "candidates", "t_seconds" ({layout: {n: seconds}}, empty when only one layout
        applies), "context_tokens", "tie"}``.
    """
    from draftsmith.models.verifier import weight_layout

    candidates = layout_candidates(model, compiled)
    out: dict[str, Any] = {"layout": candidates[0], "candidates": candidates, "t_seconds": {}, "tie": LAYOUT_TIE}
    if len(candidates) == 1:
        return out
    ns = sorted({1, *(k + 1 for k in ks)})
    context = cost_context(model, prompt, max_new_tokens, max(ns))
    seen: dict[str, dict[int, list[float]]] = {lay: {n: [] for n in ns} for lay in candidates}
    for p in range(passes):
        for lay in candidates[p % len(candidates):] + candidates[:p % len(candidates)]:
            with weight_layout(model, lay):
                t = measure_verify_costs(model, context, ns, repeats=repeats, warmup=1)
            for n in ns:
                seen[lay][n].append(t[n])
    times = {lay: {n: statistics.median(v) for n, v in d.items()} for lay, d in seen.items()}
    out.update(layout=pick_layout(times, ks), t_seconds=times, context_tokens=len(context))
    return out


def load_average() -> float | None:
    """1-minute load average (None where the OS has none): other work on the machine skews timings."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def environment() -> dict[str, Any]:
    from draftsmith.utils import environment_info

    env = environment_info()
    try:
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        env["cpu_model"] = m.group(1).strip() if m else None
    except OSError:
        env["cpu_model"] = None
    return env


@dataclass
class BenchState:
    """Everything measured so far; the report is built from it, complete or not."""

    rows: list[Row]
    prompts: list[tuple[str, list[int]]]
    results: dict[tuple[int, int], list[RunResult]] = field(default_factory=dict)  # (row, prompt) -> repeats
    costs: CostModel | None = None  # the bare step table (measure_verify_costs), and its context
    plain_steps: list[float] = field(default_factory=list)  # T(1) in a plain decode (measure_plain_steps)
    # drafter -> n -> seconds of its n-token forwards in its calibration decodes (scaled: paired_prices)
    verify_steps: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    draft_per_call: dict[str, dict[int, float]] = field(default_factory=dict)
    draft_fit: dict[str, tuple[float, float]] = field(default_factory=dict)
    verdicts: dict[tuple[int, int], OutputVerdict] = field(default_factory=dict)  # (row, prompt), greedy only
    quality: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # (row, prompt), vs full precision
    warmup_compile_seconds: dict[int, float] = field(default_factory=dict)  # row -> its warm-up run's compile time
    costs_compile_seconds: float = 0.0  # compiling the steps while their costs were measured (first, usually)
    k_choice: dict[str, dict[str, Any]] = field(default_factory=dict)  # drafter -> choose_ks's choice and evidence
    draft_confidence: dict[str, dict[str, Any]] = field(default_factory=dict)  # drafter -> its stop rule (apply_...)
    layout_choice: dict[str, Any] | None = None  # --weight-layout auto's timings and choice
    partial: bool = False
    note: str = ""
    started: float = field(default_factory=time.time)
    load_at_start: float | None = field(default_factory=lambda: load_average())
    attempt_started: float = field(default_factory=time.time)  # this run's start (a resumed bench: not ``started``)
    earlier_seconds: float = 0.0  # a resumed bench: what its earlier attempts measured for
    attempts: list[dict[str, Any]] = field(default_factory=list)  # a resumed bench: when, and from which unit

    def measuring_seconds(self) -> float:
        """Seconds spent measuring, over every attempt of a resumed bench (not the time between them)."""
        return self.earlier_seconds + time.time() - self.attempt_started

    def drafter_costs(self, name: str) -> CostModel:
        """The step costs drafter ``name``'s rounds pay: ``T(1)`` of the plain steps between its
        calibration rounds (of the plain decodes where it has too few) and ``T_verify(n)`` of its own
        decodes where measured in situ (:func:`~draftsmith.bench.costmodel.in_situ_prices`, the bare
        table elsewhere), with its fitted propose cost (none if not measured)."""
        fixed, per_token = self.draft_fit.get(name, (0.0, 0.0))
        own = self.verify_steps.get(name, {})
        # T(1): the plain steps timed between its rounds (measure_costs), else the plain decodes'
        t1 = own[1] if len(own.get(1, [])) >= MIN_IN_SITU else self.plain_steps
        t_verify = in_situ_prices(self.costs.t_verify, t1, own)
        return dataclasses.replace(self.costs, t_verify=t_verify, draft_fixed=fixed, draft_per_token=per_token)


#: ``--draft-confidence`` words (besides a number in [0, 1])
CONFIDENCE_WORDS = ("auto", "off")


def parse_confidence(value: str) -> str:
    """A ``--draft-confidence`` value, checked and normalised: ``auto``, ``off`` or a number in [0, 1]."""
    text = str(value).strip().lower()
    if text in CONFIDENCE_WORDS:
        return text
    try:
        number = float(text)
    except ValueError:
        number = -1.0
    if not 0.0 <= number <= 1.0:
        raise DraftsmithError(f"--draft-confidence: expected auto, off or a number in [0, 1], got {value!r}")
    return "off" if number == 0.0 else f"{number:g}"


def apply_draft_confidence(state: "BenchState", proposers: Mapping[str, Proposer], settings: Mapping[str, str],
                           ks: Sequence[int]) -> None:
    """Give each EAGLE-3 drafter of ``settings`` (label -> ``--draft-confidence`` value) its stop rule,
    once ``state``'s step costs are measured (they were measured drafting every token):
    ``auto`` -> :func:`~draftsmith.bench.costmodel.confidence_thresholds` from its own prices,
    ``off`` -> never stops, a number -> that cumulative confidence at every position. The rule
    and the prices it came from are kept in ``state.draft_confidence`` for the report."""
    for name, setting in settings.items():
        if setting == "auto":
            costs = state.drafter_costs(name)
            floor = confidence_thresholds(costs, max(ks))
            why = {"t_verify_seconds": {str(n): costs.verify(n) for n in range(1, max(ks) + 2)},
                   "draft_per_token_seconds": costs.draft_per_token}
        else:
            floor, why = [0.0 if setting == "off" else float(setting)], {}
        proposers[name].min_confidence = floor
        state.draft_confidence[name] = {"setting": setting, "thresholds": floor, **why}


def build_rows(model: torch.nn.Module, proposers: dict[str, Proposer], ks: Sequence[int],
                hf_reference: bool, hf_lookup_tokens: int | None, compile: bool = False,
                chosen: Mapping[str, int] | None = None) -> list[Row]:
    """Our plain row, each drafter at each k (at its ``chosen`` k only, where it has one; compiled
    steps with ``compile``), and HF's rows."""
    rows = [Row("plain (ours)", "plain", model, compile=compile)]
    for name, prop in proposers.items():
        rows += [Row(f"{name} k={k}", "drafter", model, drafter=name, k=k, proposer=prop, compile=compile)
                 for k in ks_of(name, ks, chosen)]
    if hf_reference:
        rows.append(Row("HF generate", "hf-generate", model))
        k_hf = hf_lookup_tokens or max(ks)
        rows.append(Row(f"HF prompt lookup k={k_hf}", "hf-prompt-lookup", model, k=k_hf))
    return rows


def measure_interleaved(state: BenchState, max_new_tokens: int, temperature: float, repeats: int,
                        seed: int, progress: bool = True, warmup_tokens: int = 32, start_unit: int = 0,
                        on_unit: Callable[[int], None] | None = None) -> None:
    """Warm every row up, then time every row on every prompt, interleaved per prompt.

    The row order rotates from prompt to prompt so no row is always first (cold
    caches) or last; results land in ``state`` as they come, so an interrupt keeps them.
    A *unit* is one prompt of one repeat, timed by every row; ``on_unit(n)`` is called
    after each with the units done so far, and a resumed bench starts at ``start_unit``
    (its earlier units' results already in ``state``).
    """
    device = next(state.rows[0].model.parameters()).device
    prompts = [torch.as_tensor(ids, dtype=torch.long, device=device) for _, ids in state.prompts]
    n_rows = len(state.rows)
    total = n_rows * (1 + repeats * len(prompts))
    with progress_bar(total, "bench", "run", progress, file=sys.stderr) as bar:
        for r, row in enumerate(state.rows):
            bar.set_postfix_str(f"warm-up {row.name}")
            _, stats, _ = row(prompts[0], min(warmup_tokens, max_new_tokens), temperature, seed)
            state.warmup_compile_seconds[r] = float((stats or {}).get("compile_seconds", 0.0))
            bar.update()
        bar.update(n_rows * start_unit)  # a resumed bench: the runs timed before
        with frozen_heap():  # after the warm-ups: their compiled graphs are frozen too
            _timed_rows(state, prompts, max_new_tokens, temperature, repeats, seed, bar, start_unit, on_unit)


def _timed_rows(state: BenchState, prompts: list[torch.Tensor], max_new_tokens: int, temperature: float,
                repeats: int, seed: int, bar: Any, start_unit: int = 0,
                on_unit: Callable[[int], None] | None = None) -> None:
    """:func:`measure_interleaved`'s timed runs: every row on every prompt, the order rotating."""
    n_rows = len(state.rows)
    for unit in range(start_unit, repeats * len(prompts)):
        p, ids = unit % len(prompts), prompts[unit % len(prompts)]
        shift = p % n_rows
        for r in list(range(shift, n_rows)) + list(range(shift)):
            bar.set_postfix_str(f"{state.rows[r].name} | prompt {p + 1}/{len(prompts)}")
            res = timed_run(state.rows[r], ids, max_new_tokens, temperature, seed + p)
            state.results.setdefault((r, p), []).append(res)
            bar.update()
        if on_unit is not None:
            on_unit(unit + 1)


def cost_context(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int, k_max: int) -> list[int]:
    """The context the step costs are measured after: the prompt, repeated to the mid-generation
    length (where the average step happens), within the model's maximum context."""
    limit = getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "max_position_embeddings",
                    None)
    target = len(prompt) + max_new_tokens // 2
    if limit is not None:
        target = min(target, limit - k_max - 2)
    return (list(prompt) * (target // len(prompt) + 1))[:target]


#: The in-situ calibration of :func:`measure_costs`: passes over plain decoding and every drafter
#: at every k, and tokens decoded by each (at most; the bench's --max-new-tokens when smaller)
CALIBRATION_PASSES, CALIBRATION_TOKENS = 3, 64
#: In the calibration's drafter decodes every this many-th round is a plain one-token step
#: (:func:`time_drafter`), the ``T(1)`` its verifies and propose calls are priced against
CALIBRATION_PLAIN_EVERY = 3


def measure_costs(state: BenchState, proposers: dict[str, Proposer], ks: Sequence[int], max_new_tokens: int,
                  temperature: float, seed: int, compile: bool = False) -> None:
    """Fill ``state``'s step costs for this machine and model:

    - ``costs``: the bare table, ``T_verify(n)`` for n = 1 .. max(k_max, 8) + 1, each length timed
      alone after a mid-reply context (it gives the shape over n, and the k the bench did not run);
    - ``plain_steps``: the one-token steps of plain decodes (the plain loop's ``T(1)``, reported);
    - per drafter at every k of ``ks``: its propose calls (``draft_per_call``, fitted as
      ``draft_fit``) and the verify forwards of its rounds (``verify_steps``, by tokens verified;
      ``verify_steps[name][1]``: the plain one-token steps between its rounds).

    The last three come from :data:`CALIBRATION_PASSES` passes, each over one prompt (the first
    ones in turn) decoded plainly and by every drafter at every k, in an order that rotates from
    pass to pass. In a drafter's decodes every :data:`CALIBRATION_PLAIN_EVERY`-th round is a
    plain step, and each decode's prices are scaled by the ratio of the drafter's pooled
    one-token step to its own (:func:`~draftsmith.bench.costmodel.paired_prices`): a shared
    host's speed wanders by 10% from one decode to the next (BENCHMARKS 9x), and the
    predictions divide a round's prices by ``T(1)``, so each is compared with a ``T(1)`` timed
    beside it. What they leave out is the engine's own work between the steps.
    """
    model = state.rows[0].model
    k_max = max(max(ks), 8)
    context = cost_context(model, state.prompts[0][1], max_new_tokens, k_max)
    tokens = min(max_new_tokens, CALIBRATION_TOKENS)

    def compiled(seconds: float) -> None:  # compile time spent while the costs were measured
        state.costs_compile_seconds += seconds

    state.costs = CostModel(measure_verify_costs(model, context, range(1, k_max + 2), compile=compile,
                                                 on_compile=compiled), context_tokens=len(context))
    runs: list[tuple[str, int] | None] = [None, *((name, k) for name in proposers for k in sorted({1, *ks}))]
    decodes: dict[str, list[tuple[int, list[float], dict[int, list[float]]]]] = {name: [] for name in proposers}
    state.plain_steps = []
    for p in range(CALIBRATION_PASSES):
        prompt = state.prompts[p % len(state.prompts)][1]
        for run in runs[p % len(runs):] + runs[:p % len(runs)]:
            if run is None:
                state.plain_steps += measure_plain_steps(model, prompt, tokens, temperature, seed, compile,
                                                         on_compile=compiled)
                continue
            name, k = run
            times, steps = time_drafter(model, proposers[name], prompt, k, tokens, temperature, seed, compile,
                                        on_compile=compiled, plain_every=CALIBRATION_PLAIN_EVERY)
            decodes[name].append((k, times, steps))
    state.verify_steps = {}
    for name in proposers:
        calls, state.verify_steps[name] = paired_prices(decodes[name])
        state.draft_per_call[name] = {k: trimmed_mean(v) for k, v in sorted(calls.items()) if v}
        state.draft_fit[name] = fit_draft_cost(state.draft_per_call[name])


def float32_twin(model: torch.nn.Module, headroom: float = 1.25) -> torch.nn.Module:
    """A float32 copy of ``model`` for rescoring divergences (information only: ``margin_float32``).

    Only the float32 tensors are made (no intermediate copy at the model's dtype), on the model's
    device where its free memory holds them ``headroom`` times over, else on the CPU: an 8B verifier
    served in bfloat16 on a GPU would need 32 GB more there."""
    import copy

    device = next(model.parameters()).device
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(t.numel() * 4 for t in tensors if t.is_floating_point())
    target = device
    if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < headroom * need:
        print(f"bench: rescoring in float32 on the CPU: the GPU lacks {need / 1e9:.1f} GB for a float32 copy",
              file=sys.stderr)
        target = torch.device("cpu")

    def twin(t: torch.Tensor) -> torch.Tensor:
        c = t.detach().to(target, torch.float32 if t.is_floating_point() else t.dtype)
        return torch.nn.Parameter(c, requires_grad=False) if isinstance(t, torch.nn.Parameter) else c

    memo = {id(t): twin(t) for t in tensors}  # deepcopy takes these for the model's own tensors
    return copy.deepcopy(model, memo).eval()


def judge_outputs(state: BenchState, model: torch.nn.Module) -> None:
    """Greedy runs: classify every row's output on every prompt against plain decoding of the
    same verifier (identical / tie / mismatch, :mod:`draftsmith.bench.verdict`) into ``state.verdicts``.

    Divergences are rescored with the reference row's verifier in its own dtype and, for the
    full-precision ``model`` when that is not float32, with a float32 copy made on the first
    divergence only (a quantized verifier has no float32 twin: its own scores stand in).
    """
    dtype = next(model.parameters()).dtype
    scorers: dict[int, Any] = {}
    fp32 = None
    for (r, p), runs in sorted(state.results.items()):
        base = reference_index(state.rows, r)
        if r == base or (base, p) not in state.results or (r, p) in state.verdicts:
            continue
        ref_model = state.rows[base].model
        score = scorers.setdefault(id(ref_model), model_scorer(ref_model))
        ref, cand = state.results[(base, p)][0].token_ids, runs[0].token_ids
        quant = state.rows[base].quant is not None
        if ref != cand and not quant and dtype != torch.float32 and fp32 is None:
            fp32 = model_scorer(float32_twin(model))
        state.verdicts[(r, p)] = compare_outputs(
            state.prompts[p][1], ref, cand, score=score,
            dtype=next(ref_model.parameters()).dtype if quant else dtype, score_float32=None if quant else fp32)


def mean_logprob(model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> float | None:
    """Mean log-probability of ``tokens`` after ``prompt`` under ``model``, teacher-forced (one forward)."""
    if not tokens:
        return None
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(prompt) + list(tokens)[:-1], dtype=torch.long, device=device)[None]
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(tokens)).logits[0]  # [n, V]
    logp = torch.log_softmax(logits.double(), -1)
    target = torch.as_tensor(list(tokens), device=device)
    return float(logp.gather(-1, target[:, None]).mean())


def judge_quality(state: BenchState, model: torch.nn.Module, greedy: bool) -> None:
    """What quantization changes, per prompt, into ``state.quality``: for every row on a quantized
    verifier (and the full-precision plain row, the reference level) the mean log-probability of
    its tokens under the full-precision ``model``; greedy runs also get whether the output equals
    full-precision plain decoding and where it first leaves it."""
    from draftsmith.bench.verdict import first_difference

    quant_rows = [r for r, row in enumerate(state.rows) if row.quant is not None]
    if not quant_rows:
        return
    for (r, p), runs in sorted(state.results.items()):
        base = baseline_index(state.rows, r)
        if (r not in quant_rows and r != base) or (r, p) in state.quality:
            continue
        tokens = runs[0].token_ids
        entry: dict[str, Any] = {"mean_logprob": mean_logprob(model, state.prompts[p][1], tokens)}
        if greedy and r != base and (base, p) in state.results:
            i = first_difference(state.results[(base, p)][0].token_ids, tokens)
            entry.update(identical=i is None, first_divergence=i)
        state.quality[(r, p)] = entry
