"""Prompts the verifier writes itself (`--dataset self`): the user-turn prefix, the filters,
resume to an identical file, fresh attempts after `skip`, bad input, and the pipeline step.

A tiny random verifier with SmolLM2-135M's tokenizer; its output head raises the end-of-turn logit so that
it ends some requests, as a chat model does (a random model almost never would).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import interrupted_on_call, smollm2_tokenizer, tiny_model
from draftsmith.data import selfprompts as S
from draftsmith.data.sources import load_prompts
from draftsmith.errors import DraftsmithError

V = 49152
IM_END = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def chatty(boost: float = 9.0) -> torch.nn.Module:
    import copy

    m = copy.deepcopy(tiny_model("llama", vocab=V, layers=2))  # the cached one must not change
    if boost:
        class EndTurn(torch.nn.Linear):  # a head of its own (a hook would not run in the lean forward)
            def forward(self, x):
                out = super().forward(x)
                out[..., IM_END] += boost
                return out
        m.lm_head.__class__ = EndTurn
    return m


def write(m, tok, path, n=6, **kw):
    kw = {"batch_size": 4, "progress": False, "seed": 1, **kw}
    return S.write_self_prompts(m, tok, n, path, **kw)


def attempts(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_user_turn_prefix_is_the_template_up_to_the_users_text(tok):
    prefix = tok.decode(S.user_turn_prefix(tok))
    assert prefix == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                      "Face<|im_end|>\n<|im_start|>user\n")
    tok2 = smollm2_tokenizer()
    tok2.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] | upper }}<|im_end|>{% endfor %}"
    with pytest.raises(DraftsmithError, match="does not copy a user's text verbatim"):
        S.user_turn_prefix(tok2)


def test_select_prompts_drops_unfinished_short_duplicate_and_eval_prompts():
    mt_bench_q1 = load_prompts("mt-bench", split="all", exclude_eval=False)[0].messages[0]["content"]
    rows = [("How do I bake sourdough bread at home?", "stop"),           # 0 kept
            ("How do I bake sourdough bread at home and then", "length"),  # 1 unfinished
            ("Hi there", "stop"),                                         # 2 too short
            ("  how do I bake SOURDOUGH bread at home? ", "stop"),        # 3 duplicate of 0
            (mt_bench_q1, "stop"),                                        # 4 an evaluation prompt
            ("Write a haiku about the sea in winter.", "stop"),          # 5 kept
            ("Explain photosynthesis to a child.", "stop")]              # 6 kept
    recs = [{"index": 10 + i, "text": t, "finish_reason": r} for i, (t, r) in enumerate(rows)]
    kept, counts = S.select_prompts(recs, 3)
    assert [c.id for c in kept] == ["self-10", "self-15", "self-16"]
    assert kept[0].messages == [{"role": "user", "content": "How do I bake sourdough bread at home?"}]
    assert counts == {"attempts": 7, "unfinished": 1, "too_short": 1, "duplicate": 1, "eval_overlap": 1, "kept": 3}
    kept, counts = S.select_prompts(recs, 2)  # stops reading once n are kept
    assert [c.id for c in kept] == ["self-10", "self-15"] and counts["attempts"] == 6


def test_self_prompts_are_the_verifiers_and_resume_to_an_identical_file(tok, tmp_path, monkeypatch):
    m = chatty()
    full = tmp_path / "full.jsonl"
    kept, counts = write(m, tok, full)
    recs = attempts(full)
    assert len(kept) == 6 and counts["kept"] == 6 and counts["next_skip"] == len(recs)
    assert len(recs) % 4 == 0 and [r["index"] for r in recs] == list(range(len(recs)))
    assert {r["finish_reason"] for r in recs} <= {"stop", "length"}
    by_index = {r["index"]: r for r in recs}
    for c in kept:  # each kept request is an attempt's text, in order, stripped
        assert c.messages[0]["content"] == by_index[c.meta["self_prompt_index"]]["text"].strip()
    # the requests are sampled from the verifier after the user-turn prefix: the first one, by hand
    prefix = S.user_turn_prefix(tok)
    from draftsmith.data.generation import eos_ids, generate_batch, sample_seed
    from draftsmith.decoding.sampling import SamplingParams
    ids, reason = generate_batch(m, [prefix], [sample_seed(1, "self-0")],
                                 SamplingParams(temperature=S.TEMPERATURE, top_p=S.TOP_P),
                                 S.MAX_REQUEST_TOKENS, eos_ids(m, tok), 0)[0]
    assert recs[0]["text"] == tok.decode(ids, skip_special_tokens=True) and recs[0]["finish_reason"] == reason

    # interrupted in the second batch's generate, then torn inside a write: the resume draws the same
    real = S.generate_batch
    cut = tmp_path / "cut.jsonl"
    monkeypatch.setattr(S, "generate_batch", interrupted_on_call(real))
    with pytest.raises(KeyboardInterrupt):
        write(m, tok, cut)
    monkeypatch.setattr(S, "generate_batch", real)
    assert len(attempts(cut)) == 4
    lines = full.read_bytes().splitlines(keepends=True)
    cut.write_bytes(b"".join(lines[:5]) + lines[5][:20])  # one line of batch 2 out, one torn
    again, _ = write(m, tok, cut)
    assert cut.read_bytes() == full.read_bytes() and [c.to_record() for c in again] == [c.to_record() for c in kept]

    # skip: attempts from there on, all new; another seed draws other requests
    later, _ = write(m, tok, tmp_path / "later.jsonl", skip=counts["next_skip"])
    assert min(int(c.id.split("-")[1]) for c in later) >= counts["next_skip"]
    assert not {c.messages[0]["content"] for c in later} & {c.messages[0]["content"] for c in kept}
    other, _ = write(m, tok, tmp_path / "seed2.jsonl", seed=2)
    assert [c.messages for c in other] != [c.messages for c in kept]


def test_self_prompts_bad_input(tok, tmp_path):
    m = chatty(boost=0.0)  # a random model that (almost) never ends its turn
    with pytest.raises(DraftsmithError, match=r"wrote only 0 usable prompts of the 3 asked in 8 attempts "
                                              r"\(8 unfinished"):
        write(m, tok, tmp_path / "a.jsonl", n=3, max_attempts=8)
    with pytest.raises(DraftsmithError, match="other settings \\(seed differ"):
        write(m, tok, tmp_path / "a.jsonl", n=3, max_attempts=8, seed=5)
    with pytest.raises(DraftsmithError, match="holds attempt 0, expected 4"):
        write(m, tok, tmp_path / "a.jsonl", n=3, max_attempts=8, skip=4)
    (tmp_path / "b.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(DraftsmithError, match="line 1 is not a prompt attempt"):
        write(m, tok, tmp_path / "b.jsonl")
    with pytest.raises(DraftsmithError, match="must be >= 1, got 0"):
        write(m, tok, tmp_path / "c.jsonl", n=0)
    with pytest.raises(DraftsmithError, match="training source of `draftsmith data`"):
        load_prompts("self")
    from draftsmith.pipeline.config import build_config
    with pytest.raises(DraftsmithError, match="bench.dataset: 'self' writes training prompts"):
        build_config(None, {"bench": {"dataset": "self"}})


def test_data_step_with_self_prompts(tmp_path):
    """`prompts` with --dataset self: the verifier's requests become prompts.jsonl; the cache key
    holds the verifier's fingerprint and dtype (another verifier writes other prompts), and other
    datasets' keys are as before."""
    from draftsmith.pipeline import steps
    from draftsmith.pipeline.config import DataSection

    class FakeVerifier:
        model, tokenizer, fingerprint, dtype = chatty(), smollm2_tokenizer(), "f" * 16, "float32"

    data = DataSection(dataset="self", num_conversations=5, batch_size=4)
    res = steps.prompts(data, tmp_path, FakeVerifier())
    recs = [json.loads(x) for x in open(res["path"])]
    assert res["count"] == 5 == len(recs) and all(r["id"].startswith("self-") for r in recs)
    assert [r["messages"][0]["role"] for r in recs] == ["user"] * 5
    assert res["self_prompts"]["kept"] == 5 and (tmp_path / "attempts.jsonl").is_file()
    assert steps.prompts_key(data, FakeVerifier()) == {"data": steps.regeneration_key(data),
                                                        "fp": "f" * 16, "dtype": "float32"}
    assert steps.prompts_key(DataSection(), FakeVerifier()) == {"data": steps.regeneration_key(DataSection())}
    with pytest.raises(DraftsmithError, match="needs the verifier"):
        steps.prompts(data, tmp_path / "x")
