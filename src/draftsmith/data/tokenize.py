"""Token ids of conversations in the verifier's chat template, and the loss mask on its replies.

:func:`tokenize_conversation` turns a conversation into token ids and a loss mask
that is 1 exactly on what the assistant says (its content and its end-of-turn
token), never on the template's headers. :func:`encode_prompts` templates the
prompts the verifier answers.

Long inputs, explicitly: :func:`tokenize_conversations` takes ``overflow`` =
``truncate`` (keep the start) / ``drop`` / ``error``, and drops (counting) a
sample whose prompt alone fills the context; :func:`encode_prompts` drops
prompts that leave no room to generate, with a count, or raises (``on_long="error"``),
so an evaluation set never shrinks silently.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, NamedTuple

from draftsmith.data.chat import check_chat_template, encode_chat, encode_prompt
from draftsmith.data.conversation import Conversation, Message
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

OVERFLOW_POLICIES = ("truncate", "drop", "error")


class TokenizedConversation(NamedTuple):
    """Token ids of a rendered conversation and its loss mask (1 on assistant tokens)."""

    input_ids: list[int]
    loss_mask: list[int]


class TooLong(DraftsmithError):
    """A sample does not fit the context (raised under the ``drop``/``error`` policies)."""


def render_chat(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = False) -> str:
    """``messages`` rendered as text by the verifier's chat template.

    Raises:
        DraftsmithError: the template rejects the conversation (e.g. its role order).
    """
    import jinja2

    check_chat_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.exceptions.TemplateError as e:  # the template's own raise_exception, e.g. role order
        raise DraftsmithError(f"the verifier's chat template rejects the conversation: {e}") from e


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of already rendered ``text``, without adding special tokens."""
    # The rendered template already holds BOS etc.; apply_chat_template tokenizes the same way.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _assistant_spans(tokenizer: Any, messages: list[Message]) -> tuple[str, list[tuple[int, int, int]]]:
    """The full rendering and, per assistant turn, ``(start, content_end, turn_end)`` character offsets.

    ``start`` is the end of the generation prompt (the assistant header);
    ``content_end`` the end of the assistant's content; ``turn_end`` the end of
    the turn as rendered (end-of-turn token and separators). Found by rendering
    prefixes of the conversation, which works for any template whose rendering of
    a prefix is a prefix of the full rendering.
    """
    full = render_chat(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        turn = render_chat(tokenizer, messages[:i + 1])
        if not (turn.startswith(head) and full.startswith(turn)):
            raise DraftsmithError(
                "the verifier's chat template renders earlier turns differently once later turns follow "
                f"(assistant turn {i}); cannot place the loss mask: train on single-turn conversations "
                "(prompt + one reply), e.g. the regenerated ones")
        body = turn[len(head):]
        # Templates may trim the content; its last occurrence in the body ends the reply.
        content = m["content"].strip()
        at = body.rfind(content) if content else -1
        if at < 0:
            raise DraftsmithError(f"the verifier's chat template rewrites assistant turn {i}'s content; "
                                  "cannot place the loss mask")
        spans.append((len(head), len(head) + at + len(content), len(turn)))
    return full, spans


def _end_of_turn(ids: list[int], special: set[int]) -> int:
    """How many leading tokens of a turn's tail the assistant produces: up to the first special token."""
    for j, t in enumerate(ids):
        if t in special:
            return j + 1
    return len(ids)  # no end-of-turn token: the template's separator is what ends the reply


def _mask_by_segments(tokenizer: Any, full: str, spans: list[tuple[int, int, int]],
                      special: set[int]) -> TokenizedConversation:
    """Tokenize the text between span boundaries separately, as prompt + generation would."""
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for start, content_end, turn_end in spans:
        pre = text_ids(tokenizer, full[cursor:start])
        reply = text_ids(tokenizer, full[start:content_end])
        tail = text_ids(tokenizer, full[content_end:turn_end])
        k = _end_of_turn(tail, special)
        ids += pre + reply + tail
        mask += [0] * len(pre) + [1] * len(reply) + [1] * k + [0] * (len(tail) - k)
        cursor = turn_end
    rest = text_ids(tokenizer, full[cursor:])
    return TokenizedConversation(ids + rest, mask + [0] * len(rest))


def _mask_by_offsets(tokenizer: Any, full: str, spans: list[tuple[int, int, int]],
                     special: set[int]) -> TokenizedConversation:
    """Tokenize the full rendering once; a token is the assistant's if it starts inside a reply."""
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError) as e:
        raise DraftsmithError("the verifier's tokenizer splits text differently in pieces and has no "
                              "character offsets (not a fast tokenizer); cannot place the loss mask") from e
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    for start, content_end, turn_end in spans:
        ended = False
        for j, (a, _) in enumerate(enc["offset_mapping"]):
            if start <= a < content_end:
                mask[j] = 1
            elif content_end <= a < turn_end and not ended:
                mask[j] = 1
                ended = ids[j] in special
    return TokenizedConversation(ids, mask)


