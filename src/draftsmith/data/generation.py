"""Batched generation with the verifier, shared by regeneration and self-written prompts.

:func:`generate_batch` decodes several left-padded prompts together, through the lean
forward over a batched cache (rows leave the batch as their replies end) or one HF
``generate`` call; with sampling, each row draws from its own generator seeded by :func:`sample_seed`,
so a reply does not depend on which rows share its batch or on a resume.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Protocol, Sequence

import torch

from draftsmith.decoding.sampling import SamplingParams, logits_to_probs
from draftsmith.errors import DraftsmithError
from draftsmith.models.kv import KVCache


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


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """The tokens that end a reply: the generation config's and the tokenizer's end-of-sequence ids.

    Raises:
        DraftsmithError: the verifier names none.
    """
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


def pad_id(tokenizer: Any, eos: Sequence[int]) -> int:
    """The padding token: the tokenizer's, else the first end-of-sequence token."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else int(eos[0])


class TokenProgress:
    """A transformers streamer that moves a progress bar per generated token of a batch.

    The bar counts *token slots*: ``max_new_tokens`` per reply. Each decode step adds
    one per reply still running; a reply that stops early adds its unused slots at once.
    So a batch always adds exactly ``batch * max_new_tokens``, the bar ends exactly at
    its total, and it moves on every decode step instead of once per batch.
    """

    def __init__(self, bar: Any, batch: int, max_new_tokens: int, eos: Sequence[int]) -> None:
        self.bar, self.max_new, self.eos = bar, max_new_tokens, set(eos)
        self.steps, self.running, self.prompt_seen = 0, [True] * batch, False
        self.added = 0

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands the prompts over first
            self.prompt_seen = True
            return
        tokens = value.reshape(len(self.running), -1)[:, -1].tolist()
        self.steps += 1
        n = 0
        for b, tok in enumerate(tokens):
            if not self.running[b]:
                continue
            n += 1
            if tok in self.eos:  # this reply is over: its unused slots are done too
                self.running[b] = False
                n += self.max_new - self.steps
        self._add(n)

    def end(self) -> None:
        self._add(len(self.running) * self.max_new - self.added)

    def _add(self, n: int) -> None:
        if n > 0:
            self.added += n
            self.bar.update(n)


def generate_batch(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
                   max_new_tokens: int, eos: list[int], pad: int, bar: Any = None,
                   engine: str = "auto", batch_size: int | None = None) -> list[tuple[list[int], str]]:
    """Replies to ``prompts``: ``(token ids without eos, finish reason)``, in the prompts' order.

    At most ``batch_size`` (None: all) prompts decode together. Two engines, the same
    replies up to rounding:

    - ``lean`` (``auto`` picks it for every model the lean forward supports,
      :func:`~draftsmith.models.lean.lean_unsupported`; like the decoding engine, it calls
      the modules' forwards, not their hooks): continuous batching.
      :meth:`LeanDecoder.forward_batch` steps ``batch_size`` rows over a preallocated
      :class:`~draftsmith.models.kv.BatchKVCache`; each prompt is prefilled on its own
      (no padding computed) and put into a free row, and when a reply ends its row takes
      the next prompt, so every step runs a full batch until the prompts run out. Rows
      leave the batch only then. The schedule depends only on the prompts and
      ``batch_size``: the same call gives the same replies.
    - ``hf``: one transformers ``generate`` call per ``batch_size`` prompts, left-padded.

    ``bar``: a progress bar in token slots (``max_new_tokens`` per reply), moved per decode step.
    """
    if engine not in ("auto", "lean", "hf"):
        raise DraftsmithError(f"generation engine must be auto, lean or hf; got {engine!r}")
    if batch_size is not None and batch_size < 1:
        raise DraftsmithError(f"batch size must be >= 1, got {batch_size}")
    size = max(1, min(batch_size or len(prompts), len(prompts)))
    if engine != "hf":
        from draftsmith.models.lean import lean_unsupported

        why = lean_unsupported(model)
        if why is None:
            return _lean_batch(model, prompts, seeds, params, max_new_tokens, eos, bar, size)
        if engine == "lean":
            raise DraftsmithError(f"the lean generation engine cannot run this verifier: {why}")
    out: list[tuple[list[int], str]] = []
    for i in range(0, len(prompts), size):
        out += _hf_batch(model, prompts[i:i + size], seeds[i:i + size], params, max_new_tokens, eos, pad, bar)
    return out


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, W], attention mask [B, W])``, left-padded: every prompt ends where generation starts."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask


def _lean_batch(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
                max_new_tokens: int, eos: list[int], bar: Any, size: int) -> list[tuple[list[int], str]]:
    from draftsmith.models.lean import LeanDecoder

    dec = LeanDecoder(model)
    device = dec.device
    gens = None if params.greedy else [torch.Generator(device=device).manual_seed(s) for s in seeds]
    stop = set(eos)
    replies: list[list[int]] = [[] for _ in prompts]
    reasons = ["length"] * len(prompts)
    queue = iter(range(len(prompts)))

    def pick(logits: torch.Tensor, rows: list[int]) -> list[int]:
        if gens is None:
            return logits.argmax(-1).tolist()
        # each row draws from its own generator, as _PerSampleSampler does for generate
        cdf = logits_to_probs(logits.float(), params).cumsum(-1)
        u = torch.cat([torch.rand(1, generator=gens[r], device=device) for r in rows])
        return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(
            max=cdf.shape[-1] - 1)[:, 0].tolist()

    def took(r: int, tok: int) -> bool:
        """Record prompt r's next token; True while its reply goes on."""
        if tok in stop:
            reasons[r] = "stop"
            slots = max_new_tokens - len(replies[r])  # this token's slot and the unused ones
        else:
            replies[r].append(tok)
            slots = 1
        if bar is not None:
            bar.update(slots)
        return tok not in stop and len(replies[r]) < max_new_tokens

    def prefill(r: int) -> KVCache | None:
        """Prompt r on its own: its cache when its reply goes on past the first token, else None."""
        ids = torch.tensor(prompts[r], dtype=torch.long, device=device)
        single = dec.new_cache(len(ids))
        logits, _ = dec.forward(ids, torch.arange(len(ids), device=device), single, keep=1)
        single.advance(len(ids))
        return single if took(r, pick(logits, [r])[0]) else None

    def next_prompt() -> tuple[int, KVCache] | None:
        for r in queue:
            single = prefill(r)
            if single is not None:
                return r, single
        return None

    rows: list[int] = []  # the prompt each row of the cache decodes
    cache = None
    with torch.inference_mode():
        while len(rows) < size:  # the first rows
            got = next_prompt()
            if got is None:
                break
            if cache is None:
                longest = max(len(p) for p in prompts)
                cache = dec.new_batch_cache([0] * size, longest + max_new_tokens + max(16, max_new_tokens // 4))
            cache.admit(len(rows), got[1])
            rows.append(got[0])
        if cache is not None and len(rows) < size:
            cache.keep(range(len(rows)))
        while rows:
            step_ids = torch.tensor([[replies[r][-1]] for r in rows], dtype=torch.long, device=device)
            tokens = pick(dec.forward_batch(step_ids, cache), rows)
            free = [j for j, (r, tok) in enumerate(zip(rows, tokens)) if not took(r, tok)]
            gone = []
            for j in free:  # a finished row takes the next prompt; none left: it leaves the batch
                got = next_prompt()
                if got is None:
                    gone.append(j)
                else:
                    cache.admit(j, got[1])
                    rows[j] = got[0]
            if gone:
                ended = set(gone)
                going = [j for j in range(len(rows)) if j not in ended]
                if going:
                    cache.keep(going)
                rows = [rows[j] for j in going]
    return list(zip(replies, reasons))


def _hf_batch(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
              max_new_tokens: int, eos: list[int], pad: int, bar: Any) -> list[tuple[list[int], str]]:
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    ids, mask = _left_padded(prompts, pad)
    width = ids.shape[1]
    processors = LogitsProcessorList()
    if not params.greedy:
        gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        processors.append(_PerSampleSampler(params, gens))
    # A fresh config: the model's own generation_config may carry sampling defaults or penalties.
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    streamer = TokenProgress(bar, len(prompts), max_new_tokens, eos) if bar is not None else None
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             logits_processor=processors, streamer=streamer)
    results = []
    stop = set(eos)
    for row in out[:, width:].tolist():
        end = next((j for j, t in enumerate(row) if t in stop), None)
        results.append((row, "length") if end is None else (row[:end], "stop"))
    return results


Reply = tuple[list[int], str]  # (token ids without the end-of-sequence token, finish reason)


class ReplySource(Protocol):
    """Where regeneration's replies come from when not from the in-process verifier.

    Attributes:
        engine: recorded as ``meta.generation.engine`` (a resume with another source is refused).
    """

    engine: str

    def replies(self, batches: list[tuple[list[list[int]], list[int]]], params: SamplingParams,
                max_new_tokens: int, eos: list[int]) -> Iterator[list[Reply]]:
        """The replies to each ``(prompts, sampling seeds)`` batch, one list per batch, in order."""
        ...
