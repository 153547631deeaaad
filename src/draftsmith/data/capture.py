"""Training data from the verifier itself: regenerated replies and captured hidden states.

Two steps, each resumable:

1. :func:`regenerate` answers each prompt with the verifier (batched ``generate``)
   and appends one JSONL record per sample. A draft must learn the *verifier's*
   distribution, not the dataset's: replies written by another model teach it
   tokens the verifier would not produce.
2. :func:`capture_to_shards` runs the verifier once over each (prompt + reply)
   and stores what EAGLE-3 trains on in safetensors shards;
   :func:`capture_samples` yields the same samples without touching the disk
   (online mode, when disk is the limit).

A *sample* is a dict of four tensors, for a conversation of ``T`` tokens, a
verifier of hidden size ``H`` and ``A`` aux layers:

- ``input_ids`` int64 ``[T]``;
- ``loss_mask`` bool ``[T]``, true on the assistant's tokens
  (:func:`~draftsmith.data.prompts.tokenize_conversation`);
- ``aux`` ``[T, A*H]``: HF ``hidden_states[i]`` (the *input* of decoder layer
  ``i``) for ``i`` in ``aux_layer_ids``, concatenated in that order;
- ``last`` ``[T, H]``: the input of the verifier's ``lm_head`` (the final-normed
  hidden state), so ``logits = lm_head(last)``.

``aux`` and ``last`` are stored in a configurable dtype (bfloat16 by default).

On disk (:func:`capture_to_shards`) a capture directory holds
``shard-00000.safetensors``, ... and ``manifest.json``. Shard ``k`` covers the
conversations ``[k*S, (k+1)*S)`` of the input (``S = samples_per_shard``) minus
those dropped (no reply, prompt too long), in input order; sample ``i`` of a
shard is stored under the keys ``"{i}.input_ids"``, ``"{i}.loss_mask"``,
``"{i}.aux"``, ``"{i}.last"``, and the safetensors metadata key ``"draftsmith"``
holds a JSON object with the verifier fingerprint, aux layer ids, dtype, the
sample ids and counts, so a lone shard still says where it came from. The
manifest records the verifier (fingerprint, spec, hidden size), the capture
settings and, per shard, its sample/token counts and sha256; it is rewritten
atomically after every shard. Readers (:func:`load_shards`, :class:`ShardDataset`,
:func:`read_shard`) refuse a shard of another verifier and a corrupt one, naming it.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol, Sequence

import torch

from draftsmith.data.chat import encode_chat
from draftsmith.data.prompts import (Conversation, TokenizedConversation, TooLong, _fit, record_to_conversation,
                                     tokenize_conversation)
from draftsmith.decoding.sampling import SamplingParams, logits_to_probs
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import default_aux_layer_ids
from draftsmith.models.verifier import context_length
from draftsmith.utils import atomic_write_bytes, atomic_write_json, environment_info, resolve_dtype

log = logging.getLogger(__name__)

SHARD_FORMAT = "draftsmith.capture/1"
MANIFEST = "manifest.json"
SAMPLE_KEYS = ("input_ids", "loss_mask", "aux", "last")
_META_KEY = "draftsmith"  # one metadata key: safetensors writes several keys in a random order
# Manifest fields that must match for a directory to be resumed; the rest may differ.
_RESUME_KEYS = ("format", "fingerprint", "aux_layer_ids", "hidden_size", "dtype", "max_length", "samples_per_shard",
                "trim_loops")
_RESUME_DEFAULTS = {"trim_loops": False}  # what a manifest from before a key existed meant
# Loop trimming (see loop_cut): an n-gram size, a window that must be this share repeated n-grams,
# and how many tokens of the loop stay in the sample.
LOOP_NGRAM, LOOP_WINDOW, LOOP_SHARE, LOOP_KEEP = 4, 32, 0.5, 32


# ----------------------------------------------------------------------------- shared helpers
def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _text_config(model: torch.nn.Module) -> Any:
    return getattr(model.config, "get_text_config", lambda: model.config)()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_aux_layer_ids(model: torch.nn.Module, aux_layer_ids: Sequence[int] | None = None) -> list[int]:
    """The verifier layers to capture: ``aux_layer_ids`` or EAGLE-3's ``[2, n//2, n-3]``, validated.

    Raises:
        DraftsmithError: an id is not a decoder layer of the verifier (``0 <= i < n``).
    """
    n = _text_config(model).num_hidden_layers
    ids = [int(i) for i in aux_layer_ids] if aux_layer_ids is not None else default_aux_layer_ids(n)
    if not ids or any(not 0 <= i < n for i in ids):
        hint = "" if aux_layer_ids is not None else " (the default [2, n//2, n-3] needs >= 4 layers; pass them)"
        raise DraftsmithError(f"aux layer ids {ids} out of range for a {n}-layer verifier{hint}")
    return ids


def _conversation_list(conversations: Iterable[Conversation], what: str) -> list[Conversation]:
    convs = list(conversations)
    if not convs:
        raise DraftsmithError(f"no conversations to {what}: the dataset is empty")
    return convs


def _dropped_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v) or "none"


# ----------------------------------------------------------------------------- 1. regeneration
class _PerSampleSampler:
    """A logits processor that samples each row with its own generator and forces that token.

    HF ``generate`` draws one batch-wide random stream, so a row's sample would
    depend on which rows share its batch, and a resumed run would differ. Here row
    ``b`` draws from ``generators[b]`` (seeded from the sample's id) through the
    project's one sampling transform; greedy decoding then picks the forced token.
    """

    def __init__(self, params: SamplingParams, generators: list[torch.Generator]) -> None:
        self.params = params
        self.generators = generators

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = logits_to_probs(scores, self.params).cumsum(-1)  # [B, V]
        # Inverse-CDF draw: one uniform per row (torch.multinomial takes ~15 ms per 50k-token row on CPU).
        u = torch.cat([torch.rand(1, generator=g, device=cdf.device) for g in self.generators])  # [B]
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, tokens, 0.0)


def sample_seed(seed: int, sample_id: str) -> int:
    """The sampling seed of one sample: a hash of ``(seed, id)``, independent of batching and resumes."""
    digest = hashlib.sha256(f"{seed}\0{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src is not None:
            ids.update(int(t) for t in src)
    if not ids:
        raise DraftsmithError("the verifier has no end-of-sequence token (generation_config.eos_token_id or "
                              "tokenizer.eos_token); cannot tell where a reply ends")
    return sorted(ids)


def _pad_id(tokenizer: Any, eos: Sequence[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else int(eos[0])


def _generate_batch(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
                    max_new_tokens: int, eos: list[int], pad: int) -> list[tuple[list[int], str]]:
    """Replies to ``prompts`` in one left-padded ``generate``: ``(token ids without eos, finish reason)``."""
    from transformers import GenerationConfig, LogitsProcessorList

    device = _device(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    processors = LogitsProcessorList()
    if not params.greedy:
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        processors.append(_PerSampleSampler(params, gens))
    # A fresh config: the model's own generation_config may carry sampling defaults or penalties.
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             logits_processor=processors)
    results = []
    stop = set(eos)
    for row in out[:, width:].tolist():
        end = next((j for j, t in enumerate(row) if t in stop), None)
        results.append((row, "length") if end is None else (row[:end], "stop"))
    return results


Reply = tuple[list[int], str]  # (token ids without the end-of-sequence token, finish reason)


class ReplySource(Protocol):
    """Where :func:`regenerate`'s replies come from when not from the in-process verifier.

    Attributes:
        engine: recorded as ``meta.generation.engine`` (a resume with another source is refused).
    """

    engine: str

    def replies(self, batches: list[tuple[list[list[int]], list[int]]], params: SamplingParams,
                max_new_tokens: int, eos: list[int]) -> Iterator[list[Reply]]:
        """The replies to each ``(prompts, sampling seeds)`` batch, one list per batch, in order."""
        ...


def complete_lines(path: Path) -> list[bytes]:
    """The complete lines of an append-only JSONL file (none if it does not exist).

    Every record is written as one line ending in "\\n", so text after the last one is a
    torn write of an interrupted run: it is cut off the file, with a warning.
    """
    if not path.exists():
        return []
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DraftsmithError(f"cannot read {path}: {e.strerror or e}") from e
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning("%s: dropping a torn last line (%d bytes) from an interrupted run", path, len(data) - end)
        with open(path, "r+b") as f:
            f.truncate(end)
    return data[:end].splitlines()


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


def regenerate(model: torch.nn.Module, tokenizer: Any, conversations: Iterable[Conversation], out_path: Path, *,
               max_new_tokens: int = 256, temperature: float = 0.0, top_p: float | None = None,
               batch_size: int = 8, max_prompt_tokens: int | None = None, seed: int = 0, progress: bool = True,
               fingerprint: str | None = None, source: ReplySource | None = None) -> Path:
    """Answer every prompt with the verifier and append the conversations to a JSONL file.

    Each line is ``{"id", "messages", "meta"}``: the conversation's prompt messages
    (:meth:`~draftsmith.data.prompts.Conversation.prompt_messages`) plus one
    assistant message with the verifier's reply. ``meta`` keeps the source's meta
    and adds ``source``, ``finish_reason`` (``stop``: end-of-sequence token;
    ``length``: ``max_new_tokens`` reached; ``empty``: the reply was empty, the
    record then has no assistant turn and capture skips it), ``prompt_tokens``,
    ``completion_tokens`` and ``generation`` (the settings, checked on resume).

    Batches are left-padded here (the tokenizer is not touched) with an attention
    mask; generation stops at the verifier's end-of-sequence tokens, which are not
    part of the reply.

    Order and resume: prompts are sorted by length (longest first, ties by input
    position) and cut into batches, which limits padding; each batch's records
    are written in input order, flushed, and fsynced. A re-run reads the file
    (cutting a torn last line), skips finished ids and regenerates only the rest,
    with the same batches as an uninterrupted run, so the final file is identical
    either way. Sampling (``temperature > 0``) draws each sample from its own
    generator seeded by ``(seed, id)`` (:func:`sample_seed`) for the same reason.

    Args:
        model: the verifier.
        tokenizer: its tokenizer (with a chat template).
        conversations: prompts; ids must be unique (they key the resume).
        out_path: the JSONL file (created or continued).
        max_new_tokens: reply length limit.
        temperature: 0 = greedy; > 0 samples.
        top_p: nucleus filter when sampling.
        batch_size: prompts per ``generate`` call.
        max_prompt_tokens: drop prompts longer than this (besides the context limit).
        seed: salts the per-sample sampling seeds.
        progress: show a progress bar with generated tokens/s.
        fingerprint: the verifier's fingerprint, recorded in ``meta.generation``
            (a resume with another verifier is refused).
        source: another source of the replies, e.g. an OpenAI-compatible server
            (:mod:`draftsmith.data.endpoint`); None: ``model.generate`` in this process.

    Returns:
        ``out_path``.

    Raises:
        DraftsmithError: empty dataset, duplicate ids, every prompt too long for the
            context, a file made with other settings or data, or a write failure
            (finished records stay in the file).
    """
    from tqdm.auto import tqdm

    params = SamplingParams(temperature=temperature, top_p=top_p)
    if max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise DraftsmithError(f"--batch-size must be >= 1, got {batch_size}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise DraftsmithError(f"--max-prompt-tokens must be >= 1, got {max_prompt_tokens}")
    convs = _conversation_list(conversations, "regenerate")
    seen: set[str] = set()
    for c in convs:
        if c.id in seen:
            raise DraftsmithError(f"conversation id {c.id!r} occurs twice; regeneration resumes by id, so ids "
                                  "must be unique (load the dataset with dedupe, or give records an 'id')")
        seen.add(c.id)
    generation = {"max_new_tokens": max_new_tokens, "temperature": float(temperature), "top_p": top_p,
                  "seed": seed, "verifier": fingerprint}
    if source is not None:  # absent in process: files from before the option stay resumable
        generation["engine"] = source.engine
    out_path = Path(out_path)
    done = _read_regenerated(out_path, generation, seen)

    # Prompts must leave room for max_new_tokens in the context.
    ctx = context_length(model)
    limit = max_prompt_tokens
    if ctx is not None:
        if ctx - max_new_tokens < 1:
            raise DraftsmithError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the "
                                  f"verifier's context of {ctx} tokens")
        limit = min(limit or ctx, ctx - max_new_tokens)
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
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    eos = _eos_ids(model, tokenizer)
    pad = _pad_id(tokenizer, eos)
    todo = sum(convs[j].id not in done for j, _ in prompts)
    if not todo:
        log.info("regenerate: all %d replies already in %s", len(prompts), out_path)
        return out_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), initial=len(prompts) - todo, desc="regenerate", unit="sample",
               disable=not progress)
    t0, new_tokens = time.perf_counter(), 0
    # A partly written batch is generated whole again: the same batch gives the same replies.
    batches = [b for b in batches if not all(convs[j].id in done for j, _ in b)]
    work = [([ids for _, ids in b], [sample_seed(seed, convs[j].id) for j, _ in b]) for b in batches]
    if source is None:
        answers: Iterator[list[Reply]] = (_generate_batch(model, p, s, params, max_new_tokens, eos, pad)
                                          for p, s in work)
    else:
        answers = source.replies(work, params, max_new_tokens, eos)
    try:
        with open(out_path, "ab") as f:
            for batch, replies in zip(batches, answers, strict=True):
                for (j, ids), (reply, reason) in sorted(zip(batch, replies), key=lambda x: x[0][0]):
                    conv = convs[j]
                    if conv.id in done:
                        continue
                    f.write((json.dumps(_record(conv, tokenizer, ids, reply, reason, generation),
                                        ensure_ascii=False, default=str) + "\n").encode())
                    f.flush()
                    done.add(conv.id)
                    new_tokens += len(reply)
                    bar.update(1)
                os.fsync(f.fileno())
                bar.set_postfix_str(f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s")
    except OSError as e:
        raise DraftsmithError(f"cannot write {out_path}: {write_failure(e)}; the {len(done)} finished replies are kept "
                              "there, free space and re-run to continue") from e
    finally:
        bar.close()
        getattr(answers, "close", lambda: None)()  # a source stops its requests on an error or Ctrl-C
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

    Unlike :func:`~draftsmith.data.prompts.load_prompts` this neither splits,
    dedupes nor reorders: the file already is the training set.

    Raises:
        DraftsmithError: missing file or a malformed line (named).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DraftsmithError(f"cannot read regenerated data {path}: {e.strerror or e}") from e
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning("%s: ignoring a torn last line (interrupted run; re-run regenerate to finish it)", path)
    out = []
    for n, raw in enumerate(data[:end].splitlines(), start=1):
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


# ----------------------------------------------------------------------------- 2. capture
@dataclass
class _Counts:
    """Why conversations did not become samples."""

    no_reply: int = 0
    too_long: int = 0
    truncated: int = 0
    loop_trimmed: int = 0

    def add(self, other: "_Counts") -> None:
        self.no_reply += other.no_reply
        self.too_long += other.too_long
        self.truncated += other.truncated
        self.loop_trimmed += other.loop_trimmed

    def as_dict(self) -> dict[str, int]:
        return {"no_reply": self.no_reply, "too_long": self.too_long, "truncated": self.truncated,
                "loop_trimmed": self.loop_trimmed}


@dataclass
class _Plan:
    """Validated capture settings shared by the online and the sharded mode."""

    aux_layer_ids: list[int]
    max_length: int
    hidden_size: int
    dtype: torch.dtype
    batch_size: int
    decoder: torch.nn.Module
    pad_id: int
    keep_logits: bool
    trim_loops: bool = False


def _plan(model: torch.nn.Module, tokenizer: Any, convs: list[Conversation], aux_layer_ids: Sequence[int] | None,
          max_length: int, batch_size: int, dtype: torch.dtype | str, trim_loops: bool = False) -> _Plan:
    if max_length < 2:
        raise DraftsmithError(f"--max-length must be >= 2, got {max_length}")
    if batch_size < 1:
        raise DraftsmithError(f"--batch-size must be >= 1, got {batch_size}")
    if not any(c.has_assistant for c in convs):
        raise DraftsmithError(f"none of the {len(convs)} conversations has an assistant turn: nothing to capture "
                              "(regenerate replies with the verifier first)")
    ids = resolve_aux_layer_ids(model, aux_layer_ids)
    ctx = context_length(model)
    if ctx is not None and max_length > ctx:
        log.warning("capture: --max-length %d exceeds the verifier's context of %d tokens; using %d",
                    max_length, ctx, ctx)
        max_length = ctx
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None:
        raise DraftsmithError(f"verifier {type(model).__name__} has no decoder (get_decoder()); cannot capture "
                              "its final hidden states")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None) or 0
    return _Plan(ids, max_length, _text_config(model).hidden_size, resolve_dtype(dtype, torch.device("cpu")),
                 batch_size, decoder, int(pad),
                 keep_logits="logits_to_keep" in inspect.signature(model.forward).parameters, trim_loops=trim_loops)


def loop_cut(tokens: Sequence[int], ngram: int = LOOP_NGRAM, window: int = LOOP_WINDOW, share: float = LOOP_SHARE,
             keep: int = LOOP_KEEP) -> int:
    """How many of ``tokens`` to keep when a reply falls into a repetition loop (all of them if it does not).

    A loop is detected at the first position where at least ``share`` of the last ``window``
    ``ngram``-grams occurred earlier in ``tokens``; the reply is cut ``keep`` tokens after it.
    Small verifiers loop in long greedy replies; a looping tail is easy to predict and
    teaches a draft little, so cutting it spends training on the text that decides acceptance
    (BENCHMARKS.md section 3), while the kept start of the loop still shows the draft to copy.
    """
    seen: set[tuple[int, ...]] = set()
    repeated: list[bool] = []
    hits = 0
    for i in range(len(tokens)):
        g = tuple(tokens[i - ngram + 1:i + 1]) if i >= ngram - 1 else None
        r = g is not None and g in seen
        if g is not None:
            seen.add(g)
        repeated.append(r)
        hits += r
        if len(repeated) > window:
            hits -= repeated[-window - 1]
        if i + 1 >= window and hits >= share * window:
            return min(len(tokens), i + 1 + keep)
    return len(tokens)


def _trim_loop(sample: TokenizedConversation) -> TokenizedConversation:
    """Cut the sample where its assistant tokens (in order) fall into a loop (:func:`loop_cut`)."""
    where = [i for i, m in enumerate(sample.loss_mask) if m]
    n = loop_cut([sample.input_ids[i] for i in where])
    if n >= len(where):
        return sample
    end = where[n - 1] + 1  # n >= window + keep here: a loop needs a full window to be seen
    return TokenizedConversation(sample.input_ids[:end], sample.loss_mask[:end])


def _tokenize(tokenizer: Any, conv: Conversation, max_length: int, counts: _Counts,
              trim_loops: bool = False) -> TokenizedConversation | None:
    """The conversation's ids and loss mask cut to ``max_length`` (keeping the start) and, with
    ``trim_loops``, where its reply loops; or None (counted)."""
    if not conv.has_assistant:
        counts.no_reply += 1
        return None
    try:
        full = tokenize_conversation(tokenizer, conv.messages)
    except DraftsmithError as e:  # e.g. a template that rejects the turn order: say which conversation
        raise DraftsmithError(f"conversation {conv.id!r}: {e}") from e
    try:
        sample = _fit(full, max_length, truncate=True)
    except TooLong:  # the prompt alone fills the context: no reply token left to learn
        counts.too_long += 1
        return None
    counts.truncated += len(sample.input_ids) < len(full.input_ids)
    if trim_loops:
        trimmed = _trim_loop(sample)
        counts.loop_trimmed += len(trimmed.input_ids) < len(sample.input_ids)
        sample = trimmed
    return sample


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), to limit padding."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def right_padded(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, T], attention_mask [B, T])`` of token lists padded on the right."""
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[b, :len(s)] = 1
    return ids, mask


def _forward_batch(model: torch.nn.Module, plan: _Plan, batch: list[TokenizedConversation]) -> list[dict]:
    """One verifier forward over a right-padded batch -> unpadded samples, in batch order."""
    device = _device(model)
    ids, mask = right_padded([s.input_ids for s in batch], plan.pad_id)
    grabbed: dict[str, torch.Tensor] = {}

    def grab_last(module: torch.nn.Module, args: Any, output: Any) -> None:
        # The decoder's last_hidden_state is what lm_head reads, for every position; lm_head itself
        # only sees the logits_to_keep slice.
        grabbed["last"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    extra = {"logits_to_keep": 1} if plan.keep_logits else {}
    handle = plan.decoder.register_forward_hook(grab_last)
    try:
        with torch.inference_mode():
            # A list for output_hidden_states keeps only those layers: no [L+1, B, T, H] stack in memory.
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False,
                        output_hidden_states=sorted(set(plan.aux_layer_ids)), **extra)
    finally:
        handle.remove()
    hidden = out.hidden_states
    if hidden is None or any(hidden[i] is None for i in plan.aux_layer_ids):
        raise DraftsmithError(f"verifier {type(model).__name__} did not return the hidden states of layers "
                              f"{plan.aux_layer_ids} (output_hidden_states); cannot capture")
    aux = torch.cat([hidden[i] for i in plan.aux_layer_ids], dim=-1).to(plan.dtype).cpu()  # [B, T, A*H]
    last = grabbed["last"].to(plan.dtype).cpu()  # [B, T, H]
    samples = []
    for b, s in enumerate(batch):
        n = len(s.input_ids)
        # clone: a slice would keep the whole batch alive and shares storage, which safetensors refuses
        samples.append({"input_ids": torch.tensor(s.input_ids, dtype=torch.long),
                        "loss_mask": torch.tensor(s.loss_mask, dtype=torch.bool),
                        "aux": aux[b, :n].clone(), "last": last[b, :n].clone()})
    return samples


def _capture_window(model: torch.nn.Module, tokenizer: Any, plan: _Plan,
                    convs: Sequence[Conversation]) -> tuple[list[dict], list[str], _Counts]:
    """Samples of consecutive conversations, batched by length, returned in input order."""
    counts = _Counts()
    kept = [(c.id, s) for c in convs
            if (s := _tokenize(tokenizer, c, plan.max_length, counts, plan.trim_loops)) is not None]
    samples: list[dict | None] = [None] * len(kept)
    for batch in length_batches([len(s.input_ids) for _, s in kept], plan.batch_size):
        for i, sample in zip(batch, _forward_batch(model, plan, [kept[i][1] for i in batch])):
            samples[i] = sample
    return samples, [rid for rid, _ in kept], counts  # type: ignore[return-value]


def _nothing_captured(n: int, counts: _Counts, max_length: int) -> DraftsmithError:
    return DraftsmithError(f"no samples captured from {n} conversations: {counts.too_long} have prompts that fill "
                           f"--max-length {max_length} and {counts.no_reply} have no assistant turn")


def capture_samples(model: torch.nn.Module, tokenizer: Any, conversations: Iterable[Conversation], *,
                    aux_layer_ids: Sequence[int] | None = None, max_length: int = 2048, batch_size: int = 8,
                    dtype: torch.dtype | str = torch.bfloat16, window: int | None = None,
                    trim_loops: bool = False) -> Iterator[dict]:
    """Yield captured samples (see the module docstring) without writing anything: the online mode.

    Conversations are tokenized with the verifier's chat template (loss mask on
    assistant tokens), cut to ``max_length`` keeping the start, and run through
    the verifier in right-padded batches of similar length: one forward per batch,
    keeping only the aux layers' hidden states and computing logits for one
    position only. Samples come out in input order; conversations without an
    assistant turn or whose prompt fills ``max_length`` are skipped (logged).

    Args:
        model: the verifier.
        tokenizer: its tokenizer.
        conversations: conversations with replies (e.g. :func:`load_regenerated`).
        aux_layer_ids: HF ``hidden_states`` indices to capture; default ``[2, n//2, n-3]``.
        max_length: tokens per sample (at most the verifier's context).
        batch_size: sequences per forward.
        dtype: dtype of ``aux`` and ``last``.
        window: conversations sorted by length together (memory holds one window
            of samples); default ``8 * batch_size``.
        trim_loops: cut replies where they fall into a repetition loop (:func:`loop_cut`).

    Raises:
        DraftsmithError: empty dataset, no assistant turns, nothing fits ``max_length``,
            bad aux layer ids.
    """
    convs = _conversation_list(conversations, "capture")
    plan = _plan(model, tokenizer, convs, aux_layer_ids, max_length, batch_size, dtype, trim_loops)
    if window is not None and window < 1:
        raise DraftsmithError(f"window must be >= 1, got {window}")
    # Validation above runs at the call, not at the first next(): errors surface where they are caused.
    return _iter_samples(model, tokenizer, plan, convs, window or 8 * batch_size)


def _iter_samples(model: torch.nn.Module, tokenizer: Any, plan: _Plan, convs: list[Conversation],
                  window: int) -> Iterator[dict]:
    total, yielded = _Counts(), 0
    for start in range(0, len(convs), window):
        samples, _, counts = _capture_window(model, tokenizer, plan, convs[start:start + window])
        total.add(counts)
        yielded += len(samples)
        yield from samples
    if not yielded:
        raise _nothing_captured(len(convs), total, plan.max_length)
    if any(total.as_dict().values()):
        log.warning("capture: %s", _dropped_line(total.as_dict()))


# ----------------------------------------------------------------------------- shards: writing
def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _inputs_digest(convs: Sequence[Conversation]) -> str:
    """Identity of a shard's input conversations: a resume must not mix two datasets."""
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.id, c.messages], sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\0")
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_failure(e: OSError) -> str:
    """Why a write failed, in words ("the disk is full" for a full disk or quota)."""
    return "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))


