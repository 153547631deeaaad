"""A draft model whose tokenizer is not the verifier's: text is the common ground.

Universal Assisted Generation (transformers' ``AssistedCandidateGeneratorDifferentTokenizers``)
in the shape of a draftsmith :class:`~draftsmith.decoding.proposers.Proposer`. Each round:

1. The verifier's context (prompt + accepted tokens + the pending token) is decoded to text
   and encoded with the draft's tokenizer. The draft's KV cache keeps the longest prefix it
   shares with those ids (rolled back by index) and is fed the rest.
2. The draft drafts greedily, about as many of its tokens as k verifier tokens span in this
   context; the new tokens are decoded to text D.
3. D becomes verifier tokens: the context's last few tokens decode to text P, and the
   proposal is ``enc(P + D)`` with its prefix ``enc(P)`` removed. When D does not start on
   a token boundary of the verifier's (it finishes the context's last word, which the
   verifier has already cut into tokens), D is encoded alone.
4. The verifier checks the proposal as any other draft (at most k tokens). Accepted text
   reaches the draft through step 1 of the next round.

Why it is lossless: the proposal is a deterministic function of the context (the draft
drafts greedily whatever the temperature), so the draft distribution q is the one-hot of
the proposal, exactly as for the n-gram drafter. Greedy output is the verifier's own, and
with sampling, rejection sampling with one-hot q keeps the verifier's distribution exactly
(a token d is accepted with probability p(d); a rejection samples from p without d). The
price under sampling is acceptance: p(d) rather than min(1, p(d)/q(d)) of a sampled draft.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from draftsmith.decoding.proposers import DraftContext, Proposal, Proposer
from draftsmith.decoding.runner import VerifierRunner
from draftsmith.decoding.sampling import SamplingParams
from draftsmith.errors import DraftsmithError
from draftsmith.models.quantize import output_vocab_size

_DECODE = {"clean_up_tokenization_spaces": False}


def _stop_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


class CrossTokenizerProposer(Proposer):
    """A smaller causal LM with its own tokenizer, drafting for a verifier through text.

    Args:
        draft_model: the draft (any causal LM the runner can run).
        draft_tokenizer: the draft's tokenizer.
        verifier_tokenizer: the verifier's tokenizer (its token ids are what the engine shows and takes).
        lookbehind: verifier tokens of context re-encoded with the draft's text (step 3).

    Attributes:
        rounds, empty, unaligned: propose calls, calls that proposed nothing, and calls whose
            draft text was encoded alone (step 3's fallback); reset per sequence.
    """

    def __init__(self, draft_model: torch.nn.Module, draft_tokenizer: Any, verifier_tokenizer: Any,
                 lookbehind: int = 8) -> None:
        if lookbehind < 1:
            raise DraftsmithError(f"lookbehind must be >= 1, got {lookbehind}")
        self.model = draft_model.eval()
        self.dtok, self.vtok, self.lookbehind = draft_tokenizer, verifier_tokenizer, lookbehind
        self.stop = _stop_ids(draft_model, draft_tokenizer)  # the draft ending its text: draft no further
        self.runner: VerifierRunner | None = None
        self.reset()

    def reset(self) -> None:
        if self.runner is not None:
            self.runner.rollback(0)
        self.seen: list[int] = []  # draft tokens whose keys/values are cached
        self.rounds = self.empty = self.unaligned = 0

    def prepare(self, max_length: int, compile: bool = False, num_draft_tokens: int = 1) -> None:
        from draftsmith.decoding.runner import verifier_runner

        if self.runner is not None:
            self.runner.close()
        # The draft cuts the same text into a different number of tokens: room for twice the
        # verifier's, grown in place if a text needs more (eager runners only).
        self.runner = verifier_runner(self.model, 2 * max_length + 16, compile=compile, warmup_shapes=(1,),
                                      role="draft")
        self.compile_seconds = self.runner.compile_seconds

    def check_compatible(self, verifier: torch.nn.Module) -> None:
        vocab = output_vocab_size(verifier)
        if len(self.vtok) > vocab:
            raise DraftsmithError(f"the verifier tokenizer given to the cross-tokenizer draft has {len(self.vtok)} "
                                  f"tokens but the verifier's output head {vocab}: not this verifier's tokenizer")

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        self.rounds += 1
        context = ctx.tokens.tolist()
        # Step 1: the context as the draft reads it (its own BOS where its tokenizer adds one).
        text = self.vtok.decode(context, skip_special_tokens=True, **_DECODE)
        ids = self.dtok(text)["input_ids"]
        drafted: list[int] = []
        if ids:
            # Step 2: about k verifier tokens' worth of draft tokens, at this context's ratio.
            n = min(2 * k, max(1, math.ceil(k * len(ids) / len(context))))
            drafted = self._draft(ids, n)
        # The draft's last token may end inside a multi-byte character: drop the half character.
        draft_text = self.dtok.decode(drafted, skip_special_tokens=True, **_DECODE).rstrip("\ufffd")
        new = self._to_verifier(context, draft_text)[:k]
        if not new:
            self.empty += 1
        return Proposal(torch.tensor(new, dtype=torch.long, device=ctx.tokens.device))

    def _draft(self, ids: list[int], n: int) -> list[int]:
        """Feed the draft ``ids`` (reusing its cache's common prefix) and draft up to ``n`` tokens greedily."""
        if self.runner is None:  # not prepared: a cache that grows as needed
            self.prepare(len(ids) + n)
        runner = self.runner
        device = next(self.model.parameters()).device
        m = min(len(self.seen), len(ids) - 1)  # always re-feed at least the last token: its logits are needed
        keep = next((i for i in range(m) if self.seen[i] != ids[i]), m)
        runner.rollback(min(keep, runner.length))
        runner.reserve(len(ids) + n)
        logits = runner.forward(torch.tensor(ids[keep:], dtype=torch.long, device=device), 1)[0][-1]
        out: list[int] = []
        for i in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            if tok in self.stop or i + 1 == n:
                break
            logits = runner.forward(torch.tensor([tok], dtype=torch.long, device=device), 1)[0][-1]
        self.seen = ids + out[:-1]  # the last drafted token was never fed
        return out[:-1] if out and out[-1] in self.stop else out

    def _to_verifier(self, context: list[int], draft_text: str) -> list[int]:
        """Step 3: verifier tokens that continue ``context`` with ``draft_text``."""
        if not draft_text:
            return []
        # P keeps special tokens as text: encoding parses them back into the same ids.
        tail = self.vtok.decode(context[-self.lookbehind:], skip_special_tokens=False, **_DECODE)
        before = self.vtok.encode(tail, add_special_tokens=False)
        after = self.vtok.encode(tail + draft_text, add_special_tokens=False)
        if after[:len(before)] == before:
            return after[len(before):]
        self.unaligned += 1
        return self.vtok.encode(draft_text, add_special_tokens=False)
