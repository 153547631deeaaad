"""Regeneration and hidden-state capture: exact values, resume, provenance, corruption, disk full, bad input.

Tiny random verifiers (conftest) with SmolLM2-135M's tokenizer (its vocabulary size).
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import interrupted_on_call, smollm2_tokenizer, tiny_model
from draftsmith.data import capture as C
from draftsmith.data import generation as G
from draftsmith.data import regenerate as R
from draftsmith.data import shards as SH
from draftsmith.data.chat import encode_chat
from draftsmith.data.conversation import Conversation
from draftsmith.data.tokenize import tokenize_conversation
from draftsmith.errors import DraftsmithError

V = 49152  # SmolLM2's vocabulary: the tiny models cover every token id
FP = "feedfacefeedface"


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def model(arch: str = "llama"):
    return tiny_model(arch, vocab=V, layers=4)


AUX = {"llama": None, "qwen3": [0, 2, 3], "gemma3": [1, 0]}  # gemma3's tiny config has 2 layers


def prompts(n: int = 7) -> list[Conversation]:
    words = "the sky is blue because air scatters short wavelengths more than long ones".split()
    return [Conversation([{"role": "user", "content": f"Q{i}: " + " ".join(words[: 2 + (5 * i) % 13])}],
                         id=f"q{i}", source="test") for i in range(n)]


def chats(n: int = 7) -> list[Conversation]:
    """Conversations of different lengths with replies (one multi-turn, one with a system turn)."""
    out = []
    for c in prompts(n):
        i = int(c.id[1:])
        msgs = list(c.messages) + [{"role": "assistant", "content": "Because " + "light bends " * (1 + i % 4)}]
        if i == 2:
            msgs = [{"role": "system", "content": "Be brief."}] + msgs
        if i == 3:
            msgs += [{"role": "user", "content": "And at sunset?"}, {"role": "assistant", "content": "Red."}]
        out.append(Conversation(msgs, id=c.id, source="test"))
    return out


def reference(m, ids: list[int], aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unbatched full forward: (aux [T, A*H], lm_head input [T, H], logits [T, V])."""
    seen = {}
    h = m.get_output_embeddings().register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    try:
        with torch.no_grad():
            out = m(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        h.remove()
    aux = torch.cat([out.hidden_states[i][0] for i in aux_layer_ids], -1)
    return aux, seen["x"][0], out.logits[0]


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != SH.MANIFEST}


# ----------------------------------------------------------------------------- capture values
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_shards_equal_an_unbatched_forward(tok, tmp_path, arch):
    m, convs = model(arch), chats()
    ids = C.resolve_aux_layer_ids(m, AUX[arch])
    C.capture_to_shards(m, tok, convs, tmp_path, fingerprint=FP, verifier_spec="tiny", aux_layer_ids=AUX[arch],
                        batch_size=3, samples_per_shard=4, dtype=torch.float32, progress=False)
    samples = list(SH.load_shards(tmp_path, FP))
    assert len(samples) == len(convs)
    for conv, s in zip(convs, samples):
        expect = tokenize_conversation(tok, conv.messages, 2048)
        assert s["input_ids"].tolist() == expect.input_ids
        assert s["loss_mask"].dtype == torch.bool and s["loss_mask"].int().tolist() == expect.loss_mask
        aux, last, logits = reference(m, expect.input_ids, ids)
        assert s["aux"].shape == (len(expect.input_ids), len(ids) * 64)
        torch.testing.assert_close(s["aux"], aux, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s["last"], last, atol=1e-5, rtol=1e-5)
        # `last` is exactly what lm_head reads, at every position
        torch.testing.assert_close(m.get_output_embeddings()(s["last"]), m.get_output_embeddings()(last),
                                   atol=1e-4, rtol=1e-5)
        if getattr(m.config, "final_logit_softcapping", None) is None:
            torch.testing.assert_close(m.get_output_embeddings()(s["last"]), logits, atol=1e-4, rtol=1e-5)
    manifest = SH.read_manifest(tmp_path)
    assert manifest["aux_layer_ids"] == ids and manifest["dtype"] == "float32" and manifest["complete"]
    assert manifest["total_tokens"] == sum(s["input_ids"].numel() for s in samples)
    assert manifest["total_loss_tokens"] == sum(int(s["loss_mask"].sum()) for s in samples)
    assert [e["samples"] for e in manifest["shards"]] == [4, 3]


