"""Drafts whose tokenizer is not the verifier's: equivalence with plain decoding (greedy and
sampled), the text mapping's quality with an oracle draft, and negative controls."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import tiny_model
from draftsmith import generate
from draftsmith.decoding import CrossTokenizerProposer, SamplingParams
from draftsmith.decoding import engine as engine_mod

ASCII = [chr(b) for b in range(32, 127)] + ["\n"]


def _byte_chars(text: list[str]) -> list[str]:
    """The byte-level alphabet's symbol for each character (GPT-2's byte-to-unicode map)."""
    from tokenizers import pre_tokenizers

    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [bl.pre_tokenize_str(c)[0][0] for c in text]


def _wrap(tok):
    from tokenizers import decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def char_tokenizer(seed: int = 0):
    """Byte-level, one token per printable ASCII character, ids in a shuffled order; no merges."""
    from tokenizers import Tokenizer, models

    chars = _byte_chars(ASCII)
    random.Random(seed).shuffle(chars)
    return _wrap(Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[])))


def merging_tokenizer(texts: list[str], extra: int = 60):
    """Byte-level BPE over the same characters, with ``extra`` merges learned from ``texts``."""
    from tokenizers import Tokenizer, models, trainers

    tok = _wrap(Tokenizer(models.BPE()))._tokenizer
    alphabet = sorted(_byte_chars(ASCII))
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=len(alphabet) + extra, initial_alphabet=alphabet,
                                                       show_progress=False))
    return _wrap(tok)


def _prompt(seed: int, vocab: int, n: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def pair():
    """A verifier over single characters, and a tokenizer that merges what it writes."""
    vtok = char_tokenizer()
    verifier = tiny_model("llama", vocab=len(vtok))
    texts = [vtok.decode(p + generate(verifier, p, max_new_tokens=60, eos_token_id=[]).token_ids)
             for p in (_prompt(s, len(vtok)) for s in range(20, 30))]
    dtok = merging_tokenizer(texts)
    return verifier, vtok, dtok


class OracleDraft(CrossTokenizerProposer):
    """Knows the reference texts: drafts, in its own tokens, what truly follows the context."""

    def __init__(self, dtok, vtok, texts: list[str], draft_model) -> None:
        super().__init__(draft_model, dtok, vtok)
        self.texts = texts

    def _draft(self, ids, n):
        seen = self.dtok.decode(ids)
        full = next(t for t in self.texts if t.startswith(seen))
        return self.dtok.encode(full[len(seen):])[:n]


def test_tokenizers_really_differ(pair):
    from draftsmith.drafters import same_tokenizer

    _, vtok, dtok = pair
    assert not same_tokenizer(dtok, vtok)
    text = "the same text"
    assert vtok.decode(vtok.encode(text)) == dtok.decode(dtok.encode(text)) == text
    merged = [t for t in dtok.convert_ids_to_tokens(list(range(len(dtok)))) if len(t) > 1]
    assert len(merged) >= 40


@pytest.mark.parametrize("direction", ["draft merges", "verifier merges"])
def test_greedy_equivalence_with_another_tokenizer(pair, direction):
    """A random draft model with the other tokenizer: output identical to plain decoding at every k."""
    verifier, vtok, dtok = pair
    if direction == "verifier merges":  # the verifier writes merged tokens, the draft reads characters
        vtok, dtok = dtok, vtok
        verifier = tiny_model("gemma3", vocab=len(vtok))
    draft = tiny_model("qwen2", seed=3, vocab=len(dtok))
    proposer = CrossTokenizerProposer(draft, dtok, vtok)
    for seed in range(3):
        prompt = _prompt(seed, len(vtok))
        plain = generate(verifier, prompt, max_new_tokens=40, eos_token_id=[]).token_ids
        for k in (1, 3, 5):
            out = generate(verifier, prompt, proposer=proposer, max_new_tokens=40, num_draft_tokens=k, eos_token_id=[])
            assert out.token_ids == plain, (direction, seed, k)
            assert out.stats["drafts"] > 0 and proposer.empty < proposer.rounds


def test_oracle_draft_is_always_accepted(pair):
    """The draft text, mapped into the verifier's tokens, is exactly what the verifier writes."""
    verifier, vtok, dtok = pair
    prompts = [_prompt(s, len(vtok)) for s in range(3)]
    plains = [generate(verifier, p, max_new_tokens=40, eos_token_id=[]).token_ids for p in prompts]
    oracle = OracleDraft(dtok, vtok, [vtok.decode(p + o) for p, o in zip(prompts, plains)],
                         tiny_model("llama", vocab=len(dtok)))
    for prompt, plain in zip(prompts, plains):
        for k in (2, 4):
            out = generate(verifier, prompt, proposer=oracle, max_new_tokens=40, num_draft_tokens=k,
                           eos_token_id=[])
            assert out.token_ids == plain
            assert out.stats["acceptance_rate"] == 1.0 and out.stats["acceptance_length"] > k, (k, out.stats)


