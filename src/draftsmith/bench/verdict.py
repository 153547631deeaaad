"""Lossless verdicts that hold in low precision: identical, diverged at a numerical tie, or mismatch.

In float32 greedy speculative decoding reproduces plain greedy decoding token for
token. In bfloat16 (GPUs, AMX CPUs, serving engines) it does not quite: a verifier
forward over k+1 tokens rounds differently from k+1 one-token forwards, so where
two tokens' logits are closer than the arithmetic can resolve, the argmax may
flip and the two outputs part. That is not a bug, and the field (vLLM, SGLang,
llama.cpp) calls such outputs identical up to ties. Anything else is a bug.

The test: at the first position where the candidate output leaves the reference,
score the shared prefix once more with the verifier in the run's dtype and look at
the two tokens' logits there. The divergence is a *tie* when both tokens are within
``tol`` of the top logit: the run's own arithmetic cannot tell them apart, and
either path may round to either. Otherwise it is a *mismatch*: a token was emitted
that the verifier, at the run's precision, clearly does not choose. The prefix is
scored again in float32 too, and that margin is recorded; it does not decide,
because a bfloat16 model is not its float32 original (its weights are rounded too),
so its near-ties sit elsewhere.

The tolerance is derived from the dtype: ``tol = TIE_ULPS * ulp(dtype, |top logit|)``
where ``ulp`` is the spacing of representable numbers at the top logit's magnitude
(``2**(floor(log2 |x|) - mantissa_bits)``; mantissa bits: bfloat16 7, float16 10,
float32 23). One ulp is what the final rounding of a logit alone can move it; the
rest of the budget covers rounding carried through the layers, which is measured
by ``benchmarks/tie_tolerance.py`` (BENCHMARKS.md). In float32, 4 ulps at logit 25
is 8e-6: a divergence there is, in practice, always a mismatch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Literal, Sequence

import torch

TIE_ULPS = 4.0
_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}

Kind = Literal["identical", "tie", "mismatch"]
#: token ids -> float logits ``[V]`` at the last position (a fresh forward, no cache)
Scorer = Callable[[Sequence[int]], torch.Tensor]


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """Spacing of ``dtype``'s representable numbers at ``magnitude`` (normal range)."""
    if dtype not in _MANTISSA_BITS:
        raise ValueError(f"no tie tolerance for dtype {dtype}")
    exponent = math.floor(math.log2(max(abs(magnitude), 1e-30)))
    return 2.0 ** (exponent - _MANTISSA_BITS[dtype])


def tie_tolerance(dtype: torch.dtype, top_logit: float, ulps: float = TIE_ULPS) -> float:
    """Largest logit gap that ``dtype``'s rounding can explain at ``top_logit``."""
    return ulps * ulp(dtype, max(abs(top_logit), 1.0))


@dataclass
class OutputVerdict:
    """How a candidate output compares with the reference (plain decoding) on one prompt.

    Attributes:
        kind: identical | tie | mismatch.
        position: index (into the new tokens) of the first difference; None when identical.
        reference_token: the reference's token there (None past its end).
        candidate_token: the candidate's token there (None past its end).
        margin: ``|logit(ref) - logit(cand)|`` rescored in the run's dtype.
        gap: how far the lower of the two sits below the top logit, in the run's dtype.
        margin_float32: ``|logit(ref) - logit(cand)|`` rescored in float32 (information only).
        tolerance: the tie tolerance used (logit units).
        reason: one line saying why it is a mismatch (empty otherwise).
    """

    kind: Kind
    position: int | None = None
    reference_token: int | None = None
    candidate_token: int | None = None
    margin: float | None = None
    gap: float | None = None
    margin_float32: float | None = None
    tolerance: float | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_difference(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first token where the two differ (or where one ends); None when equal."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def compare_outputs(prompt: Sequence[int], reference: Sequence[int], candidate: Sequence[int], *,
                    score: Scorer, dtype: torch.dtype, score_float32: Scorer | None = None,
                    ulps: float = TIE_ULPS) -> OutputVerdict:
    """Classify a candidate greedy output against the reference greedy output.

    Args:
        prompt: prompt token ids (shared by both).
        reference: new tokens of plain decoding.
        candidate: new tokens of the decoding under test (speculative, an engine, ...).
        score: the verifier in the run's dtype: ids -> logits at the last position.
        dtype: the run's dtype; sets the tolerance.
        score_float32: the verifier in float32 (None: ``score`` is already float32).
        ulps: tolerance in units of the dtype's spacing at the top logit.

    Returns:
        The verdict; only the first divergence is judged (after it, the two
        outputs continue from different contexts).
    """
    i = first_difference(reference, candidate)
    if i is None:
        return OutputVerdict("identical")
    ref = reference[i] if i < len(reference) else None
    cand = candidate[i] if i < len(candidate) else None
    if ref is None or cand is None:
        # Same tokens up to where one stopped: one of them ran past a stop token or
        # stopped early. Rounding cannot do that; a tie needs two different tokens.
        return OutputVerdict("mismatch", i, ref, cand,
                             reason=f"one output stops at token {i} and the other goes on with the same prefix")
    prefix = list(prompt) + list(reference[:i])
    with torch.inference_mode():
        logits = score(prefix).float()
        logits32 = (score_float32 or score)(prefix).float()
    top = float(logits.max())
    tol = tie_tolerance(dtype, top, ulps)
    la, lb = float(logits[ref]), float(logits[cand])
    margin, gap = abs(la - lb), top - min(la, lb)
    margin32 = abs(float(logits32[ref]) - float(logits32[cand]))
    verdict = OutputVerdict("tie", i, ref, cand, margin, gap, margin32, tol)
    if gap > tol:
        verdict.kind = "mismatch"
        verdict.reason = (f"token {i}: the {'candidate' if lb < la else 'reference'}'s token sits {gap:.3g} below "
                          f"the top logit, beyond the {tol:.3g} that {str(dtype).removeprefix('torch.')} rounding "
                          "explains")
    return verdict


def model_scorer(model: torch.nn.Module) -> Scorer:
    """A :data:`Scorer` for a transformers causal LM: one fresh forward, last position's logits."""
    device = next(model.parameters()).device

    def score(ids: Sequence[int]) -> torch.Tensor:
        x = torch.as_tensor(list(ids), dtype=torch.long, device=device)[None]
        return model(input_ids=x, use_cache=False, logits_to_keep=1).logits[0, -1]

    return score


def count_kinds(verdicts: Sequence[OutputVerdict]) -> dict[str, int]:
    """``{"identical": n, "tie": n, "mismatch": n}``."""
    out = {"identical": 0, "tie": 0, "mismatch": 0}
    for v in verdicts:
        out[v.kind] += 1
    return out
