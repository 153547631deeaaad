"""Benchmark: measured speedup, acceptance, break-even analysis, and a readable report.

What it measures, per row (plain decoding, each drafter at each k, and the HF
``generate`` / prompt-lookup reference rows), on the same prompts, interleaved
per prompt so machine drift hits every row alike:

* tokens/s per prompt (median over repeats), summarised over prompts;
* speedup = the *paired* per-prompt ratio tokens/s(row) / tokens/s(plain), its
  median and a seeded percentile-bootstrap 95% interval;
* acceptance (vLLM's definitions): length 1 + accepted/drafts, rate
  accepted/drafted, per-position accepted-at-i/drafts;
* identical-output rate against plain decoding (must be 100% at temperature 0);
* peak memory (RSS, and CUDA when present).

Break-even (Leviathan et al. 2023). A verifier step on n tokens costs
``T_verify(n)`` (``T(1)`` for plain decoding); a propose call for k tokens costs
``draft(k) = a + b*k``. With E tokens emitted per verifier forward,
``S = E * T(1) / (T_verify(k+1) + draft(k))``; with a single acceptance rate
alpha, ``E = (1 - alpha^(k+1)) / (1 - alpha)``. Measured per-position acceptance
predicts better: ``E = 1 + sum_i P(first i accepted)``. A drafter that sometimes
proposes fewer than k tokens, or none (n-gram without a match), is predicted
from its measured draft-length distribution. ``S`` factors into
``(k+1) * acceptance * verify * draft`` efficiencies, which tells what holds a
drafter back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from draftsmith.config import opt, to_dict
from draftsmith.decoding.proposers import DraftContext, Proposal, Proposer
from draftsmith.decoding.sampling import SamplingParams
from draftsmith.drafters import DRAFTER_HELP
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

EVAL_DATASETS = ("mt-bench", "humaneval")
PLOTS = ("acceptance.png", "speedup_vs_k.png", "tokens_per_second.png")


# ============================================================================ config
@dataclass
class BenchConfig:
    """Measure drafters against plain decoding: speedup, acceptance, break-even; write a report."""

    verifier: str = opt(help="verifier: HF model dir, .gguf file, or alias (smollm2-135m)")
    out: Path = opt(help="output directory for report.json, report.md and plots")
    drafter: list[str] = opt(default_factory=list, help=f"drafter(s) to measure, repeatable: {DRAFTER_HELP}")
    draft: list[str] = opt(default_factory=list, help="EAGLE-3 draft directory(ies) to measure, repeatable")
    dataset: str = opt("mt-bench", "eval prompts: mt-bench (first turns), humaneval, or a JSONL file")
    num_prompts: int = opt(20, "number of prompts (the first N of the dataset)")
    max_new_tokens: int = opt(128, "new tokens per prompt")
    num_draft_tokens: list[int] = opt(default_factory=lambda: [5],
                                      help="k, tokens drafted per round; several values are swept")
    temperature: float = opt(0.0, "0 = greedy (outputs must equal plain decoding); > 0 samples")
    repeats: int = opt(1, "timed passes over all prompts (per-prompt median is used)")
    warmup_tokens: int = opt(32, "new tokens of the untimed warm-up run of every row")
    hf_reference: bool = opt(True, "also measure HF transformers generate and HF prompt lookup")
    hf_lookup_tokens: int | None = opt(None, "HF prompt_lookup_num_tokens (default: the largest k)")
    target_speedup: float = opt(1.0, "speedup a drafter should reach; the report explains a miss")
    bootstrap: int = opt(2000, "bootstrap resamples for the speedup confidence interval")
    seed: int = opt(0, "seed for sampling and the bootstrap")
    threads: int | None = opt(None, "torch CPU threads (default: torch's choice); pin it on a shared machine")
    dtype: str = opt("auto", "model dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    device: str = opt("auto", "device: auto, cpu, cuda, cuda:N")
    progress: bool = opt(True, "show a progress bar")

    def __post_init__(self) -> None:
        if not self.drafter and not self.draft:
            raise DraftsmithError("give at least one --drafter or --draft to measure")
        for d in self.draft:
            if not Path(d).is_dir():
                raise DraftsmithError(f"--draft {d!r}: not a directory")
        if self.dataset not in EVAL_DATASETS and not Path(self.dataset).is_file():
            raise DraftsmithError(f"--dataset {self.dataset!r}: expected one of {list(EVAL_DATASETS)} "
                                  "or an existing JSONL file")
        for name in ("num_prompts", "max_new_tokens", "repeats", "warmup_tokens", "bootstrap"):
            if getattr(self, name) < 1:
                raise DraftsmithError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.num_draft_tokens or min(self.num_draft_tokens) < 1:
            raise DraftsmithError(f"--num-draft-tokens must be integers >= 1, got {self.num_draft_tokens}")
        self.num_draft_tokens = sorted(set(self.num_draft_tokens))
        if self.hf_lookup_tokens is not None and self.hf_lookup_tokens < 1:
            raise DraftsmithError(f"--hf-lookup-tokens must be >= 1, got {self.hf_lookup_tokens}")
        if self.temperature < 0:
            raise DraftsmithError(f"--temperature must be >= 0, got {self.temperature}")
        if self.threads is not None and self.threads < 1:
            raise DraftsmithError(f"--threads must be >= 1, got {self.threads}")
        if self.target_speedup <= 0:
            raise DraftsmithError(f"--target-speedup must be > 0, got {self.target_speedup}")


# ============================================================================ statistics
def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, quartiles, range and count of ``values`` (None fields when empty)."""
    if not len(values):
        return {"median": None, "p25": None, "p75": None, "min": None, "max": None, "n": 0}
    a = np.asarray(values, dtype=float)
    return {"median": float(np.median(a)), "p25": float(np.percentile(a, 25)),
            "p75": float(np.percentile(a, 75)), "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-prompt ratios ``numerator[i] / denominator[i]`` (e.g. tokens/s of a drafter over plain).

    Pairing by prompt cancels what prompts differ in (length, content), which an
    unpaired ratio of medians would fold into the noise.
    """
    if len(numerator) != len(denominator):
        raise ValueError(f"paired ratios need equal lengths, got {len(numerator)} and {len(denominator)}")
    return [float(n) / float(d) for n, d in zip(numerator, denominator)]


def bootstrap_ci(values: Sequence[float], statistic: Callable[[np.ndarray], Any] = np.median,
                 n_resamples: int = 2000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``statistic`` over ``values``.

    Args:
        values: the sample (e.g. per-prompt speedups).
        statistic: reduces an array along ``axis=-1`` (np.median, np.mean).
        n_resamples: bootstrap resamples.
        confidence: interval coverage, e.g. 0.95.
        seed: seed of the resampling RNG, so a report is reproducible.

    Returns:
        ``(low, high)`` percentiles of the resampled statistic.
    """
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    rng = np.random.default_rng(seed)
    resampled = statistic(a[rng.integers(0, a.size, size=(n_resamples, a.size))], axis=-1)
    tail = (1.0 - confidence) / 2 * 100
    lo, hi = np.percentile(resampled, [tail, 100 - tail])
    return float(lo), float(hi)


# ============================================================================ break-even
def expected_tokens(k: int, alpha: float | None = None, per_position: Sequence[float] | None = None) -> float:
    """Expected tokens emitted per verifier forward when k tokens are drafted.

    Args:
        k: draft length.
        alpha: single per-token acceptance rate: ``E = (1 - alpha^(k+1)) / (1 - alpha)``.
        per_position: measured ``P(first i accepted)`` for i = 1..; ``E = 1 + sum`` of
            the first k (extended geometrically when shorter than k).

    Returns:
        E, including the verifier's own (bonus or correction) token.
    """
    if (alpha is None) == (per_position is None):
        raise ValueError("give exactly one of alpha and per_position")
    if alpha is not None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return 1.0 + sum(extend_per_position(per_position, k))


def extend_per_position(per_position: Sequence[float], k: int) -> list[float]:
    """First k entries of ``P(first i accepted)``; beyond the measured ones, each step keeps
    the last measured conditional acceptance (a geometric tail)."""
    p = [float(x) for x in per_position[:k]]
    if len(p) >= k:
        return p
    if not p:
        return [0.0] * k
    ratio = p[-1] / p[-2] if len(p) >= 2 and p[-2] > 0 else p[-1]
    ratio = min(max(ratio, 0.0), 1.0)
    while len(p) < k:
        p.append(p[-1] * ratio)
    return p


def predicted_speedup(expected: float, k: int, t1: float, t_verify: float, t_draft: float) -> float:
    """Closed form ``S = E * T(1) / (T_verify(k+1) + k * T_draft)`` (Leviathan et al. 2023)."""
    return expected * t1 / (t_verify + k * t_draft)


def break_even_alpha(k: int, t1: float, t_verify: float, t_draft: float) -> float | None:
    """Acceptance rate alpha at which speculation exactly pays (S = 1); None if even alpha = 1 loses."""
    need = (t_verify + k * t_draft) / t1  # tokens per forward needed to break even
    if need <= 1.0:
        return 0.0
    if need > k + 1:
        return None
    lo, hi = 0.0, 1.0  # E(alpha) is increasing in alpha: bisection
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(k, alpha=mid) < need else (lo, mid)
    return (lo + hi) / 2


@dataclass
class CostModel:
    """Measured step costs on this machine, in seconds.

    Attributes:
        t_verify: verifier forward on n tokens (with a warm KV cache) -> seconds; n = 1 is T(1).
        draft_fixed: per propose call, independent of k (n-gram search, draft catch-up).
        draft_per_token: per drafted token (one draft-model step).
        context_tokens: KV-cache length at which ``t_verify`` was measured.
    """

    t_verify: dict[int, float]
    draft_fixed: float = 0.0
    draft_per_token: float = 0.0
    context_tokens: int = 0

    @property
    def t1(self) -> float:
        return self.t_verify[1]

    def verify(self, n: float) -> float:
        """T_verify at n tokens, linearly interpolated (and extrapolated) between measured points."""
        xs = sorted(self.t_verify)
        if n in self.t_verify:
            return self.t_verify[int(n)]
        if len(xs) == 1:
            return self.t_verify[xs[0]] * n / xs[0]
        lo = max([x for x in xs if x <= n] or xs[:1])
        hi = min([x for x in xs if x > n] or xs[-1:])
        if lo == hi:  # beyond the measured range: use the slope of the last two points
            lo, hi = (xs[-2], xs[-1]) if n > xs[-1] else (xs[0], xs[1])
        return self.t_verify[lo] + (self.t_verify[hi] - self.t_verify[lo]) * (n - lo) / (hi - lo)

    def draft(self, k: int) -> float:
        return self.draft_fixed + self.draft_per_token * k


@dataclass
class DrafterProfile:
    """How a drafter behaved in a run at draft length ``k``.

    Attributes:
        k: requested draft length of the run.
        per_position: ``P(first i accepted | drafted)``, i = 1..k (vLLM's per-position acceptance).
        length_counts: ``length_counts[l]`` = rounds that proposed l tokens (l = 0..k).
    """

    k: int
    per_position: list[float]
    length_counts: list[int]


@dataclass
class Prediction:
    """Predicted behaviour at draft length k; ``speedup = (k+1) * acceptance * verify * draft``."""

    k: int
    tokens_per_round: float
    seconds_per_round: float
    speedup: float
    acceptance: float  # E / (k+1): tokens emitted over the most one round can emit
    verify: float      # T(1) / verify cost per round: price of checking k+1 tokens
    draft: float       # verify cost / (verify + draft cost): price of drafting
    extrapolated: bool


def predict(profile: DrafterProfile, costs: CostModel, k: int) -> Prediction:
    """Predict tokens per verifier forward, cost per round and speedup at draft length k.

    Rounds proposing l < k tokens (or none) verify l + 1 tokens and can emit at most
    l + 1; their share comes from the measured length distribution, truncated at k
    (drafts are prefixes of longer drafts). Beyond the measured k, full-length
    drafts are assumed to stay full length, and acceptance continues geometrically.
    """
    counts = profile.length_counts
    rounds = sum(counts)
    if rounds == 0:
        probs = {k: 1.0}
    else:
        probs = {}
        for length, c in enumerate(counts):
            cut = k if length >= profile.k else min(length, k)
            probs[cut] = probs.get(cut, 0.0) + c / rounds
    drafted = sum(p for length, p in probs.items() if length > 0)
    pos = extend_per_position(profile.per_position, k)
    tokens = 1.0 + drafted * sum(pos)
    verify_cost = sum(p * costs.verify(length + 1) for length, p in probs.items())
    draft_cost = costs.draft(k)
    seconds = verify_cost + draft_cost
    return Prediction(
        k=k, tokens_per_round=tokens, seconds_per_round=seconds, speedup=tokens * costs.t1 / seconds,
        acceptance=tokens / (k + 1), verify=costs.t1 / verify_cost, draft=verify_cost / seconds,
        extrapolated=k > profile.k)


def best_k(predictions: Sequence[Prediction]) -> Prediction:
    """The prediction with the highest speedup (the smallest k among ties)."""
    return max(predictions, key=lambda p: (p.speedup, -p.k))


def limiting_term(pred: Prediction) -> str:
    """The efficiency factor that loses the most: acceptance, verify cost or draft cost."""
    terms = {"acceptance": pred.acceptance, "verify cost": pred.verify, "draft cost": pred.draft}
    return min(terms, key=terms.get)


# ============================================================================ measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> bool:
    """Reset the peak RSS (Linux ``clear_refs``) and CUDA peak counters; True if RSS could be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5 = reset the peak resident set size (VmHWM)
        return True
    except OSError:
        return False


def peak_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(peak RSS bytes, peak CUDA bytes allocated or None)."""
    cuda = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
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
    (with ``timing``) the wall time; used for draft-length distributions and draft costs."""

    def __init__(self, inner: Proposer, timing: bool = False, device: torch.device | None = None) -> None:
        self.inner, self.timing, self.device = inner, timing, device
        # The engine reads these; mirror the wrapped drafter's declaration.
        self.requires_hidden_states = inner.requires_hidden_states
        self.aux_layer_ids = inner.aux_layer_ids
        self.calls: list[tuple[int, int, float]] = []

    def reset(self) -> None:
        self.inner.reset()

    def check_compatible(self, verifier: torch.nn.Module) -> None:
        self.inner.check_compatible(verifier)

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
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
        kind: plain | drafter | hf-generate | hf-prompt-lookup.
        drafter: drafter label (rows of one drafter at several k share it).
        k: draft length (None for rows without drafting).
    """

    def __init__(self, name: str, kind: str, model: torch.nn.Module, drafter: str | None = None,
                 k: int | None = None, proposer: Proposer | None = None) -> None:
        self.name, self.kind, self.model, self.drafter, self.k, self.proposer = name, kind, model, drafter, k, proposer

    def __call__(self, ids: torch.Tensor, max_new_tokens: int, temperature: float,
                 seed: int) -> tuple[list[int], dict[str, Any] | None, list[tuple[int, int, float]]]:
        """Generate; returns (new token ids, engine stats or None, proposer calls)."""
        if self.kind.startswith("hf-"):
            return self._hf(ids, max_new_tokens, temperature, seed), None, []
        from draftsmith.decoding.engine import generate

        rec = RecordingProposer(self.proposer) if self.proposer is not None else None
        out = generate(self.model, ids, proposer=rec, max_new_tokens=max_new_tokens, temperature=temperature,
                       num_draft_tokens=self.k or 1, seed=seed)
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


def timed_run(row: Row, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int) -> RunResult:
    """Run ``row`` once on ``ids``, timing wall-clock (prefill included) and peak memory."""
    device = ids.device
    reset_peak_memory(device)
    _sync(device)
    t0 = time.perf_counter()
    tokens, stats, calls = row(ids, max_new_tokens, temperature, seed)
    _sync(device)
    seconds = time.perf_counter() - t0
    rss, cuda = peak_memory(device)
    return RunResult(tokens, seconds, stats, calls, rss, cuda)


def monotone_fit(values: dict[int, float]) -> dict[int, float]:
    """Least-squares non-decreasing fit (pool adjacent violators) of ``n -> seconds``.

    A forward over more tokens never costs less; a noisy median that says otherwise
    (e.g. T(3) < T(1) on a busy machine) is pooled with its neighbours.
    """
    blocks: list[list[float]] = []  # [sum, count]
    keys = sorted(values)
    for n in keys:
        blocks.append([values[n], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    fitted = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(keys, fitted))


def measure_verify_costs(model: torch.nn.Module, context: Sequence[int], ns: Sequence[int],
                         repeats: int = 9, warmup: int = 2) -> dict[int, float]:
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
        runner = verifier_runner(model, ctx.shape[0] + max(ns))  # the engine's path and cache
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
        runner.close()
    return monotone_fit({n: statistics.median(v) for n, v in times.items()})


def measure_draft_costs(model: torch.nn.Module, proposer: Proposer, prompt: Sequence[int], ks: Sequence[int],
                        max_new_tokens: int, temperature: float, seed: int) -> dict[int, float]:
    """Median seconds of one propose call at each k, timed inside real generations.

    The first call of a sequence is skipped: it includes one-off work (a draft
    model's prompt prefill) that is not a per-round cost.
    """
    from draftsmith.decoding.engine import generate

    device = next(model.parameters()).device
    out: dict[int, float] = {}
    for k in ks:
        rec = RecordingProposer(proposer, timing=True, device=device)
        generate(model, prompt, proposer=rec, max_new_tokens=max_new_tokens, temperature=temperature,
                 num_draft_tokens=k, seed=seed)
        times = [s for req, _, s in rec.calls[1:] if req == k] or [s for _, _, s in rec.calls]
        if times:
            out[k] = statistics.median(times)
    return out


def fit_draft_cost(per_call: dict[int, float]) -> tuple[float, float]:
    """(fixed, per-token) seconds of ``draft(k) = fixed + per_token * k`` from per-call medians."""
    if not per_call:
        return 0.0, 0.0
    ks = sorted(per_call)
    if len(ks) == 1:
        return 0.0, per_call[ks[0]] / ks[0]
    slope, intercept = np.polyfit(ks, [per_call[k] for k in ks], 1)
    slope = max(float(slope), 0.0)
    return max(float(intercept), 0.0), slope


# ============================================================================ prompts
def _load_eval_prompts(dataset: str, tokenizer: object, limit: int | None) -> list[tuple[str, list[int]]]:
    """Eval prompts as ``(prompt id, token ids)`` from the dataset registry (first user turns)."""
    from draftsmith.data.prompts import eval_set

    return eval_set(dataset, tokenizer, limit)


# ============================================================================ the run
@dataclass
class BenchState:
    """Everything measured so far; the report is built from it, complete or not."""

    rows: list[Row]
    prompts: list[tuple[str, list[int]]]
    results: dict[tuple[int, int], list[RunResult]] = field(default_factory=dict)  # (row, prompt) -> repeats
    costs: CostModel | None = None
    draft_per_call: dict[str, dict[int, float]] = field(default_factory=dict)
    draft_fit: dict[str, tuple[float, float]] = field(default_factory=dict)
    partial: bool = False
    note: str = ""
    started: float = field(default_factory=time.time)
    load_at_start: float | None = field(default_factory=lambda: _load_average())


def _build_rows(model: torch.nn.Module, proposers: dict[str, Proposer], ks: Sequence[int],
                hf_reference: bool, hf_lookup_tokens: int | None) -> list[Row]:
    rows = [Row("plain (ours)", "plain", model)]
    for name, prop in proposers.items():
        rows += [Row(f"{name} k={k}", "drafter", model, drafter=name, k=k, proposer=prop) for k in ks]
    if hf_reference:
        rows.append(Row("HF generate", "hf-generate", model))
        k_hf = hf_lookup_tokens or max(ks)
        rows.append(Row(f"HF prompt lookup k={k_hf}", "hf-prompt-lookup", model, k=k_hf))
    return rows


def measure_interleaved(state: BenchState, max_new_tokens: int, temperature: float, repeats: int,
                        seed: int, progress: bool = True, warmup_tokens: int = 32) -> None:
    """Warm every row up, then time every row on every prompt, interleaved per prompt.

    The row order rotates from prompt to prompt so no row is always first (cold
    caches) or last; results land in ``state`` as they come, so an interrupt keeps them.
    """
    from tqdm import tqdm

    device = next(state.rows[0].model.parameters()).device
    prompts = [torch.as_tensor(ids, dtype=torch.long, device=device) for _, ids in state.prompts]
    n_rows = len(state.rows)
    total = n_rows * (1 + repeats * len(prompts))
    with tqdm(total=total, desc="bench", unit="run", disable=not progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
        for row in state.rows:
            bar.set_postfix_str(f"warm-up {row.name}")
            row(prompts[0], min(warmup_tokens, max_new_tokens), temperature, seed)
            bar.update()
        for _ in range(repeats):
            for p, ids in enumerate(prompts):
                shift = p % n_rows
                for r in list(range(shift, n_rows)) + list(range(shift)):
                    bar.set_postfix_str(f"{state.rows[r].name} | prompt {p + 1}/{len(prompts)}")
                    res = timed_run(state.rows[r], ids, max_new_tokens, temperature, seed + p)
                    state.results.setdefault((r, p), []).append(res)
                    bar.update()


def measure_costs(state: BenchState, proposers: dict[str, Proposer], ks: Sequence[int], max_new_tokens: int,
                  temperature: float, seed: int) -> None:
    """Fill ``state.costs`` (T_verify(n)) and per-drafter propose costs for this machine and model."""
    model = state.rows[0].model
    prompt = state.prompts[0][1]
    k_max = max(max(ks), 8)
    limit = getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "max_position_embeddings",
                    None)
    # Measure at the mid-generation context length, where the average step happens.
    target = len(prompt) + max_new_tokens // 2
    if limit is not None:
        target = min(target, limit - k_max - 2)
    context = (prompt * (target // len(prompt) + 1))[:target]
    state.costs = CostModel(measure_verify_costs(model, context, range(1, k_max + 2)), context_tokens=target)
    cal_ks = sorted({1, max(ks)})
    for name, prop in proposers.items():
        per_call = measure_draft_costs(model, prop, prompt, cal_ks, min(max_new_tokens, 48), temperature, seed)
        state.draft_per_call[name] = per_call
        state.draft_fit[name] = fit_draft_cost(per_call)


def benchmark(model: torch.nn.Module, prompts: list[tuple[str, list[int]]], proposers: dict[str, Proposer],
              cfg: BenchConfig, out_dir: Path, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure every row and write the report (partial on Ctrl-C, which is re-raised).

    Args:
        model: the verifier.
        prompts: ``(id, token ids)`` eval prompts.
        proposers: drafter label -> proposer.
        cfg: run settings (k sweep, repeats, temperature, ...).
        out_dir: where report.json, report.md and the plots go.
        provenance: verifier spec and fingerprint, command line, dataset name.

    Returns:
        The report as written to ``report.json``.
    """
    rows = _build_rows(model, proposers, cfg.num_draft_tokens, cfg.hf_reference, cfg.hf_lookup_tokens)
    state = BenchState(rows, prompts)
    param = next(model.parameters())
    provenance = {**(provenance or {}), "dtype": str(param.dtype).removeprefix("torch."), "device": str(param.device)}
    try:
        if cfg.progress:
            print("bench: measuring verifier and draft step costs ...", file=sys.stderr)
        measure_costs(state, proposers, cfg.num_draft_tokens, cfg.max_new_tokens, cfg.temperature, cfg.seed)
        measure_interleaved(state, cfg.max_new_tokens, cfg.temperature, cfg.repeats, cfg.seed,
                            progress=cfg.progress, warmup_tokens=cfg.warmup_tokens)
    except KeyboardInterrupt:
        state.partial, state.note = True, "interrupted (Ctrl-C)"
        write_report(build_report(state, cfg, provenance), out_dir)
        raise
    report = build_report(state, cfg, provenance)
    write_report(report, out_dir)
    return report


def run_bench(cfg: BenchConfig) -> int:
    """CLI entry: load the verifier, prompts and drafters, measure, write the report."""
    from draftsmith.drafters import build_proposer
    from draftsmith.models.verifier import load_verifier
    from draftsmith.utils import command_line

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model, tokenizer, fp = load_verifier(cfg.verifier, dtype=cfg.dtype, device=cfg.device)
    prompts = _load_eval_prompts(cfg.dataset, tokenizer, cfg.num_prompts)
    proposers: dict[str, Proposer] = {}
    for spec in cfg.drafter:
        proposers[spec] = build_proposer(spec, model, tokenizer, dtype=cfg.dtype)
    for d in cfg.draft:
        proposers[f"eagle3:{Path(d).name}"] = build_proposer(d, model, tokenizer, dtype=cfg.dtype)
    provenance = {"verifier": cfg.verifier, "fingerprint": fp, "command": command_line(), "dataset": cfg.dataset}
    try:
        report = benchmark(model, prompts, proposers, cfg, Path(cfg.out), provenance)
    except KeyboardInterrupt:
        print(f"bench: partial report written to {cfg.out}/report.md", file=sys.stderr)
        raise
    print(render_markdown(report))
    return 0


# ============================================================================ report
def _pooled_acceptance(results: list[RunResult], k: int) -> dict[str, Any]:
    """vLLM-style acceptance pooled over runs, plus the draft-length distribution at k."""
    drafts = draft_tokens = 0
    accepted_at = [0] * k
    new_tokens = forwards = 0
    lengths = [0] * (k + 1)
    for res in results:
        s = res.stats or {}
        d = s.get("drafts", 0)
        drafts += d
        draft_tokens += s.get("draft_tokens", 0)
        for i, p in enumerate(s.get("per_position_acceptance", [])[:k]):
            accepted_at[i] += round(p * d)
        new_tokens += s.get("new_tokens", 0)
        forwards += s.get("verifier_forwards", 0)
        for req, got, _ in res.draft_calls:
            if req == k:
                lengths[min(got, k)] += 1
    accepted = sum(accepted_at)
    rounds = forwards - len(results)  # the prefill forward emits the first token, not a round
    calls = sum(lengths)
    return {
        "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
        "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "per_position_acceptance": [a / drafts if drafts else 0.0 for a in accepted_at],
        "tokens_per_round": (new_tokens - len(results)) / rounds if rounds > 0 else None,
        "drafted_fraction": (calls - lengths[0]) / calls if calls else None,
        "mean_draft_length": (sum(i * c for i, c in enumerate(lengths)) / (calls - lengths[0])
                              if calls - lengths[0] > 0 else 0.0),
        "length_counts": lengths,
    }


def _row_report(state: BenchState, r: int, cfg: BenchConfig) -> dict[str, Any] | None:
    row = state.rows[r]
    done = sorted(p for (rr, p) in state.results if rr == r)
    if not done:
        return None
    tps = {p: statistics.median(x.tokens_per_second for x in state.results[(r, p)]) for p in done}
    base = {p: statistics.median(x.tokens_per_second for x in state.results[(0, p)])
            for p in done if (0, p) in state.results}
    paired = [p for p in done if p in base]
    runs = [x for p in done for x in state.results[(r, p)]]
    ratios = paired_ratios([tps[p] for p in paired], [base[p] for p in paired])
    out: dict[str, Any] = {
        "name": row.name, "kind": row.kind, "drafter": row.drafter, "k": row.k,
        "tokens_per_second": summarize(list(tps.values())),
        "speedup": {"median": float(np.median(ratios)) if ratios else None,
                    "ci95": list(bootstrap_ci(ratios, n_resamples=cfg.bootstrap, seed=cfg.seed)) if ratios else None,
                    "n": len(ratios), "per_prompt": ratios},
        "identical_output_rate": None, "identical_prompts": None,
        "peak_rss_bytes": max((x.peak_rss for x in runs if x.peak_rss is not None), default=None),
        "peak_cuda_bytes": max((x.peak_cuda for x in runs if x.peak_cuda is not None), default=None),
        "per_prompt": [{"prompt": state.prompts[p][0], "prompt_tokens": len(state.prompts[p][1]),
                        "new_tokens": len(state.results[(r, p)][0].token_ids),
                        "seconds": [x.seconds for x in state.results[(r, p)]]} for p in done],
    }
    if cfg.temperature == 0 and paired:
        same = [p for p in paired if state.results[(r, p)][0].token_ids == state.results[(0, p)][0].token_ids]
        out["identical_output_rate"] = len(same) / len(paired)
        out["identical_prompts"] = f"{len(same)}/{len(paired)}"
    if row.kind == "drafter":
        out["acceptance"] = _pooled_acceptance(runs, row.k)
    return out


def _break_even(state: BenchState, rows: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    """Per drafter: predicted speedup for every k, best k, predicted vs measured, the verdict."""
    if state.costs is None:
        return {}
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["drafter"] for r in rows if r["kind"] == "drafter"):
        mine = sorted((r for r in rows if r["drafter"] == name), key=lambda r: r["k"])
        basis = mine[-1]  # the longest drafts see the most positions
        acc = basis["acceptance"]
        profile = DrafterProfile(basis["k"], acc["per_position_acceptance"], acc["length_counts"])
        fixed, per_token = state.draft_fit.get(name, (0.0, 0.0))
        costs = dataclasses.replace(state.costs, draft_fixed=fixed, draft_per_token=per_token)
        preds = [predict(profile, costs, k) for k in range(1, max(max(cfg.num_draft_tokens), 8) + 1)]
        best = best_k([p for p in preds if not p.extrapolated] or preds)
        measured = {r["k"]: r for r in mine if r["speedup"]["median"] is not None}
        main = max(measured.values(), key=lambda r: r["speedup"]["median"]) if measured else None
        entry: dict[str, Any] = {
            "basis_k": basis["k"], "draft_fixed_seconds": fixed, "draft_per_token_seconds": per_token,
            "draft_per_call_seconds": {str(k): v for k, v in state.draft_per_call.get(name, {}).items()},
            "predicted": [dataclasses.asdict(p) for p in preds],
            "best_k": best.k, "best_k_predicted_speedup": best.speedup,
            "measured": {str(k): {"speedup": r["speedup"]["median"], "ci95": r["speedup"]["ci95"],
                                  "predicted": preds[k - 1].speedup if k <= len(preds) else None}
                         for k, r in measured.items()},
        }
        if main is not None:
            k = main["k"]
            pred = preds[k - 1]
            s = main["speedup"]["median"]
            entry.update({
                "measured_k": k, "measured_speedup": s,
                "factors": {"ideal": k + 1, "acceptance": pred.acceptance, "verify cost": pred.verify,
                            "draft cost": pred.draft, "engine overhead (measured/predicted)": s / pred.speedup},
                "held_back_by": limiting_term(pred),
                "meets_target": s >= cfg.target_speedup,
                "below_break_even": s < 1.0,
                "break_even_alpha": break_even_alpha(k, costs.t1, costs.verify(k + 1),
                                                     costs.draft(k) / k),
                "measured_alpha": main["acceptance"]["acceptance_rate"],
            })
        out[name] = entry
    return out


def _load_average() -> float | None:
    """1-minute load average (None where the OS has none): other work on the machine skews timings."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _environment() -> dict[str, Any]:
    from draftsmith.utils import environment_info

    env = environment_info()
    try:
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        env["cpu_model"] = m.group(1).strip() if m else None
    except OSError:
        env["cpu_model"] = None
    return env


def build_report(state: BenchState, cfg: BenchConfig, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """All numbers of the run as one JSON-ready dict."""
    rows = [r for r in (_row_report(state, i, cfg) for i in range(len(state.rows))) if r is not None]
    c = state.costs
    measured_prompts = {p for (_, p) in state.results}
    return {
        "partial": state.partial, "note": state.note,
        "provenance": dict(provenance or {}),
        "config": to_dict(cfg),
        "environment": _environment(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.started)),
        "seconds": time.time() - state.started,
        "load_average": {"start": state.load_at_start, "end": _load_average()},
        "prompts": {"requested": len(state.prompts), "measured": len(measured_prompts),
                    "runs": sum(len(v) for v in state.results.values()),
                    "prompt_tokens": summarize([len(ids) for _, ids in state.prompts])},
        "rows": rows,
        "costs": None if c is None else {
            "context_tokens": c.context_tokens, "t1_seconds": c.t1,
            "t_verify_seconds": {str(n): t for n, t in c.t_verify.items()}},
        "break_even": _break_even(state, rows, cfg),
    }


def _fmt_bytes(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def render_markdown(report: dict[str, Any]) -> str:
    """A table and a few lines a person reads in 10 seconds (well under one screen)."""
    cfg, prov, env = report["config"], report["provenance"], report["environment"]
    temp = "greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']}"
    device = env.get("cuda") or f"{env.get('cpu_model') or env.get('processor')} ({env.get('torch_threads')} threads)"
    lines = [f"# draftsmith bench: {prov.get('verifier', '?')} on {prov.get('dataset', cfg['dataset'])}", "",
             f"{report['prompts']['measured']} prompts x {cfg['max_new_tokens']} new tokens, {temp}, "
             f"{cfg['repeats']} repeat(s); {device}, {prov.get('dtype', '?')}; "
             f"verifier {prov.get('fingerprint', '?')}"]
    load, cpus = report["load_average"]["start"], env.get("cpu_count") or 1
    if load is not None and load > 0.25 * cpus:
        lines += ["", f"Note: the machine was busy at the start (load {load:.1f} on {cpus} CPUs); "
                      "timings may be noisy."]
    if report["partial"]:
        lines += ["", f"**PARTIAL REPORT: {report['note']} after {report['prompts']['runs']} runs "
                      f"({report['prompts']['measured']}/{report['prompts']['requested']} prompts).**"]
    cuda = any(r["peak_cuda_bytes"] for r in report["rows"])
    lines += ["", "| row | tok/s median [IQR] | speedup [95% CI] | acc. length | acc. rate | identical | "
                  f"peak {'CUDA' if cuda else 'RSS'} |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        t, s, acc = r["tokens_per_second"], r["speedup"], r.get("acceptance")
        speed = "1.00x (baseline)" if r["kind"] == "plain" else (
            f"{s['median']:.2f}x [{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}]" if s["median"] is not None else "-")
        ident = "ref" if r["kind"] == "plain" else (
            "n/a" if r["identical_output_rate"] is None else f"{100 * r['identical_output_rate']:.0f}%")
        lines.append(f"| {r['name']} | {t['median']:.1f} [{t['p25']:.1f}-{t['p75']:.1f}] | {speed} | "
                     + (f"{acc['acceptance_length']:.2f} | {acc['acceptance_rate']:.2f}" if acc else "- | -")
                     + f" | {ident} | {_fmt_bytes(r['peak_cuda_bytes'] if cuda else r['peak_rss_bytes'])} |")
    bad = [r for r in report["rows"] if r["kind"] in ("plain", "drafter") and r["identical_output_rate"] is not None
           and r["identical_output_rate"] < 1.0]
    for r in bad:
        why = ("greedy speculative decoding in float32 must not: a bug" if prov.get("dtype") == "float32" else
               "in low precision, verifying several tokens at once can flip near-ties; check with --dtype float32")
        lines += ["", f"**WARNING: {r['name']} output equals plain decoding on only {r['identical_prompts']} "
                      f"prompts; {why}.**"]
    costs = report["costs"]
    if costs:
        tv = costs["t_verify_seconds"]
        kk = max(cfg["num_draft_tokens"]) + 1
        lines += ["", f"## Break-even (T(1) = {_fmt_ms(costs['t1_seconds'])}, T_verify({kk}) = "
                      f"{_fmt_ms(tv[str(kk)])} at {costs['context_tokens']} cached tokens)", ""]
    for name, be in report["break_even"].items():
        if "measured_speedup" not in be:
            continue
        k, s, f = be["measured_k"], be["measured_speedup"], be["factors"]
        pred = be["measured"][str(k)]["predicted"]
        lo, hi = be["measured"][str(k)].get("ci95") or (None, None)
        if lo is not None and lo <= 1.0 <= hi:  # the interval cannot tell it from plain decoding
            head = f"no measurable effect ({s:.2f}x [{lo:.2f}-{hi:.2f}] at k={k})"
        elif be["below_break_even"]:
            head = f"this draft makes decoding slower by {100 * (1 - s):.0f}% ({s:.2f}x at k={k})"
        else:
            head = f"{s:.2f}x at k={k}"
        line = (f"- **{name}**: {head}, predicted {pred:.2f}x; best predicted k = {be['best_k']} "
                f"({be['best_k_predicted_speedup']:.2f}x). ")
        acc = next(r for r in report["rows"] if r["drafter"] == name and r["k"] == k)["acceptance"]
        if acc["drafted_fraction"] is not None and acc["drafted_fraction"] < 0.999:
            line += (f"Drafted in {100 * acc['drafted_fraction']:.0f}% of rounds "
                     f"(mean length {acc['mean_draft_length']:.1f}). ")
        line += (f"Ideal {f['ideal']}x x acceptance {f['acceptance']:.2f} x verify cost {f['verify cost']:.2f} "
                 f"x draft cost {f['draft cost']:.2f}; held back by **{be['held_back_by']}**")
        if not be["meets_target"]:
            ba = be["break_even_alpha"]
            line += f"; target {cfg['target_speedup']:.2f}x missed"
            # The alpha form assumes k tokens every round; skip it for drafters that often propose fewer.
            if acc["drafted_fraction"] is None or acc["drafted_fraction"] >= 0.999:
                line += (f"; break-even needs alpha >= {ba:.2f}, measured {be['measured_alpha']:.2f}" if ba
                         else "; even perfect acceptance cannot pay for this draft cost" if ba is None else "")
        lines.append(line + ".")
    lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS) + ". All numbers: report.json."]
    return "\n".join(lines) + "\n"


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Per-position acceptance, speedup vs k (predicted and measured), tokens/s per row."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    written = []
    drafters = report["break_even"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    title_tail = f"({report['provenance'].get('verifier', '')}, {report['provenance'].get('dataset', '')})"

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, name in enumerate(dict.fromkeys(r["drafter"] for r in report["rows"] if r["kind"] == "drafter")):
        row = max((r for r in report["rows"] if r["drafter"] == name), key=lambda r: r["k"])
        pos = row["acceptance"]["per_position_acceptance"]
        ax.plot(range(1, len(pos) + 1), pos, "o-", color=colors[i % len(colors)], label=f"{name} (k={row['k']})")
    ax.set(xlabel="draft position i", ylabel="acceptance at position i [fraction of drafts]",
           title=f"Per-position acceptance {title_tail}", ylim=(0, 1.05))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    written.append(out_dir / PLOTS[0])
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, be) in enumerate(drafters.items()):
        color = colors[i % len(colors)]
        pred = be["predicted"]
        inside = [p for p in pred if not p["extrapolated"]]
        outside = [p for p in pred if p["extrapolated"]]
        ax.plot([p["k"] for p in inside], [p["speedup"] for p in inside], "--", color=color,
                label=f"{name} predicted (best k={be['best_k']}: *)")
        if outside:  # beyond the measured k: acceptance continued geometrically
            tail = inside[-1:] + outside
            ax.plot([p["k"] for p in tail], [p["speedup"] for p in tail], ":", color=color)
        ax.plot([be["best_k"]], [be["best_k_predicted_speedup"]], "*", ms=12, color=color)
        m = be["measured"]
        if m:
            mk = sorted(int(k) for k in m)
            med = [m[str(k)]["speedup"] for k in mk]
            err = [[med[j] - m[str(k)]["ci95"][0] for j, k in enumerate(mk)],
                   [m[str(k)]["ci95"][1] - med[j] for j, k in enumerate(mk)]]
            ax.errorbar(mk, med, yerr=err, fmt="o", color=color, capsize=3, label=f"{name} measured (95% CI)")
    ax.axhline(1.0, color="gray", lw=1, label="break-even (plain decoding)")
    ax.set(xlabel="draft length k [tokens]  (dotted: extrapolated beyond the measured k)",
           ylabel="speedup over plain decoding [x]", title=f"Speedup vs draft length {title_tail}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    written.append(out_dir / PLOTS[1])
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 0.9 + 0.45 * max(len(rows), 1)))
    med = [r["tokens_per_second"]["median"] for r in rows]
    err = [[m - r["tokens_per_second"]["p25"] for m, r in zip(med, rows)],
           [r["tokens_per_second"]["p75"] - m for m, r in zip(med, rows)]]
    kind_color = {"plain": "gray", "drafter": colors[0], "hf-generate": colors[1], "hf-prompt-lookup": colors[1]}
    ax.barh(range(len(rows)), med, xerr=err, capsize=3, color=[kind_color[r["kind"]] for r in rows])
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows])
    ax.invert_yaxis()
    if rows and rows[0]["kind"] == "plain":
        ax.axvline(med[0], color="gray", ls="--", lw=1)
    from matplotlib.patches import Patch

    for y, m in enumerate(med):
        ax.annotate(f"{m:.1f}", (m, y), xytext=(4, 4), textcoords="offset points", fontsize="small")
    ax.set_xlim(0, max(r["tokens_per_second"]["p75"] for r in rows) * 1.15)
    ax.legend(handles=[Patch(color="gray", label="plain (ours)"), Patch(color=colors[0], label="drafters (ours)"),
                       Patch(color=colors[1], label="HF transformers")], fontsize="small", ncol=3,
              loc="upper center", bbox_to_anchor=(0.5, -0.22 - 0.3 / max(len(rows), 1)))
    ax.set(xlabel="throughput [tokens/s], median over prompts (whiskers: IQR)", title=f"Tokens/s {title_tail}")
    ax.grid(axis="x", alpha=0.3)
    written.append(out_dir / PLOTS[2])
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return written


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """report.json (everything), report.md (one screen) and the PNG plots under ``out_dir``."""
    from draftsmith.utils import atomic_write_bytes, atomic_write_json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "report.json", report)
    if report["rows"]:
        write_plots(report, out_dir)
    atomic_write_bytes(out_dir / "report.md", render_markdown(report).encode())
