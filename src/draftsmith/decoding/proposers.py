"""Drafters ("proposers") that suggest the next k tokens for the verifier to check.

A proposer declares what it needs from the verifier in its class attributes,
following transformers' ``CandidateGenerator`` idea: an EAGLE-3 draft sets
``requires_hidden_states = True`` and names the verifier layers it reads, and
the engine then hands it those hidden states from the verification forward it
already runs (no second verifier pass). Signatures never widen per drafter.
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from draftsmith.decoding.runner import CAPACITY_BUCKET, CompiledFn, VerifierRunner, weights_version
from draftsmith.decoding.sampling import SamplingParams, logits_to_probs, sample
from draftsmith.errors import DraftsmithError
from draftsmith.models.cpu_linear import argmax
from draftsmith.models.kv import KVCache
from draftsmith.models.quantize import output_vocab_size

log = logging.getLogger(__name__)

#: A freshly compiled draft step is checked against the eager one on one input; beyond this
#: fraction of the logits' largest magnitude it is not used (int8 rounding: ~0.5%; the stale
#: graph of BENCHMARKS 9v: >300%). A wrong draft step never changes output, only acceptance,
#: so nothing else would notice.
COMPILED_DRAFT_TOLERANCE = 0.05

if TYPE_CHECKING:
    from draftsmith.models.eagle3 import Eagle3Draft


@dataclass
class DraftContext:
    """What the engine shows a proposer before each round.

    Attributes:
        tokens: ``[T]`` prompt + generated tokens. The last one is the pending
            token: sampled, but not yet fed through the verifier.
        hidden_states: ``[m, A*H]`` for proposers with ``requires_hidden_states``:
            the verifier's hidden states (layers ``aux_layer_ids``, concatenated)
            at positions ``T-1-m .. T-2``, i.e. the positions verified since the
            previous call. Row j belongs to the position whose next token is
            ``tokens[T-m+j]``. None for other proposers.
    """

    tokens: torch.Tensor
    hidden_states: torch.Tensor | None = None


@dataclass
class Proposal:
    """Drafted tokens ``[k']`` (k' <= k, possibly 0) and their draft distributions.

    ``probs`` is ``[k', V]`` after the shared sampling transform, or None for a
    deterministic drafter (its q is the one-hot of the proposed token).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


class Proposer(abc.ABC):
    """Interface of every drafter the engine can use."""

    #: The engine must return the verifier's hidden states at ``aux_layer_ids``.
    requires_hidden_states: ClassVar[bool] = False
    #: Indices into the verifier's ``hidden_states`` tuple (0 = embeddings, i = output of layer i-1).
    aux_layer_ids: tuple[int, ...] = ()
    #: Seconds the last :meth:`prepare` spent compiling (reported apart from decoding time).
    compile_seconds: float = 0.0

    def reset(self) -> None:
        """Forget all per-sequence state; called once at the start of ``generate``."""

    def prepare(self, max_length: int, compile: bool = False, num_draft_tokens: int = 1) -> None:
        """Get ready for a sequence of at most ``max_length`` positions (drafts included):
        preallocate caches and, with ``compile``, compile the draft step (for rounds of up to
        ``num_draft_tokens`` drafted tokens). Called by ``generate`` after :meth:`reset`, before its
        clock starts; a drafter that is not prepared (e.g. behind a wrapper) must still work, growing
        its caches as needed."""

    def check_compatible(self, verifier: torch.nn.Module) -> None:
        """Raise :class:`DraftsmithError` if this drafter cannot serve ``verifier``."""

    @abc.abstractmethod
    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Draft up to ``k`` tokens continuing ``ctx.tokens``."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) and propose what followed it.

    Deterministic and model-free; pays off on inputs that repeat (code edits,
    summaries, quoting) and costs nothing when there is no match (0 drafts).

    With ``adaptive`` (the default) the draft length follows how the previous
    draft fared, because a rejected draft is not free: verifying k + 1 tokens
    costs more than one (about 2x at k = 10 for SmolLM2-135M on a CPU). After a
    draft whose first n tokens were accepted and the next rejected, at most
    n + 1 tokens are proposed; after a fully accepted draft the cap doubles, up
    to the ``k`` the engine asks for. The proposer reads the outcome from the
    context it is shown next, so the engine needs no feedback channel. With
    ``adaptive=False`` every match proposes k tokens (as transformers' prompt
    lookup does).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, adaptive: bool = True) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise DraftsmithError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram, self.adaptive = max_ngram, min_ngram, adaptive
        self.reset()

    def reset(self) -> None:
        self.cap: int | None = None  # adaptive draft-length cap; None: whatever k the engine asks
        self._last: tuple[int, torch.Tensor] | None = None  # (context length, draft) of the last proposal

    def _learn(self, tokens: torch.Tensor) -> None:
        """Update the cap from how many tokens of the last draft the context now continues with."""
        if self._last is None:
            return
        start, draft = self._last
        got = tokens[start: start + draft.shape[0]]
        m = got.shape[0]
        mismatch = (got != draft[:m]).nonzero()
        n = int(mismatch[0]) if mismatch.numel() else m
        if n >= draft.shape[0]:
            self.cap = None if self.cap is None else 2 * self.cap
        else:
            self.cap = n + 1
        self._last = None

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        # matched on the host: on a GPU each size's nonzero() would be a sync of its own, one copy is one
        tokens = ctx.tokens if ctx.tokens.device.type == "cpu" else ctx.tokens.cpu()
        T = tokens.shape[0]
        if self.adaptive:
            self._learn(tokens)
            if self.cap is not None and self.cap < k:
                k = self.cap
            else:
                self.cap = None  # grown back to (or past) what the engine asks: no cap
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            # windows[i] = tokens[i : i+n], for starts i whose continuation lies before the suffix
            windows = tokens[: T - 1].unfold(0, n, 1)  # [T-n, n]
            hits = (windows == tokens[T - n:]).all(-1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n  # latest occurrence
                draft = tokens[start: min(start + k, T)]
                if draft.numel():
                    if self.adaptive:
                        self._last = (T, draft.clone())
                    return Proposal(draft.to(ctx.tokens.device))
        return Proposal(ctx.tokens[:0])


class DraftModelProposer(Proposer):
    """A smaller causal LM sharing the verifier's tokenizer, with its own KV cache.

    The cache is rolled back lazily: before drafting, it keeps the longest prefix it
    shares with the current context, then the new context tokens are fed. It runs on
    the same runner as the verifier (:func:`~draftsmith.decoding.runner.verifier_runner`):
    lean forward and preallocated cache where the model allows.
    """

    def __init__(self, draft_model: torch.nn.Module) -> None:
        self.model = draft_model.eval()
        self.runner: VerifierRunner | None = None
        self.reset()

    def reset(self) -> None:
        if self.runner is not None:
            self.runner.rollback(0)
        self.seen = torch.empty(0, dtype=torch.long)  # tokens whose keys/values are cached

    def prepare(self, max_length: int, compile: bool = False, num_draft_tokens: int = 1) -> None:
        from draftsmith.decoding.runner import verifier_runner

        if self.runner is not None:
            self.runner.close()
        self.runner = verifier_runner(self.model, max_length, compile=compile, warmup_shapes=(1,), role="draft")
        self.compile_seconds = self.runner.compile_seconds

    def check_compatible(self, verifier: torch.nn.Module) -> None:
        dv, vv = output_vocab_size(self.model), output_vocab_size(verifier)
        if dv != vv:
            raise DraftsmithError(
                f"draft model vocabulary ({dv}) differs from the verifier's ({vv}); "
                "a draft model must share the verifier's tokenizer")

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        tokens = ctx.tokens
        if self.runner is None:  # not prepared: a cache that grows as needed
            self.prepare(2 * (tokens.shape[0] + k))
        runner = self.runner
        seen = self.seen.to(tokens.device)
        m = min(seen.shape[0], tokens.shape[0] - 1)  # always re-feed at least the pending token
        diff = (seen[:m] != tokens[:m]).nonzero()
        keep = int(diff[0]) if diff.numel() else m
        runner.rollback(min(keep, runner.length))
        runner.reserve(tokens.shape[0] + k)
        logits = runner.forward(tokens[keep:], 1)[0][-1]
        drafted, probs = [], []
        for i in range(k):
            q = logits_to_probs(logits, sampling)
            tok = q.argmax(-1) if sampling.greedy else sample(q, generator)
            drafted.append(tok)
            probs.append(q)
            if i + 1 < k:
                logits = runner.forward(tok.reshape(1), 1)[0][-1]
        draft = torch.stack(drafted)
        self.seen = torch.cat([tokens, draft[:-1]])
        return Proposal(draft, None if sampling.greedy else torch.stack(probs))


class Eagle3Proposer(Proposer):
    """Drafts with an :class:`~draftsmith.models.eagle3.Eagle3Draft`, fed by the verifier's aux hidden states.

    The verifier states arrive with each call (from the verification forward the
    engine already ran); the draft keeps its own preallocated KV cache and rolls it
    back to the verified prefix at the start of every round by moving its index.

    With ``min_confidence`` a round's draft stops early: token i is proposed only while
    the draft's own probability that tokens 1..i all pass, the product of its top
    probabilities so far, is at least ``min_confidence[i-1]`` (a number: the same at
    every position; the last entry repeats). An unsure draft then proposes fewer
    tokens, or none (the round is a plain one-token step), and the verifier checks
    only what is likely to pass: with
    :func:`~draftsmith.bench.costmodel.confidence_thresholds` from the step prices, the
    tokens whose expected gain exceeds what verifying them costs. Output is
    unchanged: which tokens are proposed never changes what the verifier accepts
    (greedy), nor, since the rule reads the draft's own distribution only, the
    distribution of sampled output.
    """

    requires_hidden_states = True

    def __init__(self, draft: "Eagle3Draft", min_confidence: float | Sequence[float] = 0.0) -> None:
        self.draft = draft.eval()
        self.min_confidence = min_confidence
        self.aux_layer_ids = tuple(draft.config.aux_layer_ids)
        self.cache: KVCache | None = None
        self._compiled: Any = None  # the compiled draft step, kept across prompts
        self._compiled_version: tuple[int, ...] = ()  # the draft's weights_version when it was compiled
        self._fused: tuple | None = None  # Eagle3Draft.fused_args, read by prepare
        self._warm: set[tuple[int, bool]] = set()
        self._refused: tuple[int, ...] | None = None  # weights_version whose compiled step failed its check
        self.compile_error: float | None = None  # that check's relative error (None: not compiled)
        self.reset()

    @property
    def min_confidence(self) -> tuple[float, ...]:
        """Per draft position, the least cumulative confidence to propose it (all 0: never stops)."""
        return self._min_confidence

    @min_confidence.setter
    def min_confidence(self, value: float | Sequence[float]) -> None:
        values = (float(value),) if isinstance(value, (int, float)) else tuple(float(v) for v in value)
        if not values or not all(0.0 <= v <= 1.0 for v in values):
            raise DraftsmithError(f"--draft-confidence must be in [0, 1], got {value}")
        self._min_confidence = values
        self._gating = any(values)  # read on every draft step

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.length = 0

    def prepare(self, max_length: int, compile: bool = False, num_draft_tokens: int = 1) -> None:
        self.compile_seconds = 0.0
        if compile and self._compiled is not None and self._compiled_version != weights_version(self.draft):
            self._compiled, self._warm = None, set()  # trained since: its graphs hold the old weights
        if compile and self._compiled is None and self._refused != weights_version(self.draft):
            self._compiled = CompiledFn(self._static_step, self.draft.fc.weight.device)
            self._compiled_version = weights_version(self.draft)
            self.cache = None  # a compiled step gets a bucketed, address-stable cache
        elif not compile and self._compiled is not None:
            self._compiled, self.cache = None, None
        self._ensure(max_length)
        self.cache.length = 0
        # eager in the cpp layout: the draft layer as one C++ call (Eagle3Draft.fused_args; None elsewhere)
        self._fused = self.draft.fused_args() if self._compiled is None else None
        if compile and self._compiled is not None:
            self._warmup(num_draft_tokens)

    def _ensure(self, capacity: int) -> None:
        """Room for ``capacity`` positions: eager caches grow in place, compiled ones by bucket."""
        if self._compiled is None:
            if self.cache is None:
                self.cache = self.draft.new_cache(capacity)
            self.cache.reserve(capacity)
        elif self.cache is None or self.cache.capacity < capacity:
            # CAPACITY_BUCKET-sized: one cache shape, hence one graph, for requests of similar length
            self.cache = self.draft.new_cache(-(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET)
            if self.cache.keys[0].device.type == "cuda":
                self.cache.mark_static_addresses()

    def _static_step(self, ids, hidden, pos, slots, cache):
        return self.draft.step(ids, hidden, pos, cache, slots)

    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """draft.step at the cache's next slots, compiled when prepared so; advances the cache."""
        cache, m = self.cache, ids.shape[1]
        cache.check_room(m)
        if self._compiled is None:
            out = self.draft.step(ids, hidden, pos, cache, fused=self._fused)
        else:
            slots = torch.arange(cache.length, cache.length + m, device=ids.device)
            if m > 1:  # one graph for every first-step length
                for t, d in ((ids, 1), (hidden, 1), (pos, 1), (slots, 0)):
                    torch._dynamo.mark_dynamic(t, d)
            cuda = ids.device.type == "cuda"
            cache.static = True
            try:
                if cuda:
                    torch.compiler.cudagraph_mark_step_begin()
                out = self._compiled(ids, hidden, pos, slots, cache)
            finally:
                cache.static = False
            if cuda:  # a CUDA graph's outputs are overwritten by its next replay
                out = tuple(t.clone() for t in out)
        cache.advance(m)
        return out

    def _warmup(self, num_draft_tokens: int = 1) -> None:
        """Compile the draft step for its lengths before the clock starts: a round's first step reads the
        1 to k + 1 tokens the last verify accepted, the others one. On the CPU one graph with a dynamic
        length serves every m > 1; on CUDA each length records its own CUDA graph, so each is warmed."""
        t0 = time.perf_counter()
        did = False
        w = self.draft.fc.weight
        H = self.draft.config.hidden_size
        cuda = w.device.type == "cuda"
        for m in range(1, max(2, num_draft_tokens + 1) + 1) if cuda else (1, 2):
            key = (self.cache.capacity, m if cuda else m == 1)
            if key in self._warm:
                continue
            for _ in range(3 if cuda else 1):
                self.cache.length = 0
                ids = torch.zeros(1, m, dtype=torch.long, device=w.device)
                self._step(ids, torch.zeros(1, m, H, dtype=w.dtype, device=w.device),
                           torch.arange(1, m + 1, device=w.device)[None])
            self._warm.add(key)
            did = True
        self.cache.length = 0
        if did:
            self._check_compiled()
        self.compile_seconds = time.perf_counter() - t0 if did else 0.0

    def _check_compiled(self) -> None:
        """Drop the compiled step (the eager one drafts instead, with a warning) when its logits
        on one fixed input are not the eager step's within :data:`COMPILED_DRAFT_TOLERANCE`."""
        w, cfg = self.draft.fc.weight, self.draft.config
        g = torch.Generator().manual_seed(0)
        m = 3
        ids = torch.randint(0, cfg.vocab_size, (1, m), generator=g).to(w.device)
        hidden = torch.randn(1, m, cfg.hidden_size, generator=g).to(w.device, w.dtype)
        pos = torch.arange(1, m + 1, device=w.device)[None]
        capacity = self.cache.capacity
        self.cache.length = 0
        got = self._step(ids, hidden, pos)[0].float()
        self.cache.length = 0
        ref = self.draft.step(ids, hidden, pos, self.draft.new_cache(m))[0].float()
        err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
        self.compile_error = err
        if not err <= COMPILED_DRAFT_TOLERANCE:  # also NaN
            log.warning("the compiled draft step's logits differ from the eager step's by %.1f%% of their "
                        "largest magnitude (tolerance %.0f%%): the draft runs eagerly", 100 * err,
                        100 * COMPILED_DRAFT_TOLERANCE)
            self._compiled, self.cache, self._warm = None, None, set()
            self._fused = self.draft.fused_args()
            self._refused = self._compiled_version
            self._ensure(capacity)  # a fresh eager cache, empty

    def check_compatible(self, verifier: torch.nn.Module) -> None:
        cfg = self.draft.config
        vc = verifier.config.get_text_config() if hasattr(verifier.config, "get_text_config") else verifier.config
        problems = []
        if vc.hidden_size != cfg.verifier_hidden_size:
            problems.append(f"hidden size {vc.hidden_size} != draft's {cfg.verifier_hidden_size}")
        vocab = output_vocab_size(verifier)
        if vocab != cfg.vocab_size:
            problems.append(f"vocabulary {vocab} != draft's {cfg.vocab_size}")
        if max(cfg.aux_layer_ids) > vc.num_hidden_layers:
            problems.append(f"aux layers {cfg.aux_layer_ids} exceed its {vc.num_hidden_layers} layers")
        if problems:
            raise DraftsmithError("EAGLE-3 draft does not fit this verifier: " + "; ".join(problems))

    def _choose(self, logits: torch.Tensor, sampling: SamplingParams, generator):
        """Draft logits [Vd] -> (verifier id, q over the verifier vocab or None, top probability or
        None when nothing gates on it)."""
        gate = self._gating
        if sampling.greedy:
            i = argmax(logits)
            top = None
            if gate:  # the greedy choice's probability: 1 / sum(exp(l - max)), read on the host only to gate
                l32 = logits.float()
                top = 1.0 / float((l32 - l32[i]).exp().sum())
            return i + self.draft.d2t[i], None, top
        full = torch.full((self.draft.config.vocab_size,), float("-inf"), device=logits.device, dtype=torch.float32)
        full[self.draft.draft_to_target] = logits.float()
        q = logits_to_probs(full, sampling)  # the shared transform, on the verifier's vocabulary
        return sample(q, generator), q, float(q.max()) if gate else None

    def propose(self, ctx: DraftContext, k: int, sampling: SamplingParams, generator) -> Proposal:
        tokens, aux = ctx.tokens, ctx.hidden_states
        T, m = tokens.shape[0], aux.shape[0]
        start = T - 1 - m  # first position with a new verifier state
        self._ensure(T + k)  # a no-op when prepared for this sequence
        # drop last round's draft steps (and anything past the verified prefix)
        self.cache.rollback(min(start, self.cache.length))
        dtype = self.draft.fc.weight.dtype
        g = self.draft.fuse(aux.to(dtype))[None]  # [1, m, H]
        # position p pairs its state with the next token x_{p+1}, at rope position p+1
        pos = torch.arange(start + 1, T, device=tokens.device)[None]
        logits, h = self._step(tokens[T - m:][None], g, pos)
        drafted, probs = [], []
        floor, sure = self._min_confidence, 1.0
        for i in range(k):
            tok, q, top = self._choose(logits[0, -1], sampling, generator)
            if top is not None:
                sure *= top
                if sure < floor[min(i, len(floor) - 1)]:  # the draft is unsure: propose what it has
                    break
            drafted.append(tok)
            probs.append(q)
            if i + 1 < k:
                logits, h = self._step(tok.reshape(1, 1), h[:, -1:], pos[:, -1:] + i + 1)
        if not drafted:
            return Proposal(tokens[:0], None)
        return Proposal(torch.stack(drafted), None if sampling.greedy else torch.stack(probs))
