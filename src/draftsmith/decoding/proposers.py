"""Drafters ("proposers") that suggest the next k tokens for the verifier to check.

A proposer declares what it needs from the verifier in its class attributes,
following transformers' ``CandidateGenerator`` idea: an EAGLE-3 draft sets
``requires_hidden_states = True`` and names the verifier layers it reads, and
the engine then hands it those hidden states from the verification forward it
already runs (no second verifier pass). Signatures never widen per drafter.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from draftsmith.decoding.sampling import SamplingParams, logits_to_probs, sample
from draftsmith.errors import DraftsmithError


@dataclass
class DraftContext:
    """What the engine shows a proposer before each round.

    Attributes:
        tokens: ``[T]`` prompt + generated tokens. The last one is the pending
            token: sampled, but not yet fed through the verifier.
        hidden_states: ``[m, A*H]`` for proposers with ``requires_hidden_states``:
            the verifier's hidden states (layers ``aux_layer_ids``, concatenated)
            at positions ``T-1-m .. T-2``, i.e. the positions verified since the
            previous call. Row j belongs to the position whose next token is
            ``tokens[T-m+j]``. None for other proposers.
    """

    tokens: torch.Tensor
    hidden_states: torch.Tensor | None = None


@dataclass
class Proposal:
    """Drafted tokens ``[k']`` (k' <= k, possibly 0) and their draft distributions.

    ``probs`` is ``[k', V]`` after the shared sampling transform, or None for a
    deterministic drafter (its q is the one-hot of the proposed token).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


class Proposer(abc.ABC):
    """Interface of every drafter the engine can use."""

    #: The engine must return the verifier's hidden states at ``aux_layer_ids``.
    requires_hidden_states: ClassVar[bool] = False
    #: Indices into the verifier's ``hidden_states`` tuple (0 = embeddings, i = output of layer i-1).
    aux_layer_ids: tuple[int, ...] = ()

    def reset(self) -> None:
        """Forget all per-sequence state; called once at the start of ``generate``."""

    def check_compatible(self, verifier: torch.nn.Module) -> None:
        """Raise :class:`DraftsmithError` if this drafter cannot serve ``verifier``."""

    @abc.abstractmethod
    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Draft up to ``k`` tokens continuing ``ctx.tokens``."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) and propose what followed it.

    Deterministic and model-free; pays off on inputs that repeat (code edits,
    summaries, quoting) and costs nothing when there is no match (0 drafts).

    With ``adaptive`` (the default) the draft length follows how the previous
    draft fared, because a rejected draft is not free: verifying k + 1 tokens
    costs more than one (about 2x at k = 10 for SmolLM2-135M on a CPU). After a
    draft whose first n tokens were accepted and the next rejected, at most
    n + 1 tokens are proposed; after a fully accepted draft the cap doubles, up
    to the ``k`` the engine asks for. The proposer reads the outcome from the
    context it is shown next, so the engine needs no feedback channel. With
    ``adaptive=False`` every match proposes k tokens (as transformers' prompt
    lookup does).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, adaptive: bool = True) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise DraftsmithError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram, self.adaptive = max_ngram, min_ngram, adaptive
        self.reset()

    def reset(self) -> None:
        self.cap: int | None = None  # adaptive draft-length cap; None: whatever k the engine asks
        self._last: tuple[int, torch.Tensor] | None = None  # (context length, draft) of the last proposal

    def _learn(self, tokens: torch.Tensor) -> None:
        """Update the cap from how many tokens of the last draft the context now continues with."""
        if self._last is None:
            return
        start, draft = self._last
        got = tokens[start: start + draft.shape[0]]
        m = got.shape[0]
        mismatch = (got != draft[:m]).nonzero()
        n = int(mismatch[0]) if mismatch.numel() else m
        if n >= draft.shape[0]:
            self.cap = None if self.cap is None else 2 * self.cap
        else:
            self.cap = n + 1
        self._last = None

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens = ctx.tokens
        T = tokens.shape[0]
        if self.adaptive:
            self._learn(tokens)
            if self.cap is not None and self.cap < k:
                k = self.cap
            else:
                self.cap = None  # grown back to (or past) what the engine asks: no cap
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            # windows[i] = tokens[i : i+n], for starts i whose continuation lies before the suffix
            windows = tokens[: T - 1].unfold(0, n, 1)  # [T-n, n]
            hits = (windows == tokens[T - n:]).all(-1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n  # latest occurrence
                draft = tokens[start: min(start + k, T)]
                if draft.numel():
                    if self.adaptive:
                        self._last = (T, draft.clone())
                    return Proposal(draft)
        return Proposal(tokens[:0])


class DraftModelProposer(Proposer):
    """A smaller causal LM sharing the verifier's tokenizer, with its own KV cache.

    The cache is rolled back lazily: before drafting, it is cropped to the longest
    prefix it shares with the current context, then the new context tokens are fed.
    """

    def __init__(self, draft_model: torch.nn.Module) -> None:
        self.model = draft_model.eval()
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.cache.activate_past_recording()  # sliding-window layers must keep what a rollback needs
        self.seen = torch.empty(0, dtype=torch.long)  # tokens whose keys/values are cached

    def check_compatible(self, verifier: torch.nn.Module) -> None:
        dv = self.model.get_output_embeddings().weight.shape[0]
        vv = verifier.get_output_embeddings().weight.shape[0]
        if dv != vv:
            raise DraftsmithError(
                f"draft model vocabulary ({dv}) differs from the verifier's ({vv}); "
                "a draft model must share the verifier's tokenizer")

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids[None], cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens = ctx.tokens
        seen = self.seen.to(tokens.device)
        m = min(seen.shape[0], tokens.shape[0] - 1)  # always re-feed at least the pending token
        diff = (seen[:m] != tokens[:m]).nonzero()
        keep = int(diff[0]) if diff.numel() else m
        if seen.shape[0] > keep:
            self.cache.crop(-(seen.shape[0] - keep))
        logits = self._forward(tokens[keep:])
        drafted, probs = [], []
        for i in range(k):
            q = logits_to_probs(logits, sampling)
            tok = q.argmax(-1) if sampling.greedy else sample(q, generator)
            drafted.append(tok)
            probs.append(q)
            if i + 1 < k:
                logits = self._forward(tok.reshape(1))
        draft = torch.stack(drafted)
        self.seen = torch.cat([tokens, draft[:-1]])
        return Proposal(draft, None if sampling.greedy else torch.stack(probs))
