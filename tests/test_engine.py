"""Greedy equivalence, metrics and input errors of the speculative decoding engine."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, perturbed_copy, tiny_model
from draftsmith import generate
from draftsmith.decoding import DraftModelProposer, NgramProposer
from draftsmith.errors import DraftsmithError

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


def _prompt(seed: int, n: int = 12, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    # a repeated chunk gives the n-gram drafter something to find
    head = torch.randint(2, vocab, (n,), generator=g).tolist()
    return head + head[: n // 2]


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=1)
    return out[0, len(prompt):].tolist()


def _drafters(arch: str):
    verifier = tiny_model(arch)
    return {
        "perfect": DraftModelProposer(verifier),
        "random": DraftModelProposer(tiny_model(arch, seed=7)),
        "partial": DraftModelProposer(perturbed_copy(verifier, noise=0.02)),
        "ngram": NgramProposer(),
        "ngram-fixed": NgramProposer(adaptive=False),
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equivalence_tiny(arch):
    """Every drafter reproduces plain decoding and HF generate token for token."""
    verifier = tiny_model(arch)
    n_new = 40  # > sliding window (8): rollback across the window boundary is exercised
    for seed in range(3):
        prompt = _prompt(seed)
        plain = generate(verifier, prompt, max_new_tokens=n_new, eos_token_id=[]).token_ids
        assert plain == _hf_greedy(verifier, prompt, n_new)
        for name, drafter in _drafters(arch).items():
            for k in (1, 3, 5):
                out = generate(verifier, prompt, proposer=drafter, max_new_tokens=n_new,
                               num_draft_tokens=k, eos_token_id=[])
                assert out.token_ids == plain, (arch, name, k, seed)


def test_partial_drafter_is_partial():
    """The 'partial' drafter really is partial (else the equivalence test proves little)."""
    verifier = tiny_model("llama")
    out = generate(verifier, _prompt(0), proposer=_drafters("llama")["partial"], max_new_tokens=60,
                   num_draft_tokens=4, eos_token_id=[])
    assert 0.25 < out.stats["acceptance_rate"] < 0.9


def test_perfect_drafter_metrics():
    verifier = tiny_model("llama")
    k, rounds = 4, 8
    out = generate(verifier, _prompt(1), proposer=DraftModelProposer(verifier),
                   max_new_tokens=1 + rounds * (k + 1), num_draft_tokens=k, eos_token_id=[])
    s = out.stats
    assert s["acceptance_rate"] == 1.0
    assert s["acceptance_length"] == k + 1
    assert s["per_position_acceptance"] == [1.0] * k
    assert s["drafts"] == rounds and s["verifier_forwards"] == rounds + 1
    assert s["new_tokens"] == 1 + rounds * (k + 1)


def test_time_steps_times_every_verify_forward_by_its_length():
    """``time_steps`` records one time per verifier forward after the prompt's, under the number of
    tokens it verified, and changes nothing else."""
    verifier = tiny_model("llama")
    prompt = _prompt(1)
    k, rounds = 3, 6
    n = 1 + rounds * (k + 1)
    timed = generate(verifier, prompt, proposer=DraftModelProposer(verifier), max_new_tokens=n + 1,
                     num_draft_tokens=k, eos_token_id=[], time_steps=True)
    steps = timed.stats["step_seconds"]
    assert set(steps) == {k + 1, 1}  # full rounds, then a last one-token step (budget n + 1)
    assert len(steps[k + 1]) == rounds and len(steps[1]) == 1
    assert all(t > 0 for v in steps.values() for t in v)
    untimed = generate(verifier, prompt, proposer=DraftModelProposer(verifier), max_new_tokens=n + 1,
                       num_draft_tokens=k, eos_token_id=[])
    assert "step_seconds" not in untimed.stats and untimed.token_ids == timed.token_ids
    plain = generate(verifier, prompt, max_new_tokens=9, eos_token_id=[], time_steps=True)
    assert list(plain.stats["step_seconds"]) == [1] and len(plain.stats["step_seconds"][1]) == 8
    partial = generate(verifier, prompt, proposer=_drafters("llama")["partial"], max_new_tokens=40,
                       num_draft_tokens=k, eos_token_id=[], time_steps=True)
    assert sum(map(len, partial.stats["step_seconds"].values())) == partial.stats["verifier_forwards"] - 1


def test_on_tokens_streams_each_rounds_tokens_and_keeps_its_time_out():
    """Streaming: the callback gets the prompt's token, then each round's accepted tokens and its own,
    in order, so the pieces join into the output (an EOS inside a round included); a slow callback
    is not counted in ``seconds``."""
    import time

    verifier = tiny_model("llama")
    prompt = _prompt(5)
    plain = generate(verifier, prompt, max_new_tokens=30, eos_token_id=[]).token_ids
    for drafter, eos in ((None, []), (DraftModelProposer(verifier), []), (_drafters("llama")["partial"], []),
                         (DraftModelProposer(verifier), plain[11])):
        pieces: list[list[int]] = []
        out = generate(verifier, prompt, proposer=drafter, max_new_tokens=30, num_draft_tokens=3, eos_token_id=eos,
                       on_tokens=pieces.append)
        assert [t for piece in pieces for t in piece] == out.token_ids
        assert len(pieces) == out.stats["verifier_forwards"]  # one piece per forward: streamed as decided
        assert out.token_ids == (plain if eos == [] else plain[: plain.index(eos) + 1])
    slow = generate(verifier, prompt, max_new_tokens=6, eos_token_id=[], on_tokens=lambda _: time.sleep(0.2))
    assert slow.stats["stream_seconds"] >= 6 * 0.2 and slow.stats["seconds"] < 6 * 0.2


def test_random_drafter_metrics():
    verifier = tiny_model("llama", vocab=VOCAB)
    out = generate(verifier, _prompt(2), proposer=DraftModelProposer(tiny_model("llama", seed=99)),
                   max_new_tokens=60, num_draft_tokens=4, eos_token_id=[])
    assert out.stats["acceptance_length"] < 1.15
    assert out.stats["per_position_acceptance"][-1] <= out.stats["per_position_acceptance"][0]


def test_eos_stops_inside_accepted_tokens():
    verifier = tiny_model("llama")
    prompt = _prompt(3)
    plain = generate(verifier, prompt, max_new_tokens=30, eos_token_id=[]).token_ids
    eos = plain[7]
    first = plain.index(eos)
    for drafter in (None, DraftModelProposer(verifier), _drafters("llama")["partial"]):
        out = generate(verifier, prompt, proposer=drafter, max_new_tokens=30, eos_token_id=eos)
        assert out.token_ids == plain[: first + 1]


@pytest.mark.parametrize("budget", [1, 2, 5, 7, 13])
@pytest.mark.parametrize("drafter", ["perfect", "partial"])
def test_max_new_tokens_never_exceeded(budget, drafter):
    verifier = tiny_model("llama")
    plain = generate(verifier, _prompt(4), max_new_tokens=budget, eos_token_id=[]).token_ids
    out = generate(verifier, _prompt(4), proposer=_drafters("llama")[drafter], max_new_tokens=budget,
                   num_draft_tokens=5, eos_token_id=[])
    assert len(out.token_ids) == budget and out.token_ids == plain


def test_ngram_proposes_latest_match():
    from draftsmith.decoding import DraftContext, SamplingParams

    ctx = DraftContext(torch.tensor([5, 6, 7, 8, 5, 6, 9, 9, 5, 6]))
    prop = NgramProposer(max_ngram=2).propose(ctx, 3, SamplingParams(), None)
    assert prop.tokens.tolist() == [9, 9, 5]  # latest "5 6" was followed by 9 9 5
    none = NgramProposer().propose(DraftContext(torch.tensor([1, 2, 3, 4])), 3, SamplingParams(), None)
    assert none.tokens.numel() == 0


def test_adaptive_ngram_shrinks_after_rejection_and_regrows():
    from draftsmith.decoding import DraftContext, SamplingParams

    sp = SamplingParams()
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # "1 2" recurs: drafts continue with 3 4 5 ...
    prop = NgramProposer(max_ngram=2)
    assert prop.propose(DraftContext(torch.tensor(base)), 6, sp, None).tokens.tolist() == [3, 4, 5, 6, 7, 8]
    # the verifier accepted 3 4 and corrected 5 -> 0: the next draft holds at most 2 + 1 tokens
    ctx = base + [3, 4, 0, 1, 2]
    assert prop.propose(DraftContext(torch.tensor(ctx)), 6, sp, None).tokens.tolist() == [3, 4, 0]
    assert prop.cap == 3
    # all three accepted (+ the bonus token 1): the cap doubles to 6, i.e. back to k
    ctx = ctx + [3, 4, 0, 1, 2]
    assert prop.propose(DraftContext(torch.tensor(ctx)), 6, sp, None).tokens.tolist() == [3, 4, 0, 1, 2]
    assert prop.cap is None
    # a rejection at the first token leaves room for one token; reset forgets it all
    prop.propose(DraftContext(torch.tensor(ctx + [9, 9, 1, 2])), 6, sp, None)
    assert prop.cap == 1
    prop.reset()
    assert prop.cap is None
    fixed = NgramProposer(max_ngram=2, adaptive=False)
    fixed.propose(DraftContext(torch.tensor(base)), 6, sp, None)
    again = fixed.propose(DraftContext(torch.tensor(base + [3, 4, 0, 1, 2])), 6, sp, None)
    assert again.tokens.tolist() == [3, 4, 0, 1, 2]  # not capped at 3


def test_bad_inputs():
    verifier = tiny_model("llama")
    with pytest.raises(DraftsmithError, match="num-draft-tokens"):
        generate(verifier, [3, 4], proposer=NgramProposer(), num_draft_tokens=0)
    with pytest.raises(DraftsmithError, match="context"):
        generate(verifier, list(range(2, 120)) * 5)  # 590 tokens > 512 context
    with pytest.raises(DraftsmithError, match="one sequence"):
        generate(verifier, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(DraftsmithError, match="non-empty"):
        generate(verifier, [])
    with pytest.raises(DraftsmithError, match="vocabulary"):
        generate(verifier, [3, 4], proposer=DraftModelProposer(tiny_model("llama", vocab=96)))
    with pytest.raises(DraftsmithError, match="temperature"):
        generate(verifier, [3, 4], temperature=-1.0)
