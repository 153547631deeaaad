"""Training prompts written by the verifier itself (the ``self`` prompt source).

A chat model that was tuned on instruction data has learned what its users ask.
Given only the chat template's opening of a user turn (system prompt included,
if the template adds one) and sampled, it writes such a request and ends the
turn with its end-of-turn token. This is the idea of Magpie (Xu et al., 2024,
"Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"). For draftsmith it has two uses:

- a prompt source that never runs out: a dataset's train split does (the
  ShareGPT one did, BENCHMARKS.md section 3);
- prompts from the verifier's own distribution, for a fine-tune whose users
  are not ShareGPT's, when the user has no prompts of their own.

The verifier then answers them like any other prompt (``regenerate``).

Every attempt is kept, in order, in a JSONL file that is appended and fsynced
per batch; an interrupted run resumes after the last complete attempt, with
the same batches, so its result equals an uninterrupted run's. The attempts
are then filtered in order (unfinished, empty or very short requests,
duplicates and held-out evaluation prompts are dropped) until ``n`` are kept.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.conversation import Conversation, normalize_text
from draftsmith.data.generation import eos_ids, generate_batch, pad_id, sample_seed
from draftsmith.data.sources import remove_eval_overlap
from draftsmith.data.tokenize import render_chat, text_ids
from draftsmith.decoding.sampling import SamplingParams
from draftsmith.errors import DraftsmithError
from draftsmith.utils import complete_lines, progress_bar, write_error

SELF_DATASET = "self"
#: Sampling for the requests (not the replies): Magpie samples at temperature 1;
#: a top-p of 0.95 cuts the tail that turns a 135M model's requests into noise.
TEMPERATURE = 1.0
TOP_P = 0.95
MAX_REQUEST_TOKENS = 128
MIN_REQUEST_CHARS = 12
_MARKER = "\u2063draftsmith-user-text\u2063"


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user's text starts.

    Raises:
        DraftsmithError: the template does not reproduce the user's text verbatim.
    """
    text = render_chat(tokenizer, [{"role": "user", "content": _MARKER}])
    at = text.find(_MARKER)
    if at < 0:
        raise DraftsmithError("the verifier's chat template does not copy a user's text verbatim, so the "
                              "verifier cannot be asked to write prompts; use a prompt dataset instead")
    ids = text_ids(tokenizer, text[:at])
    if not ids:
        raise DraftsmithError("the verifier's chat template puts nothing before a user's text; cannot ask the "
                              "verifier to write prompts (use a prompt dataset instead)")
    return ids