def test_default_aux_layers_and_bfloat16_storage(tok):
    m = tiny_model("llama", vocab=V, layers=8)
    convs = chats(3)
    assert C.resolve_aux_layer_ids(m) == [2, 4, 5]
    full = list(C.capture_samples(m, tok, convs, dtype=torch.float32))
    half = list(C.capture_samples(m, tok, convs))  # default: bfloat16
    for a, b in zip(full, half):
        assert b["aux"].dtype == b["last"].dtype == torch.bfloat16 and b["aux"].shape == (a["aux"].shape[0], 3 * 64)
        assert torch.equal(b["aux"], a["aux"].to(torch.bfloat16))
        assert torch.equal(b["last"], a["last"].to(torch.bfloat16))


def test_batching_and_padding_do_not_change_values(tok):
    m, convs = model(), chats()
    one = list(C.capture_samples(m, tok, convs, batch_size=1, dtype=torch.float32))
    many = list(C.capture_samples(m, tok, convs, batch_size=5, window=3, dtype=torch.float32))
    assert len(one) == len(many) == len(convs)
    for a, b in zip(one, many):  # input order, whatever the batching
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["aux"], b["aux"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a["last"], b["last"], atol=1e-4, rtol=1e-4)


def test_online_mode_yields_what_the_shards_hold(tok, tmp_path):
    m, convs = model(), chats()
    online = list(C.capture_samples(m, tok, convs, batch_size=3, window=4))
    C.capture_to_shards(m, tok, convs, tmp_path, fingerprint=FP, verifier_spec="tiny", batch_size=3,
                        samples_per_shard=4, progress=False)
    stored = list(SH.load_shards(tmp_path, FP))
    ds = SH.ShardDataset(tmp_path, FP)
    assert len(ds) == len(stored) == len(online) and ds.aux_layer_ids == [2, 2, 1]
    for i, (a, b) in enumerate(zip(online, stored)):
        assert a.keys() == b.keys() == set(SH.SAMPLE_KEYS)
        assert all(torch.equal(a[k], b[k]) and torch.equal(ds[i][k], b[k]) for k in SH.SAMPLE_KEYS)
    assert all(torch.equal(x["aux"], y["aux"]) for x, y in zip(ds, stored))


def test_long_conversations_are_truncated_and_prompts_too_long_dropped(tok, tmp_path, caplog):
    m = model()
    long_prompt = Conversation([{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "ok"}],
                               id="long")
    convs = chats(3) + [long_prompt]
    samples = list(C.capture_samples(m, tok, convs, max_length=45))  # full lengths 41, 49, 43; prompt 111
    assert [s["input_ids"].numel() for s in samples] == [41, 45, 43]
    assert samples[1]["loss_mask"][-1] and "1 too long, 1 truncated" in caplog.text
    with pytest.raises(DraftsmithError, match="1 have prompts that fill --max-length 40"):
        list(C.capture_samples(m, tok, [long_prompt], max_length=40))
    with pytest.raises(DraftsmithError, match="no samples captured"):
        C.capture_to_shards(m, tok, [long_prompt], tmp_path, fingerprint=FP, verifier_spec="t", max_length=40,
                            progress=False)


def test_loop_cut_by_hand():
    # 50 distinct tokens, then a 5-token cycle. The 4-gram ending at i first repeats at i = 58
    # ((50..53) == (55..58)); from there every 4-gram repeats, so the last 32 hold >= 16 repeats
    # first at i = 58 + 15 = 73, and the cut keeps 32 more tokens: 73 + 1 + 32 = 106.
    looping = list(range(50)) + [100, 101, 102, 103, 104] * 20
    assert C.loop_cut(looping) == 106
    # negative controls: no repeat at all, and a loop too short to fill half a window, are kept whole
    assert C.loop_cut(list(range(200))) == 200
    sparse = list(range(60)) + [0, 1, 2, 3] * 3 + list(range(200, 260))  # 9 repeated 4-grams, then new text
    assert C.loop_cut(sparse) == len(sparse)
    assert C.loop_cut(looping[:70]) == 70  # the loop never fills half a window: nothing cut


