"""Packing captured samples into training rows for the TTT unroll.

A sample of T tokens x_0..x_{T-1} contributes T-1 positions t = 0..T-2: the
verifier state g_t (aux[t]) paired with the next token x_{t+1}, at rope position
t+1; the step-0 target is the verifier's distribution at t+1 (``last[t+1]``),
which predicts x_{t+2}. Positions count in the loss when x_{t+2} exists and is an
assistant token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    aux: torch.Tensor            # [1, L, A*Ht]
    input_ids: torch.Tensor      # [1, L]  x_{t+1}
    position_ids: torch.Tensor   # [1, L]  t+1, restarting per document
    doc: torch.Tensor            # [1, L]  document index within the row
    mask: torch.Tensor           # [1, L]  bool: x_{t+2} exists and is an assistant token
    next_tokens: torch.Tensor    # [1, L]  x_{t+2} (-1 where it does not exist)
    last: torch.Tensor           # [1, L, Ht] verifier lm_head input at t+1
    attn_mask: torch.Tensor      # [1, L, L] bool: causal within a document

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(**{k: v.to(device) for k, v in self.__dict__.items()})


def positions_of(sample: dict, max_positions: int) -> int:
    return min(sample["input_ids"].shape[0] - 1, max_positions)


def pack_rows(samples: list[dict], order: list[int], pack_tokens: int) -> list[list[int]]:
    """Greedy first-fit in the given order: rows of sample indices with <= pack_tokens positions."""
    rows: list[list[int]] = []
    used = 0
    for i in order:
        n = positions_of(samples[i], pack_tokens)
        if n < 1:
            continue
        if not rows or used + n > pack_tokens:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def collate(samples: list[dict], row: list[int], pack_tokens: int) -> PackedBatch:
    """Build one packed row (batch of 1) from the samples at ``row``."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in
                                            ("aux", "ids", "pos", "doc", "mask", "next", "last")}
    for d, i in enumerate(row):
        s = samples[i]
        x, lm = s["input_ids"], s["loss_mask"].bool()
        n = positions_of(s, pack_tokens)
        T = x.shape[0]
        t = torch.arange(n)
        has_next = t + 2 < T
        nxt = torch.full((n,), -1, dtype=torch.long)
        nxt[has_next] = x[t[has_next] + 2]
        msk = torch.zeros(n, dtype=torch.bool)
        msk[has_next] = lm[t[has_next] + 2]
        parts["aux"].append(s["aux"][:n])
        parts["ids"].append(x[1:n + 1])
        parts["pos"].append(t + 1)
        parts["doc"].append(torch.full((n,), d, dtype=torch.long))
        parts["mask"].append(msk)
        parts["next"].append(nxt)
        parts["last"].append(s["last"][1:n + 1])
    doc = torch.cat(parts["doc"])
    L = doc.shape[0]
    attn = (doc[:, None] == doc[None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    return PackedBatch(
        aux=torch.cat(parts["aux"])[None], input_ids=torch.cat(parts["ids"])[None],
        position_ids=torch.cat(parts["pos"])[None], doc=doc[None], mask=torch.cat(parts["mask"])[None],
        next_tokens=torch.cat(parts["next"])[None], last=torch.cat(parts["last"])[None], attn_mask=attn[None])