def _read_attempts(path: Path, generation: dict[str, Any], first: int) -> list[dict[str, Any]]:
    """The attempts already in ``path`` (a torn last line is cut off), checked against the settings."""
    rows: list[dict[str, Any]] = []
    for n, raw in enumerate(complete_lines(path), start=1):
        try:
            rec = json.loads(raw)
            index, gen = int(rec["index"]), rec["generation"]
            str(rec["text"]), str(rec["finish_reason"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
            raise DraftsmithError(f"{path} line {n} is not a prompt attempt ({type(e).__name__}); the file is "
                                  "corrupt or not draftsmith's: use another output path") from e
        if gen != generation:
            changed = sorted(k for k in set(gen) | set(generation) if gen.get(k) != generation.get(k))
            raise DraftsmithError(f"{path} was written with other settings ({', '.join(changed)} differ); use "
                                  "another output path or the same settings")
        if index != first + len(rows):
            raise DraftsmithError(f"{path} line {n} holds attempt {index}, expected {first + len(rows)}; the "
                                  "file is not one run's: use another output path")
        rows.append(rec)
    return rows


def select_prompts(attempts: list[dict[str, Any]], n: int) -> tuple[list[Conversation], dict[str, int]]:
    """The first ``n`` usable requests among ``attempts`` (in order) and why the others were dropped.

    Dropped: unfinished (no end-of-turn within the token limit), shorter than
    ``MIN_REQUEST_CHARS`` after stripping, a duplicate of an earlier request
    (after :func:`~draftsmith.data.conversation.normalize_text`), or overlapping a
    held-out evaluation set (:func:`~draftsmith.data.sources.remove_eval_overlap`).
    """
    counts = {"attempts": 0, "unfinished": 0, "too_short": 0, "duplicate": 0, "eval_overlap": 0}
    kept: list[Conversation] = []
    seen: set[str] = set()
    for rec in attempts:
        if len(kept) >= n:
            break
        counts["attempts"] += 1
        text = rec["text"].strip()
        if rec["finish_reason"] != "stop":
            counts["unfinished"] += 1
            continue
        if len(text) < MIN_REQUEST_CHARS:
            counts["too_short"] += 1
            continue
        key = normalize_text(text)
        if key in seen:
            counts["duplicate"] += 1
            continue
        seen.add(key)
        conv = Conversation([{"role": "user", "content": text}], id=f"self-{rec['index']}", source=SELF_DATASET,
                            meta={"self_prompt_index": rec["index"]})
        if remove_eval_overlap([conv])[1]:
            counts["eval_overlap"] += 1
            continue
        kept.append(conv)
    counts["kept"] = len(kept)
    return kept, counts


def write_self_prompts(model: torch.nn.Module, tokenizer: Any, n: int, attempts_path: Path, *, seed: int = 0,
                       skip: int = 0, batch_size: int = 64, max_attempts: int | None = None,
                       progress: bool = True, fingerprint: str | None = None) -> tuple[list[Conversation],
                                                                                     dict[str, int]]:
    """Ask the verifier for ``n`` usable user requests (see the module docstring).

    Args:
        model: the verifier.
        tokenizer: its tokenizer (with a chat template).
        n: requests wanted.
        attempts_path: the JSONL file of every attempt (created or continued).
        seed: salts each attempt's sampling seed (``sample_seed(seed, "self-<index>")``).
        skip: the first attempt's index: an earlier run that used attempts ``0..skip-1``
            gets fresh requests next to it.
        batch_size: attempts per ``generate`` call.
        max_attempts: give up after this many (default ``4 n + batch_size``).
        progress: show a progress bar.
        fingerprint: the verifier's fingerprint (a resume with another verifier is refused).

    Returns:
        ``(conversations, counts)``: the kept requests as one-turn conversations with
        ids ``self-<index>``, and the counts of :func:`select_prompts` plus ``next_skip``
        (the ``skip`` at which a later run's attempts are all new).

    Raises:
        DraftsmithError: bad arguments, a file written with other settings, fewer than
            ``n`` usable requests within ``max_attempts``, or a write failure (finished
            attempts stay in the file).
    """
    if n < 1:
        raise DraftsmithError(f"the number of prompts must be >= 1, got {n}")
    if skip < 0 or batch_size < 1:
        raise DraftsmithError(f"skip must be >= 0 and batch size >= 1, got {skip} and {batch_size}")
    limit = max_attempts if max_attempts is not None else 4 * n + batch_size
    prefix = user_turn_prefix(tokenizer)
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)
    generation = {"temperature": TEMPERATURE, "top_p": TOP_P, "max_new_tokens": MAX_REQUEST_TOKENS, "seed": seed,
                  "batch_size": batch_size, "verifier": fingerprint}
    attempts_path = Path(attempts_path)
    attempts = _read_attempts(attempts_path, generation, skip)
    kept, counts = select_prompts(attempts, n)
    eos = eos_ids(model, tokenizer)
    pad = pad_id(tokenizer, eos)
    attempts_path.parent.mkdir(parents=True, exist_ok=True)
    bar = progress_bar(n, "self-prompts", "prompt", progress, initial=len(kept))
    t0 = time.perf_counter()
    try:
        with open(attempts_path, "ab") as f:
            while len(kept) < n and len(attempts) < limit:
                # Batches are aligned on multiples of batch_size from `skip`, so a resumed run
                # regenerates a torn batch whole and draws exactly what the first run drew.
                start = skip + (len(attempts) // batch_size) * batch_size
                indices = list(range(start, start + batch_size))
                outs = generate_batch(model, [prefix] * len(indices),
                                      [sample_seed(seed, f"self-{i}") for i in indices], params,
                                      MAX_REQUEST_TOKENS, eos, pad)
                lines = []
                for i, (ids, reason) in zip(indices, outs):
                    if i < skip + len(attempts):
                        continue
                    rec = {"index": i, "text": tokenizer.decode(ids, skip_special_tokens=True),
                           "finish_reason": reason, "tokens": len(ids), "generation": generation}
                    attempts.append(rec)
                    lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                f.write("".join(lines).encode())
                f.flush()
                os.fsync(f.fileno())
                before = len(kept)
                kept, counts = select_prompts(attempts, n)
                bar.update(len(kept) - before)
                bar.set_postfix_str(f"{len(attempts)} attempts, {time.perf_counter() - t0:.0f} s")
    except OSError as e:
        raise write_error(e, attempts_path, f"the {len(attempts)} finished attempts") from e
    finally:
        bar.close()
    counts["next_skip"] = skip + len(attempts)
    if len(kept) < n:
        raise DraftsmithError(
            f"the verifier wrote only {len(kept)} usable prompts of the {n} asked in {len(attempts)} attempts "
            f"({counts['unfinished']} unfinished, {counts['too_short']} too short, {counts['duplicate']} "
            f"duplicates, {counts['eval_overlap']} overlapping evaluation sets); ask for fewer, or use a prompt "
            "dataset")
    return kept, counts