def test_trim_loops_cuts_only_the_looping_reply(tok, tmp_path, caplog):
    m = model()
    loop_reply = "Paris is the capital. " + "It is a city. " * 40
    convs = chats(3) + [Conversation([{"role": "user", "content": "Capital of France?"},
                                      {"role": "assistant", "content": loop_reply}], id="loop")]
    whole = list(C.capture_samples(m, tok, convs))
    cut = list(C.capture_samples(m, tok, convs, trim_loops=True))
    assert "1 loop trimmed" in caplog.text
    for a, b in zip(whole[:3], cut[:3]):  # replies that do not loop are untouched
        assert all(torch.equal(a[k], b[k]) for k in SH.SAMPLE_KEYS)
    a, b = whole[3], cut[3]
    start = int(a["loss_mask"].int().argmax())
    expected = start + C.loop_cut(a["input_ids"][start:].tolist())  # one assistant span, ending in <|im_end|>
    assert b["input_ids"].numel() == expected < a["input_ids"].numel()
    assert torch.equal(b["input_ids"], a["input_ids"][:expected]) and torch.equal(b["loss_mask"], a["loss_mask"][:expected])
    assert torch.equal(b["aux"], a["aux"][:expected])  # a causal model: the kept prefix's states are unchanged
    out = tmp_path / "s"
    C.capture_to_shards(m, tok, convs, out, fingerprint=FP, verifier_spec="t", trim_loops=True, progress=False)
    manifest = SH.read_manifest(out)
    assert manifest["trim_loops"] is True and manifest["dropped"]["loop_trimmed"] == 1
    with pytest.raises(DraftsmithError, match="trim_loops=True, not False"):
        C.capture_to_shards(m, tok, convs, out, fingerprint=FP, verifier_spec="t", progress=False)


def test_bad_input_is_a_clear_error(tok, tmp_path):
    m = model()
    for call in (lambda c: C.capture_samples(m, tok, c),
                 lambda c: C.capture_to_shards(m, tok, c, tmp_path / "x", fingerprint=FP, verifier_spec="t"),
                 lambda c: R.regenerate(m, tok, c, tmp_path / "r.jsonl", progress=False)):
        with pytest.raises(DraftsmithError, match="the dataset is empty"):
            call([])
    with pytest.raises(DraftsmithError, match="none of the 7 conversations has an assistant turn"):
        C.capture_samples(m, tok, prompts())  # raised at the call, not at the first next()
    with pytest.raises(DraftsmithError, match="none of the 7"):
        C.capture_to_shards(m, tok, prompts(), tmp_path / "y", fingerprint=FP, verifier_spec="t")
    assert not (tmp_path / "y").exists()
    with pytest.raises(DraftsmithError, match=r"aux layer ids \[4\] out of range for a 4-layer"):
        C.capture_samples(m, tok, chats(), aux_layer_ids=[4])
    with pytest.raises(DraftsmithError, match="needs >= 4 layers"):
        C.capture_samples(model("gemma3"), tok, chats())
    with pytest.raises(DraftsmithError, match="is not a capture directory"):
        list(SH.load_shards(tmp_path))


# ----------------------------------------------------------------------------- shards: resume, provenance, damage
def capture(m, tok, convs, out, **kw):
    kw = {"fingerprint": FP, "verifier_spec": "tiny", "batch_size": 2, "samples_per_shard": 3, "progress": False,
          **kw}
    return C.capture_to_shards(m, tok, convs, out, **kw)


