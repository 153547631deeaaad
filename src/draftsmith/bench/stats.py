"""Statistics of paired measurements: summaries, per-prompt ratios, bootstrap intervals."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np


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


def pooled_ratio(numerator: Sequence[tuple[float, float]], denominator: Sequence[tuple[float, float]]) -> float:
    """Ratio of two rows' pooled throughputs over the same prompts, from ``(tokens, seconds)`` per prompt:
    ``(sum tokens / sum seconds)`` of the numerator over that of the denominator.

    Prompts weigh by their time, as total time over a whole set of prompts does. This is what a
    cost model built from pooled acceptance and mean step prices predicts, where the median of
    :func:`paired_ratios` is the robust summary of per-prompt effects (and moves with each prompt's
    own drift: several percent apart from this on a shared host, BENCHMARKS.md 9x).
    """
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"a pooled ratio needs equal, non-empty lengths, got {len(numerator)} and {len(denominator)}")
    rate = [sum(t for t, _ in side) / sum(s for _, s in side) for side in (numerator, denominator)]
    return rate[0] / rate[1]


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