def test_oracle_through_a_merging_verifier(pair):
    """The verifier cuts its own text unlike a fresh encoding does: most drafts still land."""
    verifier, vtok, dtok = pair
    vtok, dtok = dtok, vtok
    verifier = tiny_model("llama", seed=4, vocab=len(vtok))
    prompts = [_prompt(s, len(vtok)) for s in range(3)]
    plains = [generate(verifier, p, max_new_tokens=40, eos_token_id=[]).token_ids for p in prompts]
    oracle = OracleDraft(dtok, vtok, [vtok.decode(p + o) for p, o in zip(prompts, plains)],
                         tiny_model("llama", vocab=len(dtok)))
    rates = []
    for prompt, plain in zip(prompts, plains):
        out = generate(verifier, prompt, proposer=oracle, max_new_tokens=40, num_draft_tokens=3, eos_token_id=[])
        assert out.token_ids == plain
        rates.append(out.stats["acceptance_rate"])
    assert np.mean(rates) > 0.5, rates


def test_negative_control_unstripped_context_is_rejected(pair, monkeypatch):
    """Dropping step 3's prefix removal (proposing the context's tail again) collapses acceptance:
    the oracle's 1.0 above measures the mapping, not luck."""
    verifier, vtok, dtok = pair
    prompt = _prompt(0, len(vtok))
    plain = generate(verifier, prompt, max_new_tokens=40, eos_token_id=[]).token_ids
    oracle = OracleDraft(dtok, vtok, [vtok.decode(prompt + plain)], tiny_model("llama", vocab=len(dtok)))
    monkeypatch.setattr(OracleDraft, "_to_verifier", lambda self, ctx, text: self.vtok.encode(
        self.vtok.decode(ctx[-self.lookbehind:]) + text))
    out = generate(verifier, prompt, proposer=oracle, max_new_tokens=40, num_draft_tokens=3, eos_token_id=[])
    assert out.token_ids == plain  # the verifier still decides every token
    assert out.stats["acceptance_rate"] < 0.2


def test_negative_control_unverified_drafts_leave_plain_decoding(pair, monkeypatch):
    """The equality assertions have teeth: accept every cross-tokenizer draft unchecked and the output changes."""
    verifier, vtok, dtok = pair
    prompt = _prompt(1, len(vtok))
    plain = generate(verifier, prompt, max_new_tokens=40, eos_token_id=[]).token_ids
    proposer = CrossTokenizerProposer(tiny_model("qwen2", seed=3, vocab=len(dtok)), dtok, vtok)
    monkeypatch.setattr(engine_mod, "greedy_verify", lambda draft, logits: torch.stack(
        [torch.tensor(draft.shape[0]), logits[draft.shape[0]].argmax()]))
    out = generate(verifier, prompt, proposer=proposer, max_new_tokens=40, num_draft_tokens=3, eos_token_id=[])
    assert out.token_ids != plain


def test_build_proposer_picks_text_drafting_for_another_tokenizer(pair, tmp_path):
    from draftsmith.decoding import DraftModelProposer
    from draftsmith.drafters import build_proposer

    verifier, vtok, dtok = pair
    for name, tok in (("other", dtok), ("same", vtok)):
        d = tmp_path / name
        tiny_model("llama", seed=9, vocab=len(tok)).save_pretrained(d)
        tok.save_pretrained(d)
    assert isinstance(build_proposer(f"model:{tmp_path / 'other'}", verifier, vtok, dtype="float32"),
                      CrossTokenizerProposer)
    assert type(build_proposer(f"model:{tmp_path / 'same'}", verifier, vtok, dtype="float32")) is DraftModelProposer