def _disk_error(e: OSError, what: Path) -> DraftsmithError:
    return DraftsmithError(f"cannot write {what}: {write_failure(e)}; completed shards are kept, free space and "
                           "re-run the same command to continue")


def _write_shard(path: Path, samples: list[dict], meta: dict[str, Any]) -> tuple[str, int]:
    """Write one shard atomically; return ``(sha256, bytes)``.

    Raises:
        DraftsmithError: the write failed (e.g. disk full); no partial file is left.
    """
    from safetensors.torch import save

    tensors = {f"{i}.{k}": s[k].contiguous() for i, s in enumerate(samples) for k in SAMPLE_KEYS}
    data = save(tensors, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
    try:
        atomic_write_bytes(path, data)  # temp file + fsync + rename; removes the temp file on failure
    except OSError as e:
        raise _disk_error(e, path) from e
    return hashlib.sha256(data).hexdigest(), len(data)


def _load_manifest_for_resume(out_dir: Path, header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Shard entries of an earlier run in ``out_dir`` that this run may keep, by file name."""
    path = out_dir / MANIFEST
    if not path.exists():
        return {}
    old = read_manifest(out_dir)
    if old.get("fingerprint") != header["fingerprint"]:
        raise DraftsmithError(f"{out_dir} holds shards captured from verifier {old.get('fingerprint')}, not "
                              f"{header['fingerprint']}; capture into another directory")
    for k in _RESUME_KEYS:
        had = old.get(k, _RESUME_DEFAULTS.get(k))
        if had != header[k]:
            raise DraftsmithError(f"{out_dir} holds a capture with {k}={had!r}, not {header[k]!r}; "
                                  "re-run with the same settings or capture into another directory")
    return {e["file"]: e for e in old.get("shards", [])}


def capture_to_shards(model: torch.nn.Module, tokenizer: Any, conversations: Iterable[Conversation],
                      out_dir: Path, *, fingerprint: str, verifier_spec: str,
                      aux_layer_ids: Sequence[int] | None = None, max_length: int = 2048, batch_size: int = 8,
                      samples_per_shard: int = 64, dtype: torch.dtype | str = torch.bfloat16,
                      trim_loops: bool = False, progress: bool = True) -> Path:
    """Capture every conversation into safetensors shards plus a manifest (format: module docstring).

    Shard ``k`` holds conversations ``[k*S, (k+1)*S)``; each shard is written
    atomically (temp file, fsync, rename) and the manifest is rewritten after it.
    A re-run with the same inputs and settings keeps the shards whose inputs and
    checksum match and computes the rest, giving byte-identical shards; a
    directory of another verifier or other settings is refused.

    Args:
        model: the verifier.
        tokenizer: its tokenizer.
        conversations: conversations with replies (e.g. :func:`load_regenerated`).
        out_dir: the capture directory (created or continued).
        fingerprint: the verifier's fingerprint (``load_verifier``), stored in every shard.
        verifier_spec: how the verifier was named (recorded for provenance).
        aux_layer_ids: HF ``hidden_states`` indices; default ``[2, n//2, n-3]``.
        max_length: tokens per sample (at most the verifier's context).
        batch_size: sequences per forward.
        samples_per_shard: conversations per shard.
        dtype: dtype of ``aux`` and ``last``.
        trim_loops: cut replies where they fall into a repetition loop (:func:`loop_cut`).
        progress: show a progress bar with tokens/s.

    Returns:
        ``out_dir``.

    Raises:
        DraftsmithError: empty dataset, no assistant turns, nothing fits, a directory
            of another capture, a corrupt manifest, or a failed write (disk full);
            completed shards always stay valid.
    """
    from tqdm.auto import tqdm

    from draftsmith import __version__

    if samples_per_shard < 1:
        raise DraftsmithError(f"--samples-per-shard must be >= 1, got {samples_per_shard}")
    convs = _conversation_list(conversations, "capture")
    plan = _plan(model, tokenizer, convs, aux_layer_ids, max_length, batch_size, dtype, trim_loops)
    out_dir = Path(out_dir)
    header = {
        "format": SHARD_FORMAT,
        "fingerprint": fingerprint,
        "verifier_spec": str(verifier_spec),
        "aux_layer_ids": plan.aux_layer_ids,
        "hidden_size": plan.hidden_size,
        "dtype": _dtype_name(plan.dtype),
        "max_length": plan.max_length,
        "samples_per_shard": samples_per_shard,
        "trim_loops": trim_loops,
        "config": {"batch_size": batch_size, "max_length_requested": max_length,
                   "num_layers": _text_config(model).num_hidden_layers,
                   "architectures": list(getattr(model.config, "architectures", None) or [type(model).__name__])},
        "draftsmith_version": __version__,
        "environment": environment_info(),
    }
    previous = _load_manifest_for_resume(out_dir, header)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(".shard-*"):  # temp files of a killed run (never renamed into place)
            stale.unlink()
    except OSError as e:
        raise _disk_error(e, out_dir) from e

    windows = range(0, len(convs), samples_per_shard)
    shards: list[dict[str, Any]] = []
    total = _Counts()
    bar = tqdm(total=len(convs), desc="capture", unit="conv", disable=not progress)
    t0, tokens_done = time.perf_counter(), 0
    try:
        for k, start in enumerate(windows):
            window = convs[start:start + samples_per_shard]
            name, digest = shard_name(k), _inputs_digest(window)
            old = previous.get(name)
            if old is not None and old.get("inputs_sha256") == digest and (out_dir / name).is_file() \
                    and _sha256_file(out_dir / name) == old.get("sha256"):
                shards.append(old)
                total.add(_Counts(**old["dropped"]))
                bar.update(len(window))
                continue
            if old is not None:
                log.warning("capture: recomputing %s (its inputs or checksum changed)", name)
            samples, ids, counts = _capture_window(model, tokenizer, plan, window)
            total.add(counts)
            tokens = sum(int(s["input_ids"].numel()) for s in samples)
            loss_tokens = sum(int(s["loss_mask"].sum()) for s in samples)
            meta = {"format": SHARD_FORMAT, "fingerprint": fingerprint, "aux_layer_ids": plan.aux_layer_ids,
                    "hidden_size": plan.hidden_size, "dtype": _dtype_name(plan.dtype), "shard": k,
                    "samples": len(samples), "ids": ids}
            sha, size = _write_shard(out_dir / name, samples, meta)
            shards.append({"file": name, "conversations": [start, start + len(window)], "inputs_sha256": digest,
                           "samples": len(samples), "tokens": tokens, "loss_tokens": loss_tokens,
                           "dropped": counts.as_dict(), "sha256": sha, "bytes": size})
            _write_manifest(out_dir, header, shards, total, complete=False)
            tokens_done += tokens
            bar.update(len(window))
            bar.set_postfix_str(f"{tokens_done / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    finally:
        bar.close()
    extra = sorted(set(previous) - {s["file"] for s in shards})
    if extra:
        log.warning("capture: %s no longer match the (shorter) input and are left out of the manifest",
                    ", ".join(extra))
    _write_manifest(out_dir, header, shards, total, complete=True)
    if not sum(s["samples"] for s in shards):
        raise _nothing_captured(len(convs), total, plan.max_length)
    if any(total.as_dict().values()):
        log.warning("capture: %s", _dropped_line(total.as_dict()))
    return out_dir


def _write_manifest(out_dir: Path, header: dict[str, Any], shards: list[dict[str, Any]], counts: _Counts,
                    complete: bool) -> None:
    manifest = {**header,
                "num_samples": sum(s["samples"] for s in shards),
                "total_tokens": sum(s["tokens"] for s in shards),
                "total_loss_tokens": sum(s["loss_tokens"] for s in shards),
                "dropped": counts.as_dict(),
                "complete": complete,
                "shards": shards}
    try:
        atomic_write_json(out_dir / MANIFEST, manifest)
    except OSError as e:
        raise _disk_error(e, out_dir / MANIFEST) from e


# ----------------------------------------------------------------------------- shards: reading
def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a capture directory, checked for shape.

    Raises:
        DraftsmithError: no manifest, unreadable or not a draftsmith capture manifest.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DraftsmithError(f"{directory} is not a capture directory: {MANIFEST} is missing (run capture first)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path} is corrupt or unreadable ({type(e).__name__}); re-run capture") from e
    if not isinstance(manifest, dict) or manifest.get("format") != SHARD_FORMAT or \
            not isinstance(manifest.get("shards"), list):
        raise DraftsmithError(f"{path} is not a draftsmith capture manifest (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {SHARD_FORMAT!r})")
    return manifest


def _foreign(where: Path | str, found: Any, expected: str) -> DraftsmithError:
    return DraftsmithError(f"shard {where} was captured from verifier {found}, not {expected} (the verifier "
                           "being trained for); capture again with this verifier")


def _shard_header(path: Path, data: bytes) -> dict[str, Any]:
    """The draftsmith metadata in a safetensors header, parsed without loading tensors."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        if size > len(data) - 8:
            raise ValueError("header runs past the end of the file")
        header = json.loads(data[8:8 + size])
        meta = json.loads(header["__metadata__"][_META_KEY])
        if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}")
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"shard {path} is corrupt or not a draftsmith shard ({e}); delete it and re-run "
                              "capture") from e
    return meta


def read_shard(path: Path, expected_fingerprint: str | None = None, sha256: str | None = None) -> list[dict]:
    """The samples of one shard file, after checking its provenance and integrity.

    Args:
        path: a ``shard-*.safetensors`` file.
        expected_fingerprint: refuse a shard of any other verifier.
        sha256: the checksum the manifest recorded (checked when given).

    Raises:
        DraftsmithError: naming the file, when it is foreign, corrupt, truncated or unreadable.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DraftsmithError(f"cannot read shard {path}: {e.strerror or e}") from e
    meta = _shard_header(path, data)  # provenance first: a foreign shard says so, not "checksum mismatch"
    if expected_fingerprint is not None and meta.get("fingerprint") != expected_fingerprint:
        raise _foreign(path, meta.get("fingerprint"), expected_fingerprint)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise DraftsmithError(f"shard {path} is corrupt: its checksum does not match the manifest (truncated or "
                              "modified); delete it and re-run capture to rebuild it")
    try:
        tensors = load(data)
    except SafetensorError as e:
        raise DraftsmithError(f"shard {path} is corrupt ({e}); delete it and re-run capture") from e
    try:
        return [{k: tensors[f"{i}.{k}"] for k in SAMPLE_KEYS} for i in range(int(meta["samples"]))]
    except KeyError as e:
        raise DraftsmithError(f"shard {path} is corrupt: tensor {e.args[0]} is missing") from e


def _check_directory(directory: Path, expected_fingerprint: str | None) -> dict[str, Any]:
    manifest = read_manifest(directory)
    if expected_fingerprint is not None and manifest.get("fingerprint") != expected_fingerprint:
        raise _foreign(f"directory {directory}", manifest.get("fingerprint"), expected_fingerprint)
    if not manifest.get("complete"):
        log.warning("%s: the capture did not finish (%d shards); using what it wrote", directory,
                    len(manifest["shards"]))
    return manifest


def load_shards(directory: Path, expected_fingerprint: str | None = None) -> Iterator[dict]:
    """Yield the samples of a capture directory, one shard in memory at a time.

    Args:
        directory: a :func:`capture_to_shards` output.
        expected_fingerprint: the verifier being trained for; ``None`` checks only
            that every shard agrees with the manifest.

    Raises:
        DraftsmithError: missing/corrupt manifest, a foreign shard or a corrupt one (named).
    """
    directory = Path(directory)
    manifest = _check_directory(directory, expected_fingerprint)
    for entry in manifest["shards"]:
        yield from read_shard(directory / entry["file"], manifest["fingerprint"], entry["sha256"])


def load_capture_dirs(directories: Sequence[Path | str],
                      expected_fingerprint: str | None = None) -> tuple[list[dict], list[int]]:
    """The samples of one or more capture directories, in order, and the verifier layers they hold.

    Several directories are trained on together: an earlier capture plus fresh replies, say
    (fresh regenerated replies beat another pass over old ones, BENCHMARKS.md section 3).

    Raises:
        DraftsmithError: no directory, one named twice, any that :func:`load_shards` refuses,
            or directories captured at different layers or hidden sizes (named).
    """
    dirs = [Path(d) for d in directories]
    if not dirs:
        raise DraftsmithError("no capture directory given")
    resolved = [d.resolve() for d in dirs]
    twice = sorted({str(d) for d, r in zip(dirs, resolved) if resolved.count(r) > 1})
    if twice:
        raise DraftsmithError(f"capture directory named more than once: {', '.join(twice)}")
    layouts = {d: (list(m["aux_layer_ids"]), int(m["hidden_size"]))
               for d, m in ((d, read_manifest(d)) for d in dirs)}
    if len({json.dumps(v) for v in layouts.values()}) > 1:
        raise DraftsmithError("capture directories hold different verifier layers, so they cannot be trained on "
                              "together: " + "; ".join(f"{d}: aux layers {a}, hidden size {h}"
                                                       for d, (a, h) in layouts.items()))
    samples = [s for d in dirs for s in load_shards(d, expected_fingerprint)]
    return samples, layouts[dirs[0]][0]


class ShardDataset(torch.utils.data.Dataset):
    """Random access to the samples of a capture directory (a ``torch`` Dataset).

    A shard is verified (provenance and checksum) the first time one of its
    samples is read; samples are then read from the memory-mapped file one at a
    time, so memory holds no more than the requested sample.

    Attributes:
        manifest: the directory's manifest.
        fingerprint: the verifier the samples were captured from.
        aux_layer_ids: the captured layers.
        hidden_size: the verifier's hidden size.
    """

    def __init__(self, directory: Path, fingerprint: str | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = _check_directory(self.directory, fingerprint)
        self.fingerprint: str = self.manifest["fingerprint"]
        self.aux_layer_ids: list[int] = list(self.manifest["aux_layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self._index = [(k, i) for k, e in enumerate(self.manifest["shards"]) for i in range(int(e["samples"]))]
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, k: int) -> Path:
        return self.directory / self.manifest["shards"][k]["file"]

    def _verify(self, k: int) -> None:
        if k in self._verified:
            return
        path, entry = self._path(k), self.manifest["shards"][k]
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                meta = _shard_header(path, head + f.read(min(size, 1 << 26)))
        except OSError as e:
            raise DraftsmithError(f"cannot read shard {path}: {e.strerror or e}") from e
        if meta.get("fingerprint") != self.fingerprint:
            raise _foreign(path, meta.get("fingerprint"), self.fingerprint)
        if _sha256_file(path) != entry["sha256"]:
            raise DraftsmithError(f"shard {path} is corrupt: its checksum does not match the manifest "
                                  "(truncated or modified); delete it and re-run capture to rebuild it")
        self._verified.add(k)

    def __getitem__(self, idx: int) -> dict:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        k, i = self._index[idx]
        self._verify(k)
        from safetensors import safe_open

        with safe_open(str(self._path(k)), framework="pt") as f:
            return {key: f.get_tensor(f"{i}.{key}") for key in SAMPLE_KEYS}

    def __iter__(self) -> Iterator[dict]:
        for k, entry in enumerate(self.manifest["shards"]):
            yield from read_shard(self._path(k), self.fingerprint, entry["sha256"])
            self._verified.add(k)


__all__ = ["MANIFEST", "SAMPLE_KEYS", "SHARD_FORMAT", "ShardDataset", "capture_samples", "capture_to_shards",
           "length_batches", "load_regenerated", "load_shards", "read_manifest", "read_shard", "regenerate",
           "resolve_aux_layer_ids", "right_padded", "sample_seed", "shard_name"]

