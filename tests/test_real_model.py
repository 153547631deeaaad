"""The packaged SmolLM2-135M-Instruct verifier: loading, fingerprint, greedy equivalence on real prompts."""

from __future__ import annotations

import pytest
import torch

from conftest import perturbed_copy
from draftsmith import generate
from draftsmith.data.sources import eval_set
from draftsmith.decoding import DraftModelProposer, NgramProposer

pytestmark = pytest.mark.slow


def test_load_is_cached_and_fingerprint_stable(smollm2):
    from draftsmith.models.verifier import fingerprint, load_verifier

    model, tok, fp = smollm2
    again = load_verifier("smollm2-135m", dtype="bfloat16", device="cpu")
    assert again.fingerprint == fp == fingerprint(model)  # dtype-independent, stable across loads
    assert model.config.num_hidden_layers == 30 and len(tok) == 49152


def test_greedy_equivalence_smollm2(smollm2):
    """Every drafter returns exactly plain decoding's and HF generate's tokens on MT-Bench prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok, _ = smollm2
    torch.manual_seed(0)
    random_lm = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2)).eval()
    drafters = {"perfect": DraftModelProposer(model), "random": DraftModelProposer(random_lm),
                "partial": DraftModelProposer(perturbed_copy(model, noise=0.15)), "ngram": NgramProposer()}
    n = 40
    stats = {}
    for _, prompt in eval_set("mt-bench", tok, limit=2):  # 3 prompts took 84 s on an AVX2-only EPYC
        plain = generate(model, prompt, max_new_tokens=n).token_ids
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
        assert plain == hf[0, len(prompt):].tolist()
        for name, d in drafters.items():
            out = generate(model, prompt, proposer=d, max_new_tokens=n, num_draft_tokens=4)
            assert out.token_ids == plain, name
            stats.setdefault(name, []).append(out.stats["acceptance_rate"])
    assert min(stats["perfect"]) == 1.0
    assert max(stats["random"]) < 0.1
    assert 0.1 < sum(stats["partial"]) / len(stats["partial"]) < 0.95  # really partial
