"""The one logits -> probabilities transform, shared by drafts and verifier.

Rejection sampling is lossless only if the draft distribution q and the verifier
distribution p are produced by the *same* transform (temperature, then top-k, then
top-p). Both sides call :func:`logits_to_probs`; nothing else turns logits into
probabilities in draftsmith.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / T).
        top_k: keep only the k most likely tokens (None: all).
        top_p: keep the smallest set of tokens whose probability reaches p (None: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise DraftsmithError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise DraftsmithError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise DraftsmithError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into the sampling distribution ``[..., V]``.

    Greedy gives the one-hot of the argmax. Computation is in float32 (float64 stays
    float64, which the exactness tests use).
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    if params.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    x = x / params.temperature
    if params.top_k is not None and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # drop a token when the more likely ones before it already reach top_p
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs [..., V]`` -> ``[...]``."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
