"""Verification of a drafted chain: greedy prefix match and lossless rejection sampling.

Symbols follow Leviathan et al. (2023) / Chen et al. (2023): the drafter proposed
tokens d_1..d_k with distributions q_i; the verifier scored the same positions
with p_i, plus p_{k+1} after the last draft. Token d_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); the first rejection is replaced by a
sample from the residual norm(max(p_i - q_i, 0)); if all k are accepted a bonus
token is drawn from p_{k+1}. The emitted tokens are then distributed exactly as
if the verifier had sampled them one by one.
"""

from __future__ import annotations

import torch

from draftsmith.decoding.sampling import sample
from draftsmith.models.cpu_linear import argmax


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Greedy verification, on the logits' device (no host sync).

    Args:
        draft: ``[k]`` drafted token ids.
        target_logits: ``[k+1, V]`` verifier logits at the k+1 scored positions.

    Returns:
        ``[2]`` long tensor ``(n, token)``: the number of accepted drafts (longest prefix
        equal to the verifier's argmax) and the verifier's own token at position n+1.
    """
    target = argmax(target_logits)  # [k+1]
    k = draft.shape[0]
    n = (draft == target[:k]).long().cumprod(0).sum() if k else target.new_zeros(())
    return torch.stack([n, target[n]])


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """:func:`greedy_verify` as Python ints ``(n, token)``."""
    n, token = greedy_verify(draft, target_logits).tolist()
    return n, token


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) over the last dimension; falls back to p where p == q."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    # p == q exactly: a rejection has probability 0, any valid distribution will do.
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def rejection_verify(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                     generator: torch.Generator | None) -> torch.Tensor:
    """Speculative rejection sampling over one drafted chain, on ``p``'s device (no host sync).

    Args:
        draft: ``[k]`` drafted token ids.
        p: ``[k+1, V]`` verifier probabilities (after the shared transform).
        q: ``[k, V]`` draft probabilities (after the same transform), or None for a
            deterministic drafter, whose q is the one-hot of its proposal.
        generator: random source (seeded for reproducibility).

    Returns:
        ``[2]`` long tensor ``(n, token)``: accepted drafts and the next token (residual
        sample at the first rejection, or the bonus token from ``p[k]`` when all were accepted).
    """
    k = draft.shape[0]
    if not k:
        return torch.stack([torch.zeros((), dtype=torch.long, device=p.device), sample(p[0], generator)])
    idx = draft.unsqueeze(-1)  # [k, 1]
    p_d = p[:k].gather(-1, idx).squeeze(-1)  # [k]  p_i(d_i)
    q_k = torch.zeros_like(p[:k]).scatter_(-1, idx, 1.0) if q is None else q[:k]  # [k, V]
    q_d = q_k.gather(-1, idx).squeeze(-1)
    u = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    # u < p/q  <=>  u*q < p  (no division; q_d > 0 since d_i was drawn from q)
    n = (u * q_d < p_d).long().cumprod(0).sum()  # accepted drafts, on the device
    # Row i < k: the residual at a rejection at i; row k: the bonus distribution. Draw from row n:
    # one sample either way, chosen without reading n on the host.
    rows = torch.cat([residual_distribution(p[:k], q_k), p[k:k + 1]])  # [k+1, V]
    return torch.stack([n, sample(rows.index_select(0, n.reshape(1))[0], generator)])


def rejection_sample(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                     generator: torch.Generator | None) -> tuple[int, int]:
    """:func:`rejection_verify` as Python ints ``(n, token)``."""
    n, token = rejection_verify(draft, p, q, generator).tolist()
    return n, token