def tokenize_conversation(tokenizer: Any, messages: list[Message], max_length: int | None = None,
                          truncate: bool = True) -> TokenizedConversation:
    """Token ids of ``messages`` in the verifier's chat template, with the assistant loss mask.

    ``loss_mask[j] == 1`` exactly on the tokens the assistant produces: each
    reply's content and the end-of-turn token that closes it (``<|im_end|>`` in
    ChatML), not the ``<|im_start|>assistant\\n`` header nor what follows the
    end-of-turn token. The text is tokenized piecewise at turn boundaries, so the
    prompt part is token-for-token what :func:`~draftsmith.data.chat.encode_chat`
    gives and each reply is what the verifier would generate after it; when a
    tokenizer cannot be cut that way losslessly, the full rendering is tokenized
    once and tokens are assigned by character offsets.

    Args:
        tokenizer: the verifier's tokenizer (with a chat template).
        messages: normalised messages with at least one assistant turn.
        max_length: context limit in tokens; ``None`` = no limit.
        truncate: over ``max_length``, keep the first ``max_length`` tokens
            (``True``) or raise :class:`TooLong` (``False``).

    Raises:
        TooLong: the prompt before the first reply fills the context, or the sample
            is too long and ``truncate`` is off.
        DraftsmithError: no assistant turn, no chat template, unusable template.
    """
    check_chat_template(tokenizer)
    if not any(m["role"] == "assistant" for m in messages):
        raise DraftsmithError("conversation has no assistant turn: nothing to train on (regenerate replies "
                              "with the verifier first)")
    full, spans = _assistant_spans(tokenizer, messages)
    special = _special_ids(tokenizer)
    sample = _mask_by_segments(tokenizer, full, spans, special)
    reference = text_ids(tokenizer, full)
    if sample.input_ids != reference:
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False,  # noqa: E731
                                              clean_up_tokenization_spaces=False)
        # Same text, other token boundaries (e.g. "\n\n" merged across the header): keep the pieces,
        # they are what prompt + generation produce. Different text (e.g. a prefix space added to
        # every piece): fall back to one tokenization and character offsets.
        if decode(sample.input_ids) != decode(reference):
            sample = _mask_by_offsets(tokenizer, full, spans, special)
    return fit(sample, max_length, truncate)


def fit(sample: TokenizedConversation, max_length: int | None, truncate: bool) -> TokenizedConversation:
    """Apply the context limit: keep the start, or raise :class:`TooLong`."""
    if max_length is None or len(sample.input_ids) <= max_length:
        return sample
    first = sample.loss_mask.index(1) if 1 in sample.loss_mask else len(sample.loss_mask)
    if first >= max_length:
        raise TooLong(f"prompt of {first} tokens leaves no room for a reply in the context of "
                      f"{max_length} tokens")
    if not truncate:
        raise TooLong(f"conversation of {len(sample.input_ids)} tokens exceeds the context of "
                      f"{max_length} tokens")
    return TokenizedConversation(sample.input_ids[:max_length], sample.loss_mask[:max_length])


