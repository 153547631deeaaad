"""Capture: the verifier's hidden states over its own conversations, what EAGLE-3 trains on.

:func:`capture_to_shards` runs the verifier once over each (prompt + reply) and
stores the samples in safetensors shards (:mod:`draftsmith.data.shards`), resumably;
:func:`capture_samples` yields the same samples without touching the disk (online
mode, when disk is the limit).

A *sample* is a dict of four tensors, for a conversation of ``T`` tokens, a
verifier of hidden size ``H`` and ``A`` aux layers:

- ``input_ids`` int64 ``[T]``;
- ``loss_mask`` bool ``[T]``, true on the assistant's tokens
  (:func:`~draftsmith.data.tokenize.tokenize_conversation`);
- ``aux`` ``[T, A*H]``: HF ``hidden_states[i]`` (the *input* of decoder layer
  ``i``) for ``i`` in ``aux_layer_ids``, concatenated in that order;
- ``last`` ``[T, H]``: the input of the verifier's ``lm_head`` (the final-normed
  hidden state), so ``logits = lm_head(last)``.

``aux`` and ``last`` are stored in a configurable dtype (bfloat16 by default).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from draftsmith.data.conversation import Conversation, require_conversations
from draftsmith.data.shards import SHARD_FORMAT, resume_entries, sha256_file, shard_name, write_manifest, write_shard
from draftsmith.data.tokenize import TokenizedConversation, TooLong, fit, tokenize_conversation
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import default_aux_layer_ids
from draftsmith.models.verifier import context_length, text_config
from draftsmith.utils import environment_info, progress_bar, resolve_dtype, write_error

log = logging.getLogger(__name__)

# Loop trimming (see loop_cut): an n-gram size, a window that must be this share repeated n-grams,
# and how many tokens of the loop stay in the sample.
LOOP_NGRAM, LOOP_WINDOW, LOOP_SHARE, LOOP_KEEP = 4, 32, 0.5, 32



def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_aux_layer_ids(model: torch.nn.Module, aux_layer_ids: Sequence[int] | None = None) -> list[int]:
    """The verifier layers to capture: ``aux_layer_ids`` or EAGLE-3's ``[2, n//2, n-3]``, validated.

    Raises:
        DraftsmithError: an id is not a decoder layer of the verifier (``0 <= i < n``).
    """
    n = text_config(model).num_hidden_layers
    ids = [int(i) for i in aux_layer_ids] if aux_layer_ids is not None else default_aux_layer_ids(n)
    if not ids or any(not 0 <= i < n for i in ids):
        hint = "" if aux_layer_ids is not None else " (the default [2, n//2, n-3] needs >= 4 layers; pass them)"
        raise DraftsmithError(f"aux layer ids {ids} out of range for a {n}-layer verifier{hint}")
    return ids



def _dropped_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v) or "none"



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
    return _Plan(ids, max_length, text_config(model).hidden_size, resolve_dtype(dtype, torch.device("cpu")),
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
        sample = fit(full, max_length, truncate=True)
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


def padded_tokens(lengths: Sequence[int], batch_size: int) -> int:
    """Positions the forwards of :func:`length_batches` process, padding included."""
    return sum(len(b) * max(lengths[i] for i in b) for b in length_batches(lengths, batch_size))


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
    device = next(model.parameters()).device
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


def _capture_window(model: torch.nn.Module, tokenizer: Any, plan: _Plan, convs: Sequence[Conversation],
                    on_batch: Callable[[int], None] | None = None) -> tuple[list[dict], list[str], _Counts]:
    """Samples of consecutive conversations, batched by length, returned in input order.

    ``on_batch(n)`` is told after each forward that ``n`` more conversations are done (the
    skipped ones with the first batch), so a progress bar moves per forward, not per window.
    """
    counts = _Counts()
    kept = [(c.id, s) for c in convs
            if (s := _tokenize(tokenizer, c, plan.max_length, counts, plan.trim_loops)) is not None]
    samples: list[dict | None] = [None] * len(kept)
    skipped = len(convs) - len(kept)
    for batch in length_batches([len(s.input_ids) for _, s in kept], plan.batch_size):
        for i, sample in zip(batch, _forward_batch(model, plan, [kept[i][1] for i in batch])):
            samples[i] = sample
        if on_batch is not None:
            on_batch(len(batch) + skipped)
            skipped = 0
    if on_batch is not None and skipped:
        on_batch(skipped)
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
        conversations: conversations with replies (e.g.
            :func:`~draftsmith.data.regenerate.load_regenerated`).
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
    convs = require_conversations(conversations, "capture")
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



def _inputs_digest(convs: Sequence[Conversation]) -> str:
    """Identity of a shard's input conversations: a resume must not mix two datasets."""
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.id, c.messages], sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\0")
    return h.hexdigest()



