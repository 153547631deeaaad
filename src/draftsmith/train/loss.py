"""Training-time-test loss: per-step forward KL to the verifier, step weights, accuracy.

Alignment (packed row, position p holds sample position t of some document):
step j at p fed x_{t+1+j} and predicts x_{t+2+j}; its target distribution is the
verifier's at t+1+j, restricted to the draft vocabulary and renormalised. All
step-j quantities are the step-0 ones shifted left by j, valid only while p+j
stays inside the same document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def shift_left(x: torch.Tensor, j: int, fill: float | int = 0) -> torch.Tensor:
    """x [B, L, ...] shifted left by j along dim 1, right-filled with ``fill``."""
    if j == 0:
        return x
    pad = torch.full_like(x[:, :j], fill)
    return torch.cat([x[:, j:], pad], dim=1)


def step_mask(mask: torch.Tensor, doc: torch.Tensor, j: int) -> torch.Tensor:
    """Validity of step j at every position: shifted mask within the same document."""
    same_doc = shift_left(doc, j, fill=-2) == doc
    return shift_left(mask, j) & same_doc


@dataclass
class StepStats:
    """Per-step loss sum, correct-prediction count and counted positions (for averaging)."""

    loss: list[float]
    correct: list[int]
    count: list[int]


def ttt_loss(step_logits: list[torch.Tensor], target_logits: torch.Tensor, next_tokens: torch.Tensor,
             mask: torch.Tensor, doc: torch.Tensor, draft_to_target: torch.Tensor,
             step_weights: list[float]) -> tuple[torch.Tensor, StepStats]:
    """Weighted sum over steps of the masked mean forward KL(p_verifier || q_draft).

    Args:
        step_logits: per step ``[B, L, Vd]`` draft logits.
        target_logits: ``[B, L, Vd]`` verifier logits (draft vocab rows) for step 0; no grad.
        next_tokens: ``[B, L]`` verifier token predicted at step 0 (x_{t+2}), for accuracy.
        mask: ``[B, L]`` bool, step-0 positions that count (predicted token is an assistant token).
        doc: ``[B, L]`` document id of every position (-1 for padding).
        draft_to_target: ``[Vd]`` verifier id of each draft id.
        step_weights: loss weight of each step.

    Returns:
        The scalar loss and per-step statistics (accuracy = draft argmax equals the
        verifier's token, i.e. greedy acceptance under teacher forcing).
    """
    Vd = target_logits.shape[-1]
    with torch.no_grad():  # the verifier side once for all steps: step j reads it at t + j
        lp = target_logits.float().log_softmax(-1).reshape(-1, Vd)
        p = lp.exp()
        p_log_p = (p * lp).sum(-1)  # KL(p || q) = sum p log p - sum p log q
    nxt = next_tokens.reshape(-1)
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    stats = StepStats([], [], [])
    for j, logits in enumerate(step_logits):
        # Valid positions as flat indices; a valid step-j position p has its target at p + j
        # in the same row (step_mask keeps p + j inside p's document).
        idx = step_mask(mask, doc, j).reshape(-1).nonzero().squeeze(1)
        n = idx.numel()
        stats.count.append(n)
        if n == 0:
            stats.loss.append(0.0)
            stats.correct.append(0)
            continue
        sel = logits.reshape(-1, Vd).index_select(0, idx)
        lq = sel.float().log_softmax(-1)  # [n, Vd]
        t = idx + j
        kl = p_log_p.index_select(0, t).sum() - (p.index_select(0, t) * lq).sum()
        total = total + step_weights[j] * kl / n
        with torch.no_grad():
            guess = draft_to_target[lq.argmax(-1)]
            stats.correct.append(int((guess == nxt.index_select(0, t)).sum()))
        stats.loss.append(float(kl.detach()))
    return total, stats