def test_capture_resumes_to_byte_identical_shards(tok, tmp_path, monkeypatch):
    m, convs = model(), chats()
    capture(m, tok, convs, tmp_path / "full")

    real = C._capture_window
    monkeypatch.setattr(C, "_capture_window", interrupted_on_call(real))  # in the second shard
    with pytest.raises(KeyboardInterrupt):
        capture(m, tok, convs, tmp_path / "cut")
    assert [p.name for p in (tmp_path / "cut").iterdir()] and not SH.read_manifest(tmp_path / "cut")["complete"]
    assert len(list(SH.load_shards(tmp_path / "cut", FP))) == 3  # a partial capture is usable
    monkeypatch.setattr(C, "_capture_window", real)
    recomputed = []
    monkeypatch.setattr(C, "_capture_window", lambda *a, **k: recomputed.append(1) or real(*a, **k))
    capture(m, tok, convs, tmp_path / "cut")
    assert len(recomputed) == 2  # shard 0 was kept, 1 and 2 computed
    assert files(tmp_path / "cut") == files(tmp_path / "full") and len(files(tmp_path / "full")) == 3
    full, cut = (SH.read_manifest(tmp_path / d) for d in ("full", "cut"))
    assert full["shards"] == cut["shards"] and cut["complete"]
    # A finished capture re-runs as a no-op; other settings or another verifier are refused.
    recomputed.clear()
    capture(m, tok, convs, tmp_path / "cut")
    assert not recomputed
    with pytest.raises(DraftsmithError, match="max_length=512, not 100"):
        capture(m, tok, convs, tmp_path / "cut", max_length=100)
    with pytest.raises(DraftsmithError, match=f"captured from verifier {FP}, not 0123"):
        capture(m, tok, convs, tmp_path / "cut", fingerprint="0123")


def test_foreign_shard_is_refused(tok, tmp_path):
    m, other = model(), tiny_model("llama", seed=1, vocab=V, layers=4)
    capture(m, tok, chats(), tmp_path / "a")
    capture(other, tok, chats(), tmp_path / "b", fingerprint="0badc0de0badc0de")
    with pytest.raises(DraftsmithError, match=f"was captured from verifier {FP}, not 0badc0de0badc0de"):
        list(SH.load_shards(tmp_path / "a", "0badc0de0badc0de"))
    with pytest.raises(DraftsmithError, match="not 0badc0de0badc0de"):
        SH.ShardDataset(tmp_path / "a", "0badc0de0badc0de")
    # a shard of the other verifier copied into the directory: refused by its own metadata, named
    shard = tmp_path / "a" / "shard-00001.safetensors"
    shard.write_bytes((tmp_path / "b" / "shard-00001.safetensors").read_bytes())
    msg = rf"shard {shard} was captured from verifier 0badc0de0badc0de, not {FP}"
    with pytest.raises(DraftsmithError, match=msg):
        list(SH.load_shards(tmp_path / "a", FP))
    with pytest.raises(DraftsmithError, match=msg):
        [SH.ShardDataset(tmp_path / "a", FP)[i] for i in range(7)]
    with pytest.raises(DraftsmithError, match="not " + FP):
        SH.read_shard(shard, FP)


def test_training_on_several_capture_directories(tok, tmp_path):
    """`draftsmith train --data A B` trains on both; the draft reads the layers the shards hold."""
    from draftsmith.models.speculators import read_draft
    from draftsmith.train.loop import TrainConfig, train

    m, convs = model(), chats()
    layers = [0, 2, 3]  # not the default [2, n//2, n-3] = [2, 2, 1] of a 4-layer verifier
    capture(m, tok, convs[:4], tmp_path / "a", aux_layer_ids=layers)
    capture(m, tok, convs[4:], tmp_path / "b", aux_layer_ids=layers)
    samples, held = SH.load_capture_dirs([tmp_path / "a", tmp_path / "b"], FP)
    assert held == layers and [s["input_ids"].tolist() for s in samples] == \
        [s["input_ids"].tolist() for d in "ab" for s in SH.load_shards(tmp_path / d, FP)]
    assert len(samples) == len(convs)

    def run(dirs, out):
        cfg = TrainConfig(verifier="tiny", data=[str(d) for d in dirs], out=str(tmp_path / out), draft_vocab_size=64,
                          pack_tokens=64, max_steps=2, val_fraction=0.0, precision="fp32", ttt_steps=2,
                          eval_every=1000, checkpoint_every=1000)
        return train(cfg, verifier=m, fingerprint=FP, progress=False)

    res = run([tmp_path / "a", tmp_path / "b"], "run")
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["num_samples"] == len(convs)
    assert read_draft(res.draft_dir).config.aux_layer_ids == layers
    # refused: other layers, the same directory twice, another verifier's capture
    capture(m, tok, convs[4:], tmp_path / "c", aux_layer_ids=[1, 2, 3])
    with pytest.raises(DraftsmithError, match=r"different verifier layers.*aux layers \[1, 2, 3\]"):
        run([tmp_path / "a", tmp_path / "c"], "run2")
    with pytest.raises(DraftsmithError, match="named more than once"):
        run([tmp_path / "a", tmp_path / "a"], "run3")
    capture(m, tok, convs[4:], tmp_path / "d", fingerprint="0badc0de0badc0de", aux_layer_ids=layers)
    with pytest.raises(DraftsmithError, match="not " + FP):
        run([tmp_path / "a", tmp_path / "d"], "run4")