def capture_to_shards(model: torch.nn.Module, tokenizer: Any, conversations: Iterable[Conversation],
                      out_dir: Path, *, fingerprint: str, verifier_spec: str,
                      aux_layer_ids: Sequence[int] | None = None, max_length: int = 2048, batch_size: int = 8,
                      samples_per_shard: int = 64, dtype: torch.dtype | str = torch.bfloat16,
                      trim_loops: bool = False, progress: bool = True) -> Path:
    """Capture every conversation into safetensors shards plus a manifest (:mod:`draftsmith.data.shards`).

    Shard ``k`` holds conversations ``[k*S, (k+1)*S)``; each shard is written
    atomically (temp file, fsync, rename) and the manifest is rewritten after it.
    A re-run with the same inputs and settings keeps the shards whose inputs and
    checksum match and computes the rest, giving byte-identical shards; a
    directory of another verifier or other settings is refused.

    Args:
        model: the verifier.
        tokenizer: its tokenizer.
        conversations: conversations with replies (e.g.
            :func:`~draftsmith.data.regenerate.load_regenerated`).
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
    from draftsmith import __version__

    if samples_per_shard < 1:
        raise DraftsmithError(f"--samples-per-shard must be >= 1, got {samples_per_shard}")
    convs = require_conversations(conversations, "capture")
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
                   "num_layers": text_config(model).num_hidden_layers,
                   "architectures": list(getattr(model.config, "architectures", None) or [type(model).__name__])},
        "draftsmith_version": __version__,
        "environment": environment_info(),
    }
    previous = resume_entries(out_dir, header)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(".shard-*"):  # temp files of a killed run (never renamed into place)
            stale.unlink()
    except OSError as e:
        raise write_error(e, out_dir, "completed shards") from e

    windows = range(0, len(convs), samples_per_shard)
    shards: list[dict[str, Any]] = []
    total = _Counts()
    bar = progress_bar(len(convs), "capture", "conv", progress)
    t0, tokens_done = time.perf_counter(), 0
    try:
        for k, start in enumerate(windows):
            window = convs[start:start + samples_per_shard]
            name, digest = shard_name(k), _inputs_digest(window)
            old = previous.get(name)
            if old is not None and old.get("inputs_sha256") == digest and (out_dir / name).is_file() \
                    and sha256_file(out_dir / name) == old.get("sha256"):
                shards.append(old)
                total.add(_Counts(**old["dropped"]))
                bar.update(len(window))
                continue
            if old is not None:
                log.warning("capture: recomputing %s (its inputs or checksum changed)", name)
            samples, ids, counts = _capture_window(model, tokenizer, plan, window, on_batch=bar.update)
            total.add(counts)
            tokens = sum(int(s["input_ids"].numel()) for s in samples)
            loss_tokens = sum(int(s["loss_mask"].sum()) for s in samples)
            meta = {"format": SHARD_FORMAT, "fingerprint": fingerprint, "aux_layer_ids": plan.aux_layer_ids,
                    "hidden_size": plan.hidden_size, "dtype": _dtype_name(plan.dtype), "shard": k,
                    "samples": len(samples), "ids": ids}
            sha, size = write_shard(out_dir / name, samples, meta)
            shards.append({"file": name, "conversations": [start, start + len(window)], "inputs_sha256": digest,
                           "samples": len(samples), "tokens": tokens, "loss_tokens": loss_tokens,
                           "dropped": counts.as_dict(), "sha256": sha, "bytes": size})
            write_manifest(out_dir, header, shards, total.as_dict(), complete=False)
            tokens_done += tokens
            bar.set_postfix_str(f"{tokens_done / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    finally:
        bar.close()
    extra = sorted(set(previous) - {s["file"] for s in shards})
    if extra:
        log.warning("capture: %s no longer match the (shorter) input and are left out of the manifest",
                    ", ".join(extra))
    write_manifest(out_dir, header, shards, total.as_dict(), complete=True)
    if not sum(s["samples"] for s in shards):
        raise _nothing_captured(len(convs), total, plan.max_length)
    if any(total.as_dict().values()):
        log.warning("capture: %s", _dropped_line(total.as_dict()))
    return out_dir



__all__ = ["LOOP_KEEP", "LOOP_NGRAM", "LOOP_SHARE", "LOOP_WINDOW", "capture_samples", "capture_to_shards",
           "length_batches", "loop_cut", "resolve_aux_layer_ids", "right_padded"]
