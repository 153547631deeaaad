"""Turning text into verifier token ids (chat template or raw)."""

from __future__ import annotations

from draftsmith.errors import DraftsmithError


def encode_chat(tokenizer: object, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError("the verifier's tokenizer has no chat template; drop --chat or use a chat model")
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=True)
    return list(enc["input_ids"])


def encode_prompt(tokenizer: object, text: str, chat: bool = False) -> list[int]:
    """Token ids of a single prompt: a user turn with ``chat``, raw text otherwise."""
    if not text:
        raise DraftsmithError("--prompt is empty")
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text)["input_ids"])