def test_vocab_data_chooses_the_vocabulary_from_other_captures(tok, tmp_path):
    """--vocab-data counts the draft vocabulary over the named captures, not the training data:
    fresh drafts select from those counts, --extend-vocab grows from them; a foreign capture is refused."""
    from draftsmith.models.vocab import grow_vocab, select_vocab, token_counts
    from draftsmith.train.loop import TrainConfig, train

    m, convs = model(), chats()
    capture(m, tok, convs[:2], tmp_path / "a")
    capture(m, tok, convs[2:], tmp_path / "b")
    V = m.get_output_embeddings().weight.shape[0]
    counts_a = token_counts(SH.load_shards(tmp_path / "a", FP), V)
    counts_ab = counts_a + token_counts(SH.load_shards(tmp_path / "b", FP), V)

    def run(out, **kw):
        cfg = TrainConfig(verifier="tiny", data=[str(tmp_path / "a")], out=str(tmp_path / out), pack_tokens=64,
                          max_steps=1, val_fraction=0.0, precision="fp32", ttt_steps=2, eval_every=1000,
                          checkpoint_every=1000, **kw)
        return train(cfg, verifier=m, fingerprint=FP, progress=False).draft

    size = int((counts_a > 0).sum()) + 4  # a's tokens plus a few: which ones join depends on the counts
    own = run("own", draft_vocab_size=size)
    assert own.draft_to_target.tolist() == select_vocab(counts_a, size).tolist()
    both = run("both", draft_vocab_size=size, vocab_data=[str(tmp_path / "a"), str(tmp_path / "b")])
    assert both.draft_to_target.tolist() == select_vocab(counts_ab, size).tolist()
    assert both.draft_to_target.tolist() != own.draft_to_target.tolist()  # the control: b's counts mattered
    small = run("small", draft_vocab_size=8)
    from draftsmith.export import save_draft

    save_draft(small, tmp_path / "small-draft", fingerprint=FP)
    grown = run("grown", draft_vocab_size=size, init_from=str(tmp_path / "small-draft"), extend_vocab=True,
                vocab_data=[str(tmp_path / "b")])
    counts_b = counts_ab - counts_a
    assert grown.draft_to_target.tolist() == grow_vocab(counts_b, small.draft_to_target, size).tolist()
    capture(m, tok, convs[2:], tmp_path / "foreign", fingerprint="0badc0de0badc0de")
    with pytest.raises(DraftsmithError, match="not " + FP):
        run("foreign", draft_vocab_size=size, vocab_data=[str(tmp_path / "foreign")])


def test_corrupt_shard_is_refused_with_its_name(tok, tmp_path, monkeypatch):
    m, convs = model(), chats()
    capture(m, tok, convs, tmp_path / "full")
    capture(m, tok, convs, tmp_path / "d")
    shard = tmp_path / "d" / "shard-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftsmithError, match=rf"shard {shard} is corrupt"):
        list(SH.load_shards(tmp_path / "d", FP))
    with pytest.raises(DraftsmithError, match=rf"shard {shard} is corrupt"):
        SH.ShardDataset(tmp_path / "d", FP)[4]
    with pytest.raises(DraftsmithError, match=rf"shard {shard} is corrupt"):
        SH.read_shard(shard)  # without the manifest: safetensors' own size checks
    shard.write_bytes(b"\x00" * 4)
    with pytest.raises(DraftsmithError, match=rf"shard {shard} is corrupt or not a draftsmith shard"):
        SH.read_shard(shard, FP)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    shard.write_bytes(bytes(flipped))  # same size, one bit of data changed: only the checksum sees it
    with pytest.raises(DraftsmithError, match="checksum does not match"):
        list(SH.load_shards(tmp_path / "d", FP))
    (tmp_path / "d" / SH.MANIFEST).write_text("{not json")
    with pytest.raises(DraftsmithError, match="manifest.json is corrupt"):
        list(SH.load_shards(tmp_path / "d", FP))
    # re-running the capture rebuilds the damaged shard from the manifest of the copy
    (tmp_path / "d" / SH.MANIFEST).write_bytes((tmp_path / "full" / SH.MANIFEST).read_bytes())
    capture(m, tok, convs, tmp_path / "d")
    assert files(tmp_path / "d") == files(tmp_path / "full")


