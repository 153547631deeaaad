"""Regeneration: the verifier answers the training prompts itself (batched, resumable).

A draft must learn the *verifier's* distribution, not the dataset's: replies
written by another model teach it tokens the verifier would not produce.
:func:`regenerate` appends one JSONL record per prompt; :func:`load_regenerated`
reads the file back as the conversations capture runs the verifier over.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from draftsmith.data.chat import encode_chat
from draftsmith.data.conversation import Conversation, record_to_conversation, require_conversations
from draftsmith.data.generation import Reply, ReplySource, eos_ids, generate_batch, pad_id, sample_seed
from draftsmith.decoding.sampling import SamplingParams
from draftsmith.errors import DraftsmithError
from draftsmith.models.verifier import context_length
from draftsmith.utils import complete_lines, progress_bar, write_error

log = logging.getLogger(__name__)

#: batches per chunk of regeneration, the unit it writes and resumes in
CHUNK_BATCHES = 4


def _read_regenerated(path: Path, generation: dict[str, Any], known_ids: set[str]) -> set[str]:
    """Ids already regenerated in ``path``; a torn last line (interrupted write) is cut off.

    Raises:
        DraftsmithError: a complete line is not JSON, was made with other settings,
            or belongs to another dataset.
    """
    done: set[str] = set()
    for n, raw in enumerate(complete_lines(path), start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            rid, gen = str(rec["id"]), rec["meta"]["generation"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise DraftsmithError(f"{path} line {n} is not a regenerated record ({type(e).__name__}); "
                                  "the file is corrupt or not draftsmith's: use another output path") from e
        if gen != generation:
            changed = sorted(k for k in set(gen) | set(generation) if gen.get(k) != generation.get(k))
            was = {k: gen.get(k) for k in changed}
            raise DraftsmithError(f"{path} was regenerated with other settings ({', '.join(changed)} differ: "
                                  f"{was}); use another output path or the same settings")
        if rid not in known_ids:
            raise DraftsmithError(f"{path} line {n} holds sample {rid!r}, which is not in this dataset; "
                                  "use another output path for another dataset")
        done.add(rid)
    return done


def prompt_limit(model: torch.nn.Module, max_new_tokens: int, max_prompt_tokens: int | None) -> int | None:
    """The longest prompt (tokens, chat template applied) regeneration keeps; None: no limit.

    A prompt must leave room for ``max_new_tokens`` in the verifier's context.

    Raises:
        DraftsmithError: ``max_new_tokens`` fills the whole context.
    """
    ctx = context_length(model)
    limit = max_prompt_tokens
    if ctx is not None:
        if ctx - max_new_tokens < 1:
            raise DraftsmithError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the "
                                  f"verifier's context of {ctx} tokens")
        limit = min(limit or ctx, ctx - max_new_tokens)
    return limit


def regenerate(model: torch.nn.Module, tokenizer: Any, conversations: Iterable[Conversation], out_path: Path, *,
               max_new_tokens: int = 256, temperature: float = 0.0, top_p: float | None = None,
               batch_size: int = 8, max_prompt_tokens: int | None = None, seed: int = 0, progress: bool = True,
               fingerprint: str | None = None, source: ReplySource | None = None, engine: str = "auto",
               chunk_batches: int = CHUNK_BATCHES, deadline: float | None = None,
               on_stop: Callable[[int, int], None] | None = None) -> Path:
    """Answer every prompt with the verifier and append the conversations to a JSONL file.

    Each line is ``{"id", "messages", "meta"}``: the conversation's prompt messages
    (:meth:`~draftsmith.data.conversation.Conversation.prompt_messages`) plus one
    assistant message with the verifier's reply. ``meta`` keeps the source's meta
    and adds ``source``, ``finish_reason`` (``stop``: end-of-sequence token;
    ``length``: ``max_new_tokens`` reached; ``empty``: the reply was empty, the
    record then has no assistant turn and capture skips it), ``prompt_tokens``,
    ``completion_tokens`` and ``generation`` (the settings, checked on resume).

    Batches are left-padded here (the tokenizer is not touched) with an attention
    mask; generation stops at the verifier's end-of-sequence tokens, which are not
    part of the reply.

    Order and resume: prompts are sorted by length (longest first, ties by input
    position) and cut into chunks of ``chunk_batches`` batches; within a chunk the
    in-process verifier decodes ``batch_size`` rows at a time and a row whose reply
    ends takes the chunk's next prompt (continuous batching,
    :func:`~draftsmith.data.generation.generate_batch`). Each chunk's records are
    written batch by batch (each in input order, as static batches wrote them), flushed, and fsynced. A re-run reads the file (cutting a
    torn last line), skips finished ids and regenerates only the rest, with the same
    chunks as an uninterrupted run, so the final file is identical either way; an
    interruption loses at most the chunk in progress. Sampling (``temperature > 0``) draws each sample from its own
    generator seeded by ``(seed, id)`` (:func:`~draftsmith.data.generation.sample_seed`)
    for the same reason.

    Args:
        model: the verifier.
        tokenizer: its tokenizer (with a chat template).
        conversations: prompts; ids must be unique (they key the resume).
        out_path: the JSONL file (created or continued).
        max_new_tokens: reply length limit.
        temperature: 0 = greedy; > 0 samples.
        top_p: nucleus filter when sampling.
        batch_size: prompts decoded together (the rows of a batch).
        chunk_batches: batches per chunk, the unit of writing and resuming (a server
            ``source`` answers one batch per chunk); more rows end and refill within a
            longer chunk, fewer run alone at its end.
        max_prompt_tokens: drop prompts longer than this (besides the context limit).
        seed: salts the per-sample sampling seeds.
        progress: show a progress bar with generated tokens/s.
        fingerprint: the verifier's fingerprint, recorded in ``meta.generation``
            (a resume with another verifier is refused).
        source: another source of the replies, e.g. an OpenAI-compatible server
            (:mod:`draftsmith.data.endpoint`); None: the verifier in this process.
        engine: how the verifier in this process decodes a batch (``auto``, ``lean``,
            ``hf``: :func:`~draftsmith.data.generation.generate_batch`).
        deadline: a ``time.perf_counter()`` value after which no further chunk is started
            (a budgeted run's data time, :func:`draftsmith.pipeline.budget.regeneration_seconds`):
            the chunks finished by then are the result, and the prompts left (the shortest: the
            longest go first) are not answered. The first chunk always runs. None: no limit.
        on_stop: called with (replies in the file, prompts left unanswered) when the deadline
            stopped it.

    Returns:
        ``out_path``.

    Raises:
        DraftsmithError: empty dataset, duplicate ids, every prompt too long for the
            context, a file made with other settings or data, or a write failure
            (finished records stay in the file).
    """
    params = SamplingParams(temperature=temperature, top_p=top_p)
    if max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise DraftsmithError(f"--batch-size must be >= 1, got {batch_size}")
    if chunk_batches < 1:
        raise DraftsmithError(f"chunk_batches must be >= 1, got {chunk_batches}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise DraftsmithError(f"--max-prompt-tokens must be >= 1, got {max_prompt_tokens}")
    convs = require_conversations(conversations, "regenerate")
    seen: set[str] = set()
    for c in convs:
        if c.id in seen:
            raise DraftsmithError(f"conversation id {c.id!r} occurs twice; regeneration resumes by id, so ids "
                                  "must be unique (load the dataset with dedupe, or give records an 'id')")
        seen.add(c.id)
    generation = {"max_new_tokens": max_new_tokens, "temperature": float(temperature), "top_p": top_p,
                  "seed": seed, "verifier": fingerprint}
    if source is not None:
        generation["engine"] = source.engine
    out_path = Path(out_path)
    done = _read_regenerated(out_path, generation, seen)

    ctx = context_length(model)
    limit = prompt_limit(model, max_new_tokens, max_prompt_tokens)
    prompts: list[tuple[int, list[int]]] = []
    for j, c in enumerate(convs):
        ids = encode_chat(tokenizer, c.prompt_messages(), add_generation_prompt=True)
        if limit is None or len(ids) <= limit:
            prompts.append((j, ids))
    dropped = len(convs) - len(prompts)
    if not prompts:
        why = (f"--max-prompt-tokens {max_prompt_tokens}" if limit == max_prompt_tokens else
               f"the verifier's context of {ctx} tokens minus --max-new-tokens {max_new_tokens}")
        raise DraftsmithError(f"all {len(convs)} prompts are longer than {limit} tokens ({why}); nothing to "
                              "regenerate")
    if dropped:
        log.warning("regenerate: dropped %d of %d prompts longer than %d tokens", dropped, len(convs), limit)

    order = sorted(prompts, key=lambda p: (-len(p[1]), p[0]))
    chunk = batch_size * (chunk_batches if source is None else 1)
    batches = [order[i:i + chunk] for i in range(0, len(order), chunk)]
    eos = eos_ids(model, tokenizer)
    pad = pad_id(tokenizer, eos)
    todo = sum(convs[j].id not in done for j, _ in prompts)
    if not todo:
        log.info("regenerate: all %d replies already in %s", len(prompts), out_path)
        return out_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0, new_tokens = time.perf_counter(), 0
    # A partly written chunk is generated whole again: the same chunk gives the same replies.
    batches = [b for b in batches if not all(convs[j].id in done for j, _ in b)]
    # In token slots (max_new_tokens per reply), moved per decode step (generation.TokenProgress).
    bar = progress_bar(sum(len(b) for b in batches) * max_new_tokens, "regenerate", "tok", progress, unit_scale=True)
    work = [([ids for _, ids in b], [sample_seed(seed, convs[j].id) for j, _ in b]) for b in batches]
    if source is None:
        answers: Iterator[list[Reply]] = (generate_batch(model, p, s, params, max_new_tokens, eos, pad,
                                                         bar=bar if progress else None, engine=engine,
                                                         batch_size=batch_size)
                                          for p, s in work)
    else:
        answers = source.replies(work, params, max_new_tokens, eos)
    answers = iter(answers)
    stopped = 0
    try:
        with open(out_path, "ab") as f:
            for n_chunk, batch in enumerate(batches):
                if deadline is not None and n_chunk and time.perf_counter() >= deadline:
                    stopped = sum(len(b) for b in batches[n_chunk:])
                    break
                replies = next(answers)
                # in the order static batches wrote: batch by batch (longest first), input order in each
                order_in = sorted(range(len(batch)), key=lambda i: (i // batch_size, batch[i][0]))
                for (j, ids), (reply, reason) in ((batch[i], replies[i]) for i in order_in):
                    conv = convs[j]
                    if conv.id in done:
                        continue
                    f.write((json.dumps(_record(conv, tokenizer, ids, reply, reason, generation),
                                        ensure_ascii=False, default=str) + "\n").encode())
                    f.flush()
                    done.add(conv.id)
                    new_tokens += len(reply)
                if source is not None:  # a server answers a batch at once: its slots move together
                    bar.update(len(batch) * max_new_tokens)
                os.fsync(f.fileno())
                bar.set_postfix_str(f"{len(done)} replies, {new_tokens / max(time.perf_counter() - t0, 1e-9):.1f} "
                                    "generated tok/s")
    except OSError as e:
        raise write_error(e, out_path, f"the {len(done)} finished replies") from e
    finally:
        bar.close()
        getattr(answers, "close", lambda: None)()  # a source stops its requests on an error or Ctrl-C
    if stopped:
        log.warning("regenerate: the data time is up: %d replies kept, %d prompts left unanswered", len(done),
                    stopped)
        if on_stop is not None:
            on_stop(len(done), stopped)
    return out_path


def _record(conv: Conversation, tokenizer: Any, prompt_ids: list[int], reply: list[int], reason: str,
            generation: dict[str, Any]) -> dict[str, Any]:
    text = tokenizer.decode(reply, skip_special_tokens=True)
    messages = [dict(m) for m in conv.prompt_messages()]
    if text.strip():
        messages.append({"role": "assistant", "content": text})
    else:  # an empty turn is not a valid conversation; keep the record so a resume does not retry it
        reason = "empty"
    meta = {**conv.meta, "source": conv.source, "finish_reason": reason, "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(reply), "generation": generation}
    return {"id": conv.id, "messages": messages, "meta": meta}


def load_regenerated(path: Path) -> list[Conversation]:
    """The conversations of a :func:`regenerate` file, in file order (a torn last line is ignored).

    Unlike :func:`~draftsmith.data.sources.load_prompts` this neither splits,
    dedupes nor reorders: the file already is the training set.

    Raises:
        DraftsmithError: missing file or a malformed line (named).
    """
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"cannot read regenerated data {path}: no such file (run regenerate first)")
    out = []
    for n, raw in enumerate(complete_lines(path, cut=False), start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DraftsmithError(f"{path} line {n}: malformed JSON") from e
        out.append(record_to_conversation(rec, f"{path.name} line {n}", str(path), default_id=f"{path.name}:{n}"))
    if not out:
        raise DraftsmithError(f"regenerated data {path} is empty")
    return out

