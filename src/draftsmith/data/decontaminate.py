"""Decontamination: does a training conversation contain an evaluation prompt?

The rule is GPT-3's: a conversation leaks when one of its user or system turns
equals, after :func:`~draftsmith.data.conversation.normalize_text`, a reference
text of an evaluation set, or shares a run of :data:`LEAK_NGRAM` words with one
(which catches prompts pasted into longer requests). This module only matches
texts; which sets are held out is the dataset registry's business
(:func:`draftsmith.data.sources.remove_eval_overlap`).
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple

from draftsmith.data.conversation import Conversation, normalize_text

LEAK_NGRAM = 13  # shared word run that counts as an evaluation leak (GPT-3 decontamination)
_WORD = re.compile(r"\w+")


def _ngrams(text: str, n: int) -> set[int]:
    words = _WORD.findall(text.casefold())
    return {hash(tuple(words[i:i + n])) for i in range(len(words) - n + 1)}


class ReferenceIndex(NamedTuple):
    """Evaluation texts as :func:`leaks` matches them: normalised texts and word n-gram hashes."""

    exact: frozenset[str]
    grams: frozenset[int]
    ngram: int


def reference_index(conversations: Iterable[Conversation], ngram: int = LEAK_NGRAM) -> ReferenceIndex:
    """The index of every user turn and ``meta["reference_texts"]`` entry of ``conversations``.

    ``ngram=0`` keeps only the exact rule.
    """
    exact: set[str] = set()
    grams: set[int] = set()
    for conv in conversations:
        for text in conv.user_texts() + list(conv.meta.get("reference_texts", [])):
            exact.add(normalize_text(text))
            if ngram:
                grams |= _ngrams(text, ngram)
    return ReferenceIndex(frozenset(exact), frozenset(grams), ngram)


def leaks(conv: Conversation, index: ReferenceIndex) -> bool:
    """Whether a user or system turn of ``conv`` matches a text of ``index`` (the module's rule)."""
    for m in conv.messages:
        if m["role"] == "assistant":
            continue
        if normalize_text(m["content"]) in index.exact:
            return True
        if index.ngram and index.grams and not index.grams.isdisjoint(_ngrams(m["content"], index.ngram)):
            return True
    return False


def remove_overlap(conversations: Iterable[Conversation], index: ReferenceIndex) -> tuple[list[Conversation], int]:
    """``(kept, number_removed)``: the conversations that do not leak a text of ``index``."""
    kept, removed = [], 0
    for conv in conversations:
        if leaks(conv, index):
            removed += 1
        else:
            kept.append(conv)
    return kept, removed
