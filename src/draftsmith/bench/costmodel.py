"""Break-even analysis: what a drafter should gain on this machine, from measured step costs.

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

import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


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


def predict(profile: DrafterProfile, costs: CostModel, k: int, empty_round: float | None = None) -> Prediction:
    """Predict tokens per verifier forward, cost per round and speedup at draft length k.

    Rounds proposing l < k tokens (or none) verify l + 1 tokens and can emit at most
    l + 1, and their propose call paid l + 1 draft steps (a draft that stops early
    has read one more distribution than it proposed from); their share comes from
    the measured length distribution, truncated at k (drafts are prefixes of longer
    drafts). Beyond the measured k, full-length drafts are assumed to stay full
    length, and acceptance continues geometrically.

    ``empty_round`` prices the one-token verify of a round that proposed nothing, where it
    differs from ``T(1)``, the plain step every token is worth (default: ``T(1)``).
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
    empty = costs.verify(1) if empty_round is None else empty_round
    verify_cost = sum(p * (empty if length == 0 else costs.verify(length + 1)) for length, p in probs.items())
    # a call that stopped at l < k tokens ran l + 1 draft steps (the last one read an unsure draft)
    draft_cost = costs.draft_fixed + costs.draft_per_token * sum(p * min(length + 1, k) for length, p in probs.items())
    seconds = verify_cost + draft_cost
    return Prediction(
        k=k, tokens_per_round=tokens, seconds_per_round=seconds, speedup=tokens * costs.t1 / seconds,
        acceptance=tokens / (k + 1), verify=costs.t1 / verify_cost, draft=verify_cost / seconds,
        extrapolated=k > profile.k)


def confidence_thresholds(costs: CostModel, k: int) -> list[float]:
    """Per draft position i = 1..k, the least cumulative draft confidence at which proposing
    token i pays (:class:`~draftsmith.decoding.proposers.Eagle3Proposer`'s ``min_confidence``).

    Proposing token i adds ``T_verify(i+1) - T_verify(i)`` to the round's verify and one draft
    step; it yields one more token with the probability that tokens 1..i all pass, which a
    calibrated draft estimates by the product of its top probabilities. A token is worth
    ``T(1)``, what plain decoding pays for it, so the break-even confidence is the marginal
    price over ``T(1)``. Where verifying more tokens is nearly free (a GPU) the thresholds are
    near 0 and the draft proposes all k; where it is dear (a 2-token verify at 1.3x a one-token
    step on a CPU) an unsure first token is not proposed.
    """
    return [min(1.0, max(0.0, (costs.verify(i + 1) - costs.verify(i) + costs.draft_per_token) / costs.t1))
            for i in range(1, k + 1)]


def best_k(predictions: Sequence[Prediction]) -> Prediction:
    """The prediction with the highest speedup (the smallest k among ties)."""
    return max(predictions, key=lambda p: (p.speedup, -p.k))


def limiting_term(pred: Prediction) -> str:
    """The efficiency factor that loses the most: acceptance, verify cost or draft cost."""
    terms = {"acceptance": pred.acceptance, "verify cost": pred.verify, "draft cost": pred.draft}
    return min(terms, key=terms.get)



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



#: Fraction of the samples dropped at each end by :func:`trimmed_mean`
TRIM = 0.05


def trimmed_mean(samples: Sequence[float], trim: float = TRIM) -> float:
    """Mean of ``samples`` without the ``trim`` fraction at each end.

    A price must add up to the time a decode spends, so it is a mean, not a median: a
    verify forward's times are skewed (a draft-step catch-up of n + 1 tokens, a slower
    step now and then), and the median of skewed times undercounts their sum. The trim
    keeps one preemption of the process (a 100 ms step among 30 ms ones) from moving it.
    """
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("trimmed_mean of no samples")
    cut = int(len(xs) * trim)
    xs = xs[cut:len(xs) - cut] or xs
    return sum(xs) / len(xs)


#: In-situ samples a verify length needs before its own mean prices it (:func:`in_situ_prices`)
MIN_IN_SITU = 5


def in_situ_prices(table: dict[int, float], plain: Sequence[float], verify: dict[int, Sequence[float]],
                   min_samples: int = MIN_IN_SITU) -> dict[int, float]:
    """``T_verify(n)`` as a decode loop pays it, from the bare step table and in-situ samples.

    The bare table (every length timed alone, one after another, after a fixed context) is
    not what a loop pays: BENCHMARKS 9v found its T(1) 1.5 ms dearer than the plain loop's
    steps and its 2-token verify 1.7 ms cheaper than the rounds' (which also return the aux
    hidden states a drafter reads). So:

    - ``T(1)`` is the trimmed mean of ``plain``, the one-token steps of a plain decode;
    - ``T(n)``, n >= 2, is the trimmed mean of ``verify[n]``, the verify forwards of n tokens
      timed inside the drafter's own decodes, where it has ``min_samples`` of them;
    - any other length is the table's price times the in-situ/table ratio of the measured
      lengths (1 when none is measured), so the shape over n still comes from the table.

    The result is made non-decreasing in n (:func:`monotone_fit`).
    """
    out = dict(table)
    if len(plain) >= min_samples:
        out[1] = trimmed_mean(plain)
    seen = {n: trimmed_mean(v) for n, v in verify.items() if n >= 2 and len(v) >= min_samples and n in table}
    ratios = [seen[n] / table[n] for n in seen if table[n] > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    for n in out:
        if n >= 2:
            out[n] = seen.get(n, table[n] * scale)
    return monotone_fit(out)


def paired_prices(decodes: Sequence[tuple[int, Sequence[float], Mapping[int, Sequence[float]]]],
                  min_samples: int = MIN_IN_SITU) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Pool the calibration decodes of one drafter, each scaled to a common ``T(1)``.

    ``decodes`` holds ``(k, propose-call seconds, {tokens verified: step seconds})`` per decode,
    whose one-token steps (``steps[1]``) were timed between its drafted rounds. A shared host's
    speed drifts between decodes seconds apart by more than the difference between a verify
    and a one-token step (BENCHMARKS 9x), and a speedup is a ratio of prices; so each decode's
    calls and steps are multiplied by ``level / T1_d``, ``T1_d`` the trimmed mean of its own
    one-token steps and ``level`` that of all decodes' together. A decode with fewer than
    ``min_samples`` one-token steps is pooled as measured.

    Returns ``({k: call seconds}, {n: step seconds})``, scaled.
    """
    ones = [t for _, _, steps in decodes for t in steps.get(1, [])]
    level = trimmed_mean(ones) if len(ones) >= min_samples else None
    calls: dict[int, list[float]] = {}
    pooled: dict[int, list[float]] = {}
    for k, times, steps in decodes:
        own = steps.get(1, [])
        f = level / trimmed_mean(own) if level is not None and len(own) >= min_samples else 1.0
        calls.setdefault(k, []).extend(f * t for t in times)
        for n, v in steps.items():
            pooled.setdefault(int(n), []).extend(f * t for t in v)
    return calls, pooled


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


