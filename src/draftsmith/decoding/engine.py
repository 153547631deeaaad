"""Speculative decoding engine: prefill -> propose -> verify -> accept -> KV rollback.

One loop serves every drafter, and plain autoregressive decoding is the same loop
with no drafter (k = 0 every round), so baseline and speculative runs share all
overheads and a measured speedup is the drafter's doing alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from draftsmith.decoding.proposers import DraftContext, Proposer
from draftsmith.decoding.runner import verifier_runner
from draftsmith.decoding.sampling import SamplingParams, logits_to_probs, sample
from draftsmith.decoding.verify import greedy_verify, rejection_verify
from draftsmith.errors import DraftsmithError
from draftsmith.models.verifier import context_length


@dataclass
class GenerationOutput:
    """New tokens (prompt excluded) and the run's statistics.

    ``stats`` keys: drafts (rounds that drafted >= 1 token), draft_tokens,
    accepted_tokens, acceptance_length (1 + accepted/drafts, vLLM's definition),
    acceptance_rate (accepted/draft_tokens), per_position_acceptance (list: accepted
    at position i / drafts), verifier_forwards (prefill included), new_tokens,
    seconds (wall time, prefill included), prefill_seconds, tokens_per_second,
    engine (the verifier path, see :mod:`draftsmith.decoding.runner`), compile_seconds
    (compiling before the clock started; 0 when eager or already compiled).
    """

    token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)


def _prompt_tensor(input_ids: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long) if not torch.is_tensor(input_ids) else input_ids
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise DraftsmithError(f"generate decodes one sequence at a time; got a batch of {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise DraftsmithError("input_ids must be a non-empty list of token ids or a [T] / [1, T] tensor")
    return ids.to(device=device, dtype=torch.long)


def _eos_ids(model: torch.nn.Module, eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(t) for t in eos_token_id)


def _stream(on_tokens: Callable[[list[int]], None], tokens: list[int]) -> float:
    """Hand ``tokens`` to the streaming callback; returns the seconds it took."""
    t = time.perf_counter()
    on_tokens(list(tokens))
    return time.perf_counter() - t


def generate(model: torch.nn.Module, input_ids: Any, proposer: Proposer | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, num_draft_tokens: int = 5, seed: int | None = None,
             eos_token_id: int | Sequence[int] | None = None, compile: bool = False,
             engine: str = "auto", time_steps: bool = False,
             on_tokens: Callable[[list[int]], None] | None = None) -> GenerationOutput:
    """Generate with speculative decoding (or plainly, when ``proposer`` is None).

    At temperature 0 the output equals the verifier's own greedy decoding; above 0
    it is distributed as the verifier's sampling with the same temperature/top-k/top-p.

    Args:
        model: any transformers decoder-only causal LM (the verifier).
        input_ids: prompt token ids: a list, a ``[T]`` or a ``[1, T]`` tensor.
        proposer: the drafter; None decodes one token per verifier forward.
        max_new_tokens: upper bound on generated tokens (never exceeded).
        temperature: 0 for greedy, else the sampling temperature.
        top_k: top-k filter applied to verifier and draft alike.
        top_p: nucleus filter applied to verifier and draft alike.
        num_draft_tokens: k, tokens drafted per round.
        seed: seed of the random generator (sampling and rejection tests).
        eos_token_id: stop token(s); None uses ``model.generation_config``'s, ``[]`` none.
        compile: compile the verifier's decode/verify steps (and the drafter's, where it
            supports it); compile time is reported as ``compile_seconds``, apart from ``seconds``.
        engine: verifier path: ``auto`` (the leanest exact one), ``lean``, ``hf-static`` or
            ``hf-dynamic`` (see :mod:`draftsmith.decoding.runner`).
        time_steps: time every verifier forward after the prompt's (on CUDA with a device sync
            around each) into ``stats["step_seconds"]``: ``{tokens verified: [seconds, ...]}``,
            the step prices as the loop pays them (:func:`draftsmith.bench.measure.measure_costs`).
        on_tokens: called with each round's new token ids as they are decided (streaming); the
            time it takes is kept out of ``seconds`` (``stats["stream_seconds"]``).

    Returns:
        :class:`GenerationOutput` with the new token ids and statistics.
    """
    sampling = SamplingParams(temperature, top_k, top_p)
    if num_draft_tokens < 1:
        raise DraftsmithError(f"--num-draft-tokens must be >= 1, got {num_draft_tokens}")
    if max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    prompt = _prompt_tensor(input_ids, device)
    L = prompt.shape[0]
    limit = context_length(model)
    if limit is not None and L >= limit:
        raise DraftsmithError(f"prompt has {L} tokens but the model's context holds {limit}; shorten it")
    budget = max_new_tokens if limit is None else min(max_new_tokens, limit - L)
    # Every cache is sized to this request: the verifier writes at most positions L + budget - 2,
    # a draft at most k - 1 beyond the context it was shown.
    capacity = L + budget + num_draft_tokens + 1
    eos = _eos_ids(model, eos_token_id)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    aux: tuple[int, ...] = ()
    if proposer is not None:
        proposer.check_compatible(model)
        proposer.reset()
        aux = tuple(proposer.aux_layer_ids) if proposer.requires_hidden_states else ()
        with torch.inference_mode():
            proposer.prepare(capacity, compile, num_draft_tokens)

    accepted_at = [0] * num_draft_tokens
    drafts = draft_tokens = forwards = 0
    step_seconds: dict[int, list[float]] = {}
    cuda = device.type == "cuda"
    with torch.inference_mode():
        runner = verifier_runner(model, capacity, compile=compile, mode=engine, aux_layer_ids=aux,
                                 warmup_shapes=(1, *range(2, num_draft_tokens + 2)) if proposer is not None else (1,))
        try:
            t0 = time.perf_counter()
            logits, hidden = runner.forward(prompt, 1, aux)
            forwards += 1
            pending_hidden = [hidden] if aux else []
            probs = logits_to_probs(logits[-1], sampling)
            token = int(probs.argmax()) if sampling.greedy else int(sample(probs, generator))
            prefill_seconds = time.perf_counter() - t0
            seq = torch.empty(L + budget, dtype=torch.long, device=device)
            seq[:L] = prompt
            seq[L] = token
            T = L + 1  # seq[:T] is the context; seq[T-1] is the pending token
            out = [token]
            streamed = 0.0
            if on_tokens is not None:
                streamed = _stream(on_tokens, out)
            while len(out) < budget and token not in eos:
                k = min(num_draft_tokens, budget - len(out) - 1) if proposer is not None else 0
                draft, q = seq[:0], None
                if k > 0:
                    ctx = DraftContext(seq[:T], torch.cat(pending_hidden) if aux else None)
                    pending_hidden = []
                    proposal = proposer.propose(ctx, k, sampling, generator)
                    draft, q = proposal.tokens[:k].to(device), proposal.probs
                kk = draft.shape[0]
                if time_steps:
                    if cuda:
                        torch.cuda.synchronize(device)
                    t_step = time.perf_counter()
                logits, hidden = runner.forward(torch.cat([seq[T - 1:T], draft]), kk + 1, aux)
                if time_steps:
                    if cuda:
                        torch.cuda.synchronize(device)
                    step_seconds.setdefault(kk + 1, []).append(time.perf_counter() - t_step)
                forwards += 1
                if sampling.greedy:
                    decision = greedy_verify(draft, logits)
                else:
                    decision = rejection_verify(draft, logits_to_probs(logits, sampling),
                                                None if q is None else q[:kk], generator)
                n, token, *drafted = torch.cat([decision, draft]).tolist()  # the round's one host sync
                runner.rollback(runner.length - (kk - n))  # drop the rejected drafts' keys/values
                if aux:
                    pending_hidden.append(hidden[: n + 1])
                if kk:
                    drafts += 1
                    draft_tokens += kk
                    for i in range(n):
                        accepted_at[i] += 1
                new = drafted[:n] + [token]
                for i, t in enumerate(new):
                    if t in eos:
                        new = new[: i + 1]
                        break
                seq[T:T + len(new)] = torch.as_tensor(new, device=device)
                T += len(new)
                out.extend(new)
                token = new[-1]
                if on_tokens is not None:
                    streamed += _stream(on_tokens, new)
            if cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0 - streamed
        finally:
            runner.close()

    accepted = sum(accepted_at)
    stats = {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "per_position_acceptance": [a / drafts if drafts else 0.0 for a in accepted_at],
        "verifier_forwards": forwards,
        "new_tokens": len(out),
        "seconds": seconds,
        "prefill_seconds": prefill_seconds,
        "tokens_per_second": len(out) / seconds if seconds > 0 else float("inf"),
        "engine": runner.kind + ("+compiled" if runner.compiled else ""),
        "compile_seconds": runner.compile_seconds + float(getattr(proposer, "compile_seconds", 0.0)),
        "verify_tiers": getattr(runner, "verify_tiers", {}),
    }
    if on_tokens is not None:
        stats["stream_seconds"] = streamed
    if time_steps:
        stats["step_seconds"] = step_seconds
    return GenerationOutput(out, stats)