# ----------------------------------------------------------------------------- sampling
def _four_letter_tokenizers():
    """Verifier: a, b, c, d (ids shuffled). Draft: the same letters plus merges ab, cd, abcd."""
    from tokenizers import Tokenizer, models

    vtok = _wrap(Tokenizer(models.BPE(vocab={"c": 0, "a": 1, "d": 2, "b": 3}, merges=[])))
    dtok = _wrap(Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2, "d": 3, "ab": 4, "cd": 5, "abcd": 6},
                                      merges=[("a", "b"), ("c", "d"), ("ab", "cd")])))
    return vtok, dtok


class _ClaimsSampledQ(CrossTokenizerProposer):
    """Negative control: the same greedy drafts, passed off as drawn from a uniform q."""

    def propose(self, ctx, k, sampling, generator):
        prop = super().propose(ctx, k, sampling, generator)
        prop.probs = torch.full((prop.tokens.shape[0], 4), 0.25)
        return prop


def _sample_counts(verifier, proposer, prompt, params, n):
    from test_sampling import SEQ_LEN, SEQ_V

    counts = np.zeros(SEQ_V ** SEQ_LEN)
    for i in range(n):
        a, b, c = generate(verifier, prompt, proposer=proposer, max_new_tokens=SEQ_LEN, num_draft_tokens=2,
                           temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=i,
                           eos_token_id=[]).token_ids
        counts[(a * SEQ_V + b) * SEQ_V + c] += 1
    return counts


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=3, top_p=0.9)])
def test_sampling_keeps_the_verifier_distribution(params):
    """The first 3 sampled tokens follow the verifier's exact joint distribution (chi-square)."""
    from test_sampling import P_THRESHOLD, SEQ_N, _chi2_pooled, _exact_sequence_dist

    vtok, dtok = _four_letter_tokenizers()
    verifier = tiny_model("llama", seed=5, vocab=4, scale=1.0)
    proposer = CrossTokenizerProposer(tiny_model("llama", seed=6, vocab=7, scale=1.0), dtok, vtok)
    prompt = [2, 3, 1]
    counts = _sample_counts(verifier, proposer, prompt, params, SEQ_N)
    assert proposer.rounds > 0 and proposer.empty < proposer.rounds
    assert _chi2_pooled(counts, _exact_sequence_dist(verifier, prompt, params)) > P_THRESHOLD


def test_sampling_negative_control_wrong_q():
    """Claiming a sampled q for greedy drafts biases the output: the chi-square test catches it."""
    from test_sampling import P_THRESHOLD, SEQ_N_CONTROL, _chi2_pooled, _exact_sequence_dist

    vtok, dtok = _four_letter_tokenizers()
    verifier = tiny_model("llama", seed=5, vocab=4, scale=1.0)
    proposer = _ClaimsSampledQ(tiny_model("llama", seed=6, vocab=7, scale=1.0), dtok, vtok)
    params = SamplingParams(1.0)
    counts = _sample_counts(verifier, proposer, [2, 3, 1], params, SEQ_N_CONTROL)
    assert _chi2_pooled(counts, _exact_sequence_dist(verifier, [2, 3, 1], params)) < P_THRESHOLD


# ----------------------------------------------------------------------------- real models
@pytest.mark.slow
def test_smollm2_drafts_for_gemma3():
    """SmolLM2-135M (49k-token vocabulary) drafting for Gemma-3-270M (262k): identical greedy output."""
    from draftsmith.data.sources import eval_set
    from draftsmith.drafters import build_proposer
    from draftsmith.models.verifier import load_verifier

    verifier, vtok, _ = load_verifier("gemma3-270m", dtype="float32", device="cpu")
    proposer = build_proposer("model:smollm2-135m", verifier, vtok, dtype="float32")
    assert isinstance(proposer, CrossTokenizerProposer)
    (_, prompt), = eval_set("mt-bench", vtok, 1)
    plain = generate(verifier, prompt, max_new_tokens=24).token_ids
    out = generate(verifier, prompt, proposer=proposer, max_new_tokens=24, num_draft_tokens=3)
    assert out.token_ids == plain
    assert out.stats["accepted_tokens"] > 0  # the text mapping lands some drafts on a real pair
