"""The tie-aware lossless verdict: identical, numerical tie, or mismatch (a bug).

Hand-computed tolerances, hand-made logits, and the engine with planted bugs (negative
controls that must be mismatches, never ties) and in bfloat16 (divergences that must
be ties, with their margins).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import perturbed_copy, tiny_model
from draftsmith import generate
from draftsmith.bench.verdict import compare_outputs, count_kinds, model_scorer, tie_tolerance, ulp
from draftsmith.decoding import DraftModelProposer
from draftsmith.decoding import engine as engine_mod
from draftsmith.decoding.verify import greedy_verify


def test_ulp_and_tolerance_by_hand():
    assert ulp(torch.bfloat16, 22.4) == 0.125        # 2**(4 - 7)
    assert ulp(torch.bfloat16, -22.4) == 0.125
    assert ulp(torch.bfloat16, 1.0) == 2 ** -7
    assert ulp(torch.float16, 22.4) == 2 ** (4 - 10)
    assert ulp(torch.float32, 25.0) == 2 ** (4 - 23)
    assert tie_tolerance(torch.bfloat16, 22.4) == 0.5  # 4 ulps
    assert tie_tolerance(torch.bfloat16, 0.01) == 4 * 2 ** -7  # below 1 the magnitude counts as 1
    assert tie_tolerance(torch.float32, 25.0) == pytest.approx(7.63e-6, rel=1e-3)
    with pytest.raises(ValueError):
        ulp(torch.int8, 1.0)


def _scorer(values: dict[int, float], seen: list):
    def score(ids):
        seen.append(list(ids))
        logits = torch.full((16,), -5.0)
        for t, v in values.items():
            logits[t] = v
        return logits
    return score


def test_compare_outputs_by_hand():
    seen: list = []
    # top logit 22.4 (bf16 tolerance 0.5): token 3 at 22.4, token 4 at 22.1 (a tie), token 5 at 20.0 (not)
    score = _scorer({3: 22.4, 4: 22.1, 5: 20.0}, seen)
    prompt, ref = [1, 2], [7, 8, 3, 9]
    assert compare_outputs(prompt, ref, list(ref), score=score, dtype=torch.bfloat16).kind == "identical"
    assert seen == []  # nothing is rescored when the outputs agree
    v = compare_outputs(prompt, ref, [7, 8, 4, 1], score=score, dtype=torch.bfloat16)
    assert (v.kind, v.position, v.reference_token, v.candidate_token) == ("tie", 2, 3, 4)
    assert v.margin == pytest.approx(0.3, abs=1e-5) and v.tolerance == 0.5 and v.reason == ""
    assert seen[-1] == [1, 2, 7, 8]  # the shared prefix, prompt included
    v = compare_outputs(prompt, ref, [7, 8, 5, 1], score=score, dtype=torch.bfloat16)
    assert v.kind == "mismatch" and v.gap == pytest.approx(2.4, abs=1e-5) and "candidate's token" in v.reason
    # the same 0.3 gap is far beyond float32's rounding: a mismatch there
    assert compare_outputs(prompt, ref, [7, 8, 4, 1], score=score, dtype=torch.float32).kind == "mismatch"
    # one output goes on where the other stopped: never a tie
    v = compare_outputs(prompt, ref, ref[:3], score=score, dtype=torch.bfloat16)
    assert (v.kind, v.position) == ("mismatch", 3)
    assert count_kinds([v, v]) == {"identical": 0, "tie": 0, "mismatch": 2}


def _prompts(n: int, vocab: int = 128):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (12,), generator=g).tolist() for _ in range(n)]


def _off_by_one(draft, target_logits):
    """Planted bug: one draft token more than the verifier agreed to."""
    n = int(greedy_verify(draft, target_logits)[0])
    if n < draft.shape[0]:
        n += 1
    return torch.tensor([n, int(target_logits.argmax(-1)[n])])


def _unchecked(draft, target_logits):
    """Planted bug: every drafted token accepted without looking."""
    k = draft.shape[0]
    return torch.tensor([k, int(target_logits.argmax(-1)[k])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bug", [_off_by_one, _unchecked])
def test_planted_acceptance_bugs_are_mismatches_never_ties(monkeypatch, bug, dtype):
    verifier = copy.deepcopy(tiny_model("llama")).to(dtype)
    drafter = DraftModelProposer(copy.deepcopy(tiny_model("llama", seed=7)).to(dtype))  # random: nearly always wrong
    score = model_scorer(verifier)
    plain = {i: generate(verifier, p, max_new_tokens=24, eos_token_id=[]).token_ids for i, p in enumerate(_prompts(6))}
    monkeypatch.setattr(engine_mod, "greedy_verify", bug)
    verdicts = []
    for i, p in enumerate(_prompts(6)):
        spec = generate(verifier, p, proposer=drafter, max_new_tokens=24, num_draft_tokens=3, eos_token_id=[])
        verdicts.append(compare_outputs(p, plain[i], spec.token_ids, score=score, dtype=dtype))
    assert count_kinds(verdicts) == {"identical": 0, "tie": 0, "mismatch": 6}, verdicts


def test_bfloat16_divergences_are_ties_with_margins():
    """A tiny model in bfloat16 on CPU: speculative output parts from plain output only at ties."""
    base = tiny_model("llama", seed=1, layers=4)
    verifier = copy.deepcopy(base).to(torch.bfloat16)
    drafter = DraftModelProposer(copy.deepcopy(perturbed_copy(base, 0.3)).to(torch.bfloat16))
    score, score32 = model_scorer(verifier), model_scorer(base)
    verdicts = []
    for p in _prompts(40):
        plain = generate(verifier, p, max_new_tokens=48, eos_token_id=[]).token_ids
        spec = generate(verifier, p, proposer=drafter, max_new_tokens=48, num_draft_tokens=4, eos_token_id=[])
        verdicts.append(compare_outputs(p, plain, spec.token_ids, score=score, dtype=torch.bfloat16,
                                        score_float32=score32))
        if sum(v.kind == "tie" for v in verdicts) >= 3:
            break
    kinds = count_kinds(verdicts)
    assert kinds["mismatch"] == 0 and kinds["tie"] >= 1, kinds
    for v in verdicts:
        if v.kind == "tie":
            assert v.margin is not None and v.margin <= v.gap <= v.tolerance and v.margin_float32 is not None
    # control: the same runs in float32 never part at all
    drafter32 = DraftModelProposer(perturbed_copy(base, 0.3))
    for p in _prompts(len(verdicts)):
        plain = generate(base, p, max_new_tokens=48, eos_token_id=[]).token_ids
        assert generate(base, p, proposer=drafter32, max_new_tokens=48, num_draft_tokens=4,
                        eos_token_id=[]).token_ids == plain


def test_float32_twin_makes_only_float32_tensors_and_leaves_the_model_as_it_is():
    """The rescoring's float32 copy of a bfloat16 verifier: every floating tensor float32 with the same
    values, shared weights still shared, the model itself untouched, its scores those of ``model.float()``."""
    from draftsmith.bench.measure import float32_twin

    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)  # the cached one stays as it is
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in SmolLM2
    before = {n: p.clone() for n, p in model.state_dict().items()}
    twin = float32_twin(model)
    assert all(p.dtype == torch.float32 for p in twin.parameters())
    assert twin.lm_head.weight is twin.model.embed_tokens.weight
    for n, p in twin.state_dict().items():
        assert torch.equal(p, before[n].to(p.dtype)), n
        assert p.data_ptr() != model.state_dict()[n].data_ptr(), n
    assert all(torch.equal(p, before[n]) and p.dtype == before[n].dtype for n, p in model.state_dict().items())
    ids = list(range(3, 20))
    with torch.inference_mode():
        want = model_scorer(copy.deepcopy(model).float())(ids)
        assert torch.equal(model_scorer(twin)(ids), want)
        assert not torch.equal(model_scorer(model)(ids).float(), want)  # control: the bfloat16 scores differ