def test_disk_full_leaves_no_partial_shard(tok, tmp_path, monkeypatch):
    m, convs = model(), chats()
    capture(m, tok, convs, tmp_path / "full")
    real_fsync = os.fsync

    def full_disk(fd):
        if "shard-00001" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(DraftsmithError, match=r"shard-00001.safetensors: the disk is full; completed shards are kept"):
        capture(m, tok, convs, tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [SH.MANIFEST, "shard-00000.safetensors"]
    assert len(list(SH.load_shards(tmp_path / "d", FP))) == 3
    monkeypatch.setattr(os, "fsync", real_fsync)
    capture(m, tok, convs, tmp_path / "d")
    assert files(tmp_path / "d") == files(tmp_path / "full")


# ----------------------------------------------------------------------------- regeneration
def regen(m, tok, convs, path, **kw):
    # chunks of 4 prompts, 2 rows decoding at a time: rows refill within a chunk
    kw = {"max_new_tokens": 10, "batch_size": 2, "chunk_batches": 2, "progress": False, **kw}
    return R.regenerate(m, tok, convs, path, **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_regenerate_resumes_to_an_identical_file(tok, tmp_path, monkeypatch, temperature):
    m, convs = model(), prompts()
    full = regen(m, tok, convs, tmp_path / "full.jsonl", temperature=temperature, seed=3)
    real = R.generate_batch
    monkeypatch.setattr(R, "generate_batch", interrupted_on_call(real))  # after the first chunk
    cut = tmp_path / "cut.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regen(m, tok, convs, cut, temperature=temperature, seed=3)
    lines = cut.read_bytes().splitlines(keepends=True)
    assert len(lines) == 4
    # the run also died inside a write: a torn line, and one line of the next chunk already out
    text = full.read_bytes().splitlines(keepends=True)
    cut.write_bytes(b"".join(lines) + text[4] + text[5][:17])
    monkeypatch.setattr(R, "generate_batch", real)
    regen(m, tok, convs, cut, temperature=temperature, seed=3)
    assert cut.read_bytes() == full.read_bytes()
    recs = [json.loads(x) for x in text]
    assert sorted(r["id"] for r in recs) == sorted(c.id for c in convs)
    other = regen(m, tok, convs, tmp_path / "seed4.jsonl", temperature=temperature, seed=4)
    replies = [[json.loads(x)["messages"] for x in p.read_text().splitlines()] for p in (full, other)]
    assert (replies[0] == replies[1]) == (temperature == 0.0)


def test_regenerate_stops_starting_chunks_at_its_deadline(tok, tmp_path):
    """A budgeted run's deadline: no chunk starts after it (the first always runs), the finished
    chunks are the file, and a run without one later resumes it to the uninterrupted file."""
    m, convs = model(), prompts()
    full = regen(m, tok, convs, tmp_path / "full.jsonl")
    stops: list[tuple[int, int]] = []
    cut = regen(m, tok, convs, tmp_path / "cut.jsonl", deadline=time.perf_counter(),
                on_stop=lambda kept, left: stops.append((kept, left)))
    lines = full.read_bytes().splitlines(keepends=True)
    assert cut.read_bytes() == b"".join(lines[:4])  # one chunk of 4 prompts, the longest
    assert stops == [(4, 3)]
    regen(m, tok, convs, cut)
    assert cut.read_bytes() == full.read_bytes()
    # control: a deadline not reached stops nothing
    again: list = []
    late = regen(m, tok, convs, tmp_path / "late.jsonl", deadline=time.perf_counter() + 3600,
                 on_stop=lambda kept, left: again.append((kept, left)))
    assert late.read_bytes() == full.read_bytes() and again == []


def test_regenerated_records(tok, tmp_path):
    m, convs = model(), prompts(5)
    convs[0].meta = {"category": "x"}
    path = regen(m, tok, convs, tmp_path / "r.jsonl", max_new_tokens=6, fingerprint=FP)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in recs}
    # batches are the longest prompts first; each batch is written in input order
    lengths = {c.id: len(encode_chat(tok, c.prompt_messages())) for c in convs}
    by_length = sorted(lengths, key=lambda i: (-lengths[i], int(i[1:])))
    assert [r["id"] for r in recs[:2]] == sorted(by_length[:2], key=lambda i: int(i[1:]))
    assert [r["id"] for r in recs[2:4]] == sorted(by_length[2:4], key=lambda i: int(i[1:]))
    for c in convs:
        r = by_id[c.id]
        assert r["messages"][:-1] == c.prompt_messages() and r["messages"][-1]["role"] == "assistant"
        meta = r["meta"]
        assert meta["finish_reason"] in ("stop", "length") and meta["prompt_tokens"] == lengths[c.id]
        assert 1 <= meta["completion_tokens"] <= 6 and meta["generation"]["verifier"] == FP
        assert meta["source"] == "test"
    assert by_id["q0"]["meta"]["category"] == "x"
    # the file is training data as it stands
    back = R.load_regenerated(path)
    assert [c.id for c in back] == [r["id"] for r in recs] and all(c.has_assistant for c in back)
    assert len(list(C.capture_samples(m, tok, back))) == 5
    # a torn last line (a run still writing, or killed) is left out, and the reader leaves the file as it is
    torn = path.read_bytes() + b'{"id": "q9", "mess'
    path.write_bytes(torn)
    assert [c.id for c in R.load_regenerated(path)] == [c.id for c in back] and path.read_bytes() == torn
    # greedy replies do not depend on the batch a prompt shares (left padding is masked)
    alone = regen(m, tok, convs, tmp_path / "one.jsonl", max_new_tokens=6, fingerprint=FP, batch_size=1)
    assert {r["id"]: r for r in map(json.loads, alone.read_text().splitlines())} == by_id
    with pytest.raises(DraftsmithError, match=r"other settings \(max_new_tokens differ"):
        regen(m, tok, convs, path, max_new_tokens=7, fingerprint=FP)
    with pytest.raises(DraftsmithError, match="not in this dataset"):
        regen(m, tok, prompts(2), path, max_new_tokens=6, fingerprint=FP)


def test_regenerate_bad_input(tok, tmp_path, caplog):
    m, convs = model(), prompts(4)
    with pytest.raises(DraftsmithError, match="id 'q1' occurs twice"):
        regen(m, tok, convs + [convs[1]], tmp_path / "a.jsonl")
    # the tiny verifier's context is 512 tokens: prompt + max_new_tokens must fit
    with pytest.raises(DraftsmithError, match="all 4 prompts are longer than 12 tokens"):
        regen(m, tok, convs, tmp_path / "b.jsonl", max_new_tokens=500)
    with pytest.raises(DraftsmithError, match="leaves no room"):
        regen(m, tok, convs, tmp_path / "b.jsonl", max_new_tokens=512)
    long_ids = {c.id for c in convs if len(encode_chat(tok, c.prompt_messages())) > 40}
    path = regen(m, tok, convs, tmp_path / "c.jsonl", max_prompt_tokens=40)
    assert 0 < len(long_ids) < 4 and f"dropped {len(long_ids)} of 4 prompts" in caplog.text
    assert {json.loads(x)["id"] for x in path.read_text().splitlines()} == {c.id for c in convs} - long_ids
    with pytest.raises(DraftsmithError, match="line 1 is not a regenerated record"):
        (tmp_path / "d.jsonl").write_text('{"hello": 1}\n')
        regen(m, tok, convs, tmp_path / "d.jsonl")
    with pytest.raises(DraftsmithError, match="--temperature must be >= 0"):
        regen(m, tok, convs, tmp_path / "e.jsonl", temperature=-1)


def test_regenerate_disk_full_keeps_finished_replies(tok, tmp_path, monkeypatch):
    m, convs = model(), prompts()
    full = regen(m, tok, convs, tmp_path / "full.jsonl", chunk_batches=1)
    real_fsync, calls = os.fsync, []

    def full_disk(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(DraftsmithError, match="the disk is full; the 4 finished replies are kept"):
        regen(m, tok, convs, tmp_path / "cut.jsonl", chunk_batches=1)
    monkeypatch.setattr(os, "fsync", real_fsync)
    regen(m, tok, convs, tmp_path / "cut.jsonl", chunk_batches=1)
    assert (tmp_path / "cut.jsonl").read_bytes() == full.read_bytes()


def test_per_sample_sampler_draws_from_the_shared_transform():
    from draftsmith.decoding.sampling import SamplingParams, logits_to_probs

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, -8.0, 1.5]])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    n = 40_000
    sampler = G._PerSampleSampler(params, [torch.Generator().manual_seed(G.sample_seed(0, str(i))) for i in range(n)])
    forced = sampler(None, logits.expand(n, -1).clone())
    assert torch.isfinite(forced).sum(-1).eq(1).all()  # exactly one token allowed per row
    freq = torch.bincount(forced.argmax(-1), minlength=8).double() / n
    p = logits_to_probs(logits.double(), params)[0]
    assert (freq[p == 0] == 0).all()  # top-p removed tokens are never drawn
    assert 0.5 * (freq - p).abs().sum() < 0.01  # TV distance; ~0.004 expected at n = 40k
    # a row's draw depends on its own generator only, not on its neighbours
    again = G._PerSampleSampler(params, [torch.Generator().manual_seed(G.sample_seed(0, str(i))) for i in (5, 7)])
    assert torch.equal(again(None, logits.expand(2, -1).clone()).argmax(-1), forced.argmax(-1)[[5, 7]])


