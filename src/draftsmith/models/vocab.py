"""Draft vocabulary: the verifier tokens the draft can propose.

EAGLE-3 drafts predict over a reduced vocabulary (the most frequent tokens in the
verifier's own responses), which makes the draft's lm_head, its dominant cost,
several times cheaper. Draft id i maps to verifier id ``i + d2t[i]``.
"""

from __future__ import annotations

from typing import Iterable

import torch

from draftsmith.errors import DraftsmithError


def token_counts(samples: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """Frequencies ``[V]`` of verifier tokens on loss-masked (assistant) positions."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = s["input_ids"][s["loss_mask"].bool()]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise DraftsmithError(f"token id {int(ids.max())} outside the verifier vocabulary ({vocab_size})")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent ids (ties: lower id first), sorted ascending.

    When fewer ids occur than the draft vocabulary holds, the rest is filled with
    the lowest unseen ids, so the size is always exact (speculators does the same).
    """
    V = counts.shape[0]
    if not 1 <= draft_vocab_size <= V:
        raise DraftsmithError(f"--draft-vocab-size must be in [1, {V}], got {draft_vocab_size}")
    if int(counts.sum()) == 0:
        raise DraftsmithError("no loss-masked tokens to build a draft vocabulary from (no assistant turns?)")
    # stable sort on -count keeps lower ids first among equal counts
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def coverage(counts: torch.Tensor, selected: torch.Tensor) -> float:
    """Fraction of counted tokens that the selected vocabulary contains."""
    total = int(counts.sum())
    return float(counts[selected].sum()) / total if total else 0.0


def grow_vocab(counts: torch.Tensor, keep: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """``keep`` (sorted verifier ids) plus the most frequent ids it lacks, ``draft_vocab_size`` in all.

    For a warm-started draft: the tokens it already predicts stay, and the new data decides
    which tokens join (ties and unseen fill as in :func:`select_vocab`).

    Raises:
        DraftsmithError: the new size is smaller than ``keep``.
    """
    if draft_vocab_size < keep.numel():
        raise DraftsmithError(f"--draft-vocab-size {draft_vocab_size} is smaller than the draft's vocabulary "
                              f"({keep.numel()}); a vocabulary can only be extended")
    boosted = counts.clone()
    boosted[keep.to(counts.device)] = int(counts.sum()) + 1  # above every count: kept ids rank first
    return select_vocab(boosted, draft_vocab_size)
