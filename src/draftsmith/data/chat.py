"""Turning text into verifier token ids (chat template or raw)."""

from __future__ import annotations

from draftsmith.errors import DraftsmithError


#: What the data steps say to a verifier without a chat template (a base model's tokenizer).
NO_TEMPLATE = ("the verifier's tokenizer has no chat template (a base model?): draftsmith's data steps render "
               "conversations with it to regenerate replies and to mark what to train on; use its chat (instruct) "
               "version, or give the tokenizer a template (`chat_template` in tokenizer_config.json)")


def check_chat_template(tokenizer: object) -> None:
    """Raise :data:`NO_TEMPLATE` where the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError(NO_TEMPLATE)


def encode_chat(tokenizer: object, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    check_chat_template(tokenizer)
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=True)
    return list(enc["input_ids"])


def encode_prompt(tokenizer: object, text: str, chat: bool = False) -> list[int]:
    """Token ids of a single prompt: a user turn with ``chat``, raw text otherwise."""
    if not text:
        raise DraftsmithError("--prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise DraftsmithError("--chat: the verifier's tokenizer has no chat template; drop --chat or use a chat "
                                  "model")
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text)["input_ids"])