def test_sampled_replies_do_not_depend_on_the_batch(tok, tmp_path):
    m, convs = model(), prompts(4)
    a = regen(m, tok, convs, tmp_path / "a.jsonl", max_new_tokens=6, temperature=0.9, batch_size=4)
    b = regen(m, tok, convs, tmp_path / "b.jsonl", max_new_tokens=6, temperature=0.9, batch_size=1)
    by_id = [{r["id"]: r for r in map(json.loads, p.read_text().splitlines())} for p in (a, b)]
    assert by_id[0] == by_id[1]


@pytest.mark.slow
def test_real_verifier_greedy_replies_are_what_the_captured_states_predict(smollm2, tmp_path):
    """SmolLM2-135M: regenerate greedily, capture, and lm_head(last) predicts each reply token again."""
    m, tok, fp = smollm2
    convs = [Conversation([{"role": "user", "content": q}], id=str(i)) for i, q in
             enumerate(["What is the capital of France?", "Name three primary colors."])]
    path = R.regenerate(m, tok, convs, tmp_path / "r.jsonl", max_new_tokens=16, progress=False, fingerprint=fp)
    out = C.capture_to_shards(m, tok, R.load_regenerated(path), tmp_path / "shards", fingerprint=fp,
                              verifier_spec="smollm2-135m", max_length=256, dtype=torch.float32, progress=False)
    samples = list(SH.load_shards(out, fp))
    assert len(samples) == 2 and SH.read_manifest(out)["aux_layer_ids"] == [2, 15, 27]
    hits = total = 0
    for s in samples:
        pos = s["loss_mask"].nonzero()[:, 0][:-1]  # reply tokens; the end-of-turn token may be the template's
        with torch.no_grad():
            pred = m.get_output_embeddings()(s["last"][pos - 1]).argmax(-1)  # the state at t-1 predicts token t
        hits += int((pred == s["input_ids"][pos]).sum())
        total += len(pos)
    assert hits / total > 0.9  # re-tokenizing the decoded reply may split a token differently, rarely


def test_padded_tokens_count_what_the_batches_run():
    """Budget calibration prices capture per position run: batches sorted by length, padded to their longest."""
    from draftsmith.data.capture import length_batches, padded_tokens

    lengths = [10, 3, 7, 2, 9]
    assert length_batches(lengths, 2) == [[0, 4], [2, 1], [3]]
    assert padded_tokens(lengths, 2) == 2 * 10 + 2 * 7 + 1 * 2 == 36 > sum(lengths)
    assert padded_tokens(lengths, 1) == sum(lengths)  # one sequence per batch: no padding
