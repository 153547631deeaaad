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
                   engine: str = "auto") -> list[tuple[list[int], str]]:
    """Replies to ``prompts``, decoded together: ``(token ids without eos, finish reason)``.

    Two engines, the same replies up to rounding (the prompts are left-padded in both):

    - ``lean`` (``auto`` picks it for every model the lean forward supports,
      :func:`~draftsmith.models.lean.lean_unsupported`; like the decoding engine, it calls
      the modules' forwards, not their hooks): :meth:`LeanDecoder.forward_batch`
      over a preallocated :class:`~draftsmith.models.kv.BatchKVCache`; a row that has
      ended leaves the batch, so a batch costs its replies' tokens, not B times its
      longest reply, and no cache is concatenated per step.
    - ``hf``: one transformers ``generate`` call.

    ``bar``: a progress bar in token slots (``max_new_tokens`` per reply), moved per decode step.
    """
    if engine not in ("auto", "lean", "hf"):
        raise DraftsmithError(f"generation engine must be auto, lean or hf; got {engine!r}")
    if engine != "hf":
        from draftsmith.models.lean import lean_unsupported

        why = lean_unsupported(model)
        if why is None:
            return _lean_batch(model, prompts, seeds, params, max_new_tokens, eos, pad, bar)
        if engine == "lean":
            raise DraftsmithError(f"the lean generation engine cannot run this verifier: {why}")
    return _hf_batch(model, prompts, seeds, params, max_new_tokens, eos, pad, bar)


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
                max_new_tokens: int, eos: list[int], pad: int, bar: Any) -> list[tuple[list[int], str]]:
    from draftsmith.models.lean import LeanDecoder

    dec = LeanDecoder(model)
    device = dec.device
    B = len(prompts)
    ids, _ = _left_padded(prompts, pad)
    width = ids.shape[1]
    cache = dec.new_batch_cache([width - len(p) for p in prompts], width + max_new_tokens)
    gens = None if params.greedy else [torch.Generator(device=device).manual_seed(s) for s in seeds]
    stop = set(eos)
    replies: list[list[int]] = [[] for _ in prompts]
    reasons = ["length"] * B
    rows = list(range(B))  # the prompt index of each row of the cache
    step_ids = ids.to(device)
    with torch.inference_mode():
        for step in range(max_new_tokens):
            logits = dec.forward_batch(step_ids, cache)  # [len(rows), V]
            if gens is None:
                tokens = logits.argmax(-1).tolist()
            else:  # each row draws from its own generator, as _PerSampleSampler does for generate
                cdf = logits_to_probs(logits.float(), params).cumsum(-1)
                u = torch.cat([torch.rand(1, generator=gens[r], device=device) for r in rows])
                tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(
                    max=cdf.shape[-1] - 1)[:, 0].tolist()
            going, slots = [], 0
            for j, (r, tok) in enumerate(zip(rows, tokens)):
                slots += 1
                if tok in stop:
                    reasons[r] = "stop"
                    slots += max_new_tokens - step - 1  # its unused slots are done too
                else:
                    replies[r].append(tok)
                    going.append(j)
            if bar is not None:
                bar.update(slots)
            if not going or step == max_new_tokens - 1:
                break
            if len(going) < len(rows):
                cache.keep(going)
                rows = [rows[j] for j in going]
            step_ids = torch.tensor([[tokens[j]] for j in going], dtype=torch.long, device=device)
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
