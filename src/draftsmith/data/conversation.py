"""Conversations: the one record type every prompt source yields, normalised and validated.

A :class:`Conversation` is a list of ``{"role", "content"}`` messages with roles
``system``/``user``/``assistant``. :func:`record_to_conversation` turns any supported
record shape (OpenAI messages, ShareGPT, prompt/response, MT-Bench turns) into one;
:func:`normalize_text` and :func:`prompt_key` give the identity used to split,
dedupe and decontaminate prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from draftsmith.errors import DraftsmithError

Message = dict[str, str]

# Role spellings seen in the wild (ShareGPT, OpenAI, Gemma, OASST) -> the three roles templates know.
_ROLES = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant", "bot": "assistant",
    "system": "system",
}


@dataclass
class Conversation:
    """One normalised conversation.

    Attributes:
        messages: ``{"role", "content"}`` dicts; roles are ``system``, ``user``, ``assistant``.
        id: the record's id in its source (or ``file:line``).
        source: the dataset name or path it came from.
        meta: source-specific extras (e.g. MT-Bench ``category``, HumanEval ``task_id``).
    """

    messages: list[Message]
    id: str = ""
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def prompt_messages(self) -> list[Message]:
        """The messages before the first assistant turn: what the verifier answers when regenerating.

        Multi-turn conversations are cut after their first user turn(s): later user
        turns answer the *original* assistant reply, which regeneration replaces,
        so they would no longer make sense.
        """
        out = []
        for m in self.messages:
            if m["role"] == "assistant":
                break
            out.append(m)
        return out

    @property
    def has_assistant(self) -> bool:
        """Whether any turn is the assistant's (needed to train without regeneration)."""
        return any(m["role"] == "assistant" for m in self.messages)

    def user_texts(self) -> list[str]:
        """Contents of every user turn, in order."""
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready ``{"id", "messages", "meta"}`` dict; a JSONL file of these loads back unchanged."""
        return {"id": self.id, "messages": [dict(m) for m in self.messages], "meta": self.meta}



# ----------------------------------------------------------------------------- normalisation
def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    # OpenAI-style content parts: keep the text parts, in order.
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
    raise DraftsmithError(f"{where}: message content must be a string, got {type(content).__name__}")


def _normalise_messages(raw: Any, where: str) -> list[Message]:
    """Turn a list of ``{role|from, content|value}`` dicts into validated messages."""
    if not isinstance(raw, list) or not raw:
        raise DraftsmithError(f"{where}: expected a non-empty list of messages")
    out: list[Message] = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict):
            raise DraftsmithError(f"{where}: message {j} is not an object")
        m = {k: v for k, v in m.items() if v is not None}  # datasets fills absent struct fields with None
        role_raw = m.get("role", m.get("from"))
        if role_raw is None:
            raise DraftsmithError(f"{where}: message {j} has no 'role' (or ShareGPT 'from')")
        role = _ROLES.get(str(role_raw).strip().lower())
        if role is None:
            raise DraftsmithError(f"{where}: message {j} has unknown role {role_raw!r}; "
                                  f"known: {', '.join(sorted(_ROLES))}")
        if "content" not in m and "value" not in m:
            raise DraftsmithError(f"{where}: message {j} has no 'content' (or ShareGPT 'value')")
        out.append({"role": role, "content": _content_text(m.get("content", m.get("value")), where)})
    return out


def _validate(messages: list[Message], where: str) -> list[Message]:
    """Check a conversation is usable and make it alternate, as strict templates (Gemma) require.

    Consecutive turns of one role are merged (joined by a blank line); a system turn
    is only allowed first; a user turn must come before any reply; nothing is empty.
    """
    for j, m in enumerate(messages):
        if not m["content"].strip():
            raise DraftsmithError(f"{where}: message {j} ({m['role']}) is empty")
        if m["role"] == "system" and j > 0:
            raise DraftsmithError(f"{where}: message {j} is a system turn; only the first turn may be")
    body = [m for m in messages if m["role"] != "system"]
    if not body or body[0]["role"] != "user":
        raise DraftsmithError(f"{where}: the first non-system turn must be the user's")
    merged: list[Message] = []
    for m in messages:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
        else:
            merged.append(dict(m))
    return merged


def record_to_conversation(record: Any, where: str, source: str = "", default_id: str = "") -> Conversation:
    """Normalise one record of any supported shape into a :class:`Conversation`.

    Shapes: ``{"messages": [{"role", "content"}, ...]}``, ShareGPT
    ``{"conversations": [{"from", "value"}, ...]}`` and
    ``{"prompt": str, "response"|"completion"?: str, "system"?: str}`` and MT-Bench questions
    ``{"turns": [str, ...]}`` (the first turn, as a prompt).

    Raises:
        DraftsmithError: naming ``where`` (e.g. ``data.jsonl line 7``) and the problem.
    """
    if not isinstance(record, dict):
        raise DraftsmithError(f"{where}: expected a JSON object, got {type(record).__name__}")
    # Rows of a datasets table carry every column; None marks the ones a record does not have.
    record = {k: v for k, v in record.items() if v is not None}
    if "messages" in record:
        messages = _normalise_messages(record["messages"], where)
    elif "conversations" in record:
        messages = _normalise_messages(record["conversations"], where)
    elif "prompt" in record:
        messages = []
        if record.get("system"):
            messages.append({"role": "system", "content": _content_text(record["system"], where)})
        messages.append({"role": "user", "content": _content_text(record["prompt"], where)})
        reply = record.get("response", record.get("completion"))
        if reply is not None:
            messages.append({"role": "assistant", "content": _content_text(reply, where)})
    elif isinstance(record.get("turns"), list) and record["turns"]:  # MT-Bench question files: the first turn
        messages = [{"role": "user", "content": _content_text(record["turns"][0], where)}]
    else:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise DraftsmithError(f"{where}: record has none of 'messages', 'conversations', 'prompt', 'turns' "
                              f"(keys: {keys})")
    rid = record.get("id", record.get("question_id", record.get("task_id", default_id or where)))
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    return Conversation(_validate(messages, where), id=str(rid), source=source, meta=meta)



def normalize_text(text: str) -> str:
    """Case-folded text with runs of whitespace collapsed: the identity used to compare prompts."""
    return " ".join(text.split()).casefold()


def prompt_key(conv: Conversation) -> str:
    """Identity of a conversation's prompt (its messages before the first assistant turn)."""
    return "\n".join(f"{m['role']}: {normalize_text(m['content'])}" for m in conv.prompt_messages())


def require_conversations(conversations: Iterable[Conversation], what: str) -> list[Conversation]:
    """``conversations`` as a list, refusing an empty one (``what``: the step, for the error)."""
    convs = list(conversations)
    if not convs:
        raise DraftsmithError(f"no conversations to {what}: the dataset is empty")
    return convs