def tokenize_conversations(tokenizer: Any, conversations: Iterable[Conversation], max_length: int | None = None,
                           overflow: str = "truncate") -> tuple[list[TokenizedConversation], dict[str, int]]:
    """Tokenize many conversations for training, applying one explicit overflow policy.

    Args:
        tokenizer: the verifier's tokenizer.
        conversations: conversations with assistant turns (e.g. regenerated ones).
        max_length: context limit in tokens.
        overflow: samples longer than ``max_length``: ``truncate`` (keep the start),
            ``drop`` (skip and count) or ``error`` (raise). Under ``truncate`` and
            ``drop``, a sample whose prompt alone fills the context is dropped and
            counted; under ``error`` it raises.

    Returns:
        ``(samples, counts)`` with counts ``kept``, ``truncated``, ``dropped_too_long``,
        ``dropped_no_reply``.

    Raises:
        DraftsmithError: bad policy, no conversation with an assistant turn, or none kept.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise DraftsmithError(f"unknown overflow policy {overflow!r}; use one of {', '.join(OVERFLOW_POLICIES)}")
    counts = {"kept": 0, "truncated": 0, "dropped_too_long": 0, "dropped_no_reply": 0}
    samples = []
    n = 0
    for n, conv in enumerate(conversations, start=1):
        if not conv.has_assistant:
            counts["dropped_no_reply"] += 1
            continue
        full = tokenize_conversation(tokenizer, conv.messages)
        try:
            s = fit(full, max_length, truncate=overflow == "truncate")
        except TooLong as e:
            if overflow == "error":
                raise TooLong(f"conversation {conv.id!r}: {e}; use overflow 'truncate' or 'drop'") from e
            counts["dropped_too_long"] += 1
            continue
        counts["truncated"] += len(s.input_ids) < len(full.input_ids)
        samples.append(s)
    counts["kept"] = len(samples)
    if n and counts["dropped_no_reply"] == n:
        raise DraftsmithError("no conversation has an assistant turn: nothing to train on (regenerate replies "
                              "with the verifier first)")
    if not samples:
        raise DraftsmithError(f"no training samples: {counts['dropped_too_long']} of {n} conversations do not fit "
                              f"the context of {max_length} tokens" if n else "no conversations to tokenize")
    if counts["dropped_too_long"] or counts["truncated"]:
        log.warning("tokenize: %d truncated, %d dropped as longer than %s tokens",
                    counts["truncated"], counts["dropped_too_long"], max_length)
    return samples, counts


class PromptIds(NamedTuple):
    """A conversation and the token ids of its chat-templated prompt (generation prompt included)."""

    conversation: Conversation
    input_ids: list[int]


def encode_prompts(tokenizer: Any, conversations: Iterable[Conversation], max_length: int | None = None,
                   on_long: str = "drop") -> list[PromptIds]:
    """Chat-template each conversation's prompt (:meth:`Conversation.prompt_messages`) for generation.

    A tokenizer without a chat template (a base model) gets the raw user text instead.

    Args:
        tokenizer: the verifier's tokenizer.
        conversations: the conversations to prompt.
        max_length: prompts must be *shorter* than this (room for at least one new token).
        on_long: a prompt that does not fit: ``drop`` (log the count) or ``error``.

    Raises:
        TooLong: a prompt does not fit and ``on_long="error"``.
        DraftsmithError: every prompt was dropped.
    """
    if on_long not in ("drop", "error"):
        raise DraftsmithError(f"unknown policy {on_long!r} for long prompts; use 'drop' or 'error'")
    out, dropped = [], 0
    chat = bool(getattr(tokenizer, "chat_template", None))
    if not chat:
        log.warning("the tokenizer has no chat template: prompts are the raw text of their user turns")
    for conv in conversations:
        if chat:
            ids = encode_chat(tokenizer, conv.prompt_messages(), add_generation_prompt=True)
        else:  # a base model: the user text as it is
            ids = encode_prompt(tokenizer, "\n\n".join(m["content"] for m in conv.prompt_messages()
                                                       if m["role"] != "system"))
        if max_length is not None and len(ids) >= max_length:
            if on_long == "error":
                raise TooLong(f"prompt {conv.id!r} of {conv.source} has {len(ids)} tokens; the context is "
                              f"{max_length} tokens")
            dropped += 1
            continue
        out.append(PromptIds(conv, ids))
    if dropped:
        log.warning("dropped %d prompts longer than the context of %d tokens", dropped, max_length)
        if not out:
            raise DraftsmithError(f"all {dropped} prompts are longer than the context of {max_length} tokens")
    return out

