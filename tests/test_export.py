"""Export to the speculators format: schema, round trip, validation, reading others' drafts, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_factory import DRAFT_VOCAB, LAYERS, VOCAB, random_draft, save_verifier, tiny_verifier, ttt_inputs
from draftsmith import generate
from draftsmith.cli import main
from draftsmith.drafters import build_proposer
from draftsmith.errors import DraftsmithError
from draftsmith.drafters import load_draft
from draftsmith.export import save_draft
from draftsmith.models.speculators import read_draft, read_provenance
from draftsmith.decoding.proposers import Eagle3Proposer

FLAGS = {
    "default": {},
    "speculators_cli": {"norm_before_fc": True, "norm_output": True},
    "fc_norm": {"fc_norm": True, "norm_before_residual": False},
    "qwen3_bias": {"qk_norm": True, "attention_bias": True},
}


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    return save_verifier(tiny_verifier(), tmp_path_factory.mktemp("verifier"))


def _export(tmp_path, verifier_dir, name="draft", vd=DRAFT_VOCAB, flags=None, **kw):
    d = random_draft(tiny_verifier(), vd=vd, **(flags or {}))
    return d, save_draft(d, tmp_path / name, verifier_name=str(verifier_dir), **kw)


def _ttt(draft, steps=3):
    aux, ids, pos, mask = ttt_inputs(draft.config)
    with torch.no_grad():
        return draft.forward_ttt(aux.to(draft.fc.weight.dtype), ids, pos, mask, steps)


def test_config_json_is_the_speculators_schema(tmp_path, verifier_dir):
    d, out = _export(tmp_path, verifier_dir, num_draft_tokens=4, fingerprint="abc123")
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["architectures"] == ["Eagle3DraftModel"]
    assert c["speculators_version"] == "0.9.0"
    assert c["draft_vocab_size"] == DRAFT_VOCAB and c["target_hidden_size"] is None
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, LAYERS // 2, LAYERS - 3]
    assert {k: c[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == {
        "norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
    tl = c["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["num_hidden_layers"] == 1 and tl["vocab_size"] == VOCAB
    assert (tl["hidden_size"], tl["num_attention_heads"], tl["num_key_value_heads"], tl["head_dim"]) == (64, 4, 2, 16)
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4,
                                       "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert sc["verifier"] == {"name_or_path": str(verifier_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    t = load_file(str(out / "model.safetensors"))
    assert t["d2t"].dtype == torch.int64 and t["d2t"].shape == (DRAFT_VOCAB,)
    assert t["t2d"].dtype == torch.bool and int(t["t2d"].sum()) == DRAFT_VOCAB
    # speculators semantics: target id = i + d2t[i], and the draft ids enumerate t2d in order
    assert torch.equal(torch.arange(DRAFT_VOCAB) + t["d2t"], torch.nonzero(t["t2d"]).squeeze(1))
    assert t["fc.weight"].shape == (64, 3 * 64) and t["lm_head.weight"].shape == (DRAFT_VOCAB, 64)
    assert t["layers.0.self_attn.q_proj.weight"].shape == (64, 128)
    assert not any(k.startswith(("verifier_", "rotary_emb")) for k in t)
    assert set(t) == {k for k in d.state_dict() if not k.startswith("rotary_emb.")}
    prov = read_provenance(out)
    assert prov["verifier"]["fingerprint"] == "abc123" and prov["versions"]["torch"] == torch.__version__
    assert "draftsmith" not in c and "created" not in json.dumps(c)  # provenance stays out of config.json


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("vd", [DRAFT_VOCAB, None])
def test_round_trip_is_byte_identical(tmp_path, verifier_dir, flags, vd):
    d, a = _export(tmp_path, verifier_dir, "a", vd=vd, flags=FLAGS[flags], num_draft_tokens=3)
    loaded = read_draft(a)
    b = save_draft(loaded, tmp_path / "b")
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert ("d2t" in ta) == (vd is not None)
    for x, y in zip(_ttt(d), _ttt(loaded)):
        assert torch.equal(x, y)


def test_bfloat16_export_reads_back(tmp_path, verifier_dir):
    d, out = _export(tmp_path, verifier_dir, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    t = load_file(str(out / "model.safetensors"))
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64
    loaded = read_draft(out)
    assert loaded.fc.weight.dtype == torch.bfloat16
    again = save_draft(loaded, tmp_path / "again")
    assert (out / "config.json").read_bytes() == (again / "config.json").read_bytes()
    up = read_draft(out, dtype=torch.float32)
    for x, y in zip(_ttt(d), _ttt(up)):
        torch.testing.assert_close(x, y, atol=0.15, rtol=0.05)  # bf16 weights, fp32 compute


def test_loaded_draft_decodes_like_the_in_memory_one(tmp_path):
    """Greedy output == the verifier's; every stat (and sampled output) == the in-memory draft's."""
    verifier = tiny_verifier()
    vdir = save_verifier(verifier, tmp_path / "verifier")
    d = random_draft(verifier, aux_layer_ids=[1, 3, 4])
    out = save_draft(d, tmp_path / "draft", verifier_name=str(vdir))
    loaded = load_draft(out, verifier)
    assert isinstance(loaded, Eagle3Proposer)
    prompt = torch.randint(2, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = generate(verifier, prompt, max_new_tokens=24, eos_token_id=[]).token_ids
    drop = ("seconds", "prefill_seconds", "tokens_per_second")
    for temperature, seed in ((0.0, None), (1.0, 7)):
        runs = [generate(verifier, prompt, proposer=p, max_new_tokens=24, num_draft_tokens=3, eos_token_id=[],
                         temperature=temperature, seed=seed) for p in (Eagle3Proposer(d), loaded)]
        if temperature == 0.0:
            assert runs[0].token_ids == plain == runs[1].token_ids
        assert runs[0].token_ids == runs[1].token_ids
        s0, s1 = ({k: v for k, v in r.stats.items() if k not in drop} for r in runs)
        assert s0 == s1 and s0["drafts"] > 0 and s0["accepted_tokens"] > 0
    assert isinstance(build_proposer(str(out), verifier, tokenizer=None), Eagle3Proposer)


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 32}, "hidden size is 32"),
    ({"vocab_size": 96}, "vocabulary has 96 tokens"),
    ({"num_hidden_layers": 3}, "must lie in [0, 2]"),
])
def test_export_refuses_a_mismatched_verifier(tmp_path, change, message):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2)
    cfg.update(change)
    other = LlamaForCausalLM(LlamaConfig(**cfg))
    other_dir = save_verifier(other, tmp_path / "other")
    d = random_draft(tiny_verifier())
    with pytest.raises(DraftsmithError, match=message.replace("[", r"\[").replace("]", r"\]")):
        save_draft(d, tmp_path / "draft", verifier_name=str(other_dir))
    assert not (tmp_path / "draft").exists()
    good = save_draft(d, tmp_path / "good", verifier_name=str(other_dir), verifier=tiny_verifier())
    with pytest.raises(DraftsmithError, match="does not match the verifier"):
        load_draft(good, other)


def test_export_refuses_repeated_layer_ids(tmp_path, verifier_dir):
    d = random_draft(tiny_verifier(), aux_layer_ids=[2, 2, 5])
    with pytest.raises(DraftsmithError, match="must be distinct"):
        save_draft(d, tmp_path / "draft", verifier_name=str(verifier_dir))


def _rewrite(out, edit_config=None, edit_tensors=None):
    if edit_config:
        c = json.loads((out / "config.json").read_text())
        edit_config(c)
        (out / "config.json").write_text(json.dumps(c))
    if edit_tensors:
        t = load_file(str(out / "model.safetensors"))
        edit_tensors(t)
        save_file(t, str(out / "model.safetensors"))


@pytest.mark.parametrize("edit_config,edit_tensors,message", [
    (lambda c: c.pop("speculators_model_type"), None, "no 'speculators_model_type'"),
    (lambda c: c.update(speculators_model_type="mlp"), None, "'mlp' is not supported"),
    (lambda c: c["transformer_layer_config"].update(model_type="mistral"), None, "model_type 'mistral'"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), None, "num_hidden_layers=2"),
    (lambda c: c["transformer_layer_config"].pop("hidden_size"), None, "no 'hidden_size'"),
    (lambda c: c.update(norm_output="yes"), None, "'norm_output' must be true/false"),
    (lambda c: c.update(draft_vocab_size=4.5), None, "'draft_vocab_size' must be an integer"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids="2,3"), None, "eagle_aux_hidden_state_layer_ids"),
    (lambda c: c.update(norm_before_fc=True, fc_norm=True), None, "cannot both be set"),
    (lambda c: c.update(norm_before_fc=True), None, "lacks input_norm.weight"),
    (None, lambda t: t.pop("fc.weight"), "lacks fc.weight"),
    (None, lambda t: t.update(extra=torch.zeros(1)), "does not define: extra"),
    (None, lambda t: t.update({"fc.weight": torch.zeros(64, 64)}), "fc.weight has shape"),
    (None, lambda t: [t.pop("d2t"), t.pop("t2d")], "no d2t / t2d"),
    (None, lambda t: t.update(d2t=t["d2t"] + 1000), "outside"),
    (None, lambda t: t["t2d"].copy_(torch.roll(t["t2d"], 1)), "disagree|marks"),
])
def test_read_errors_name_the_problem(tmp_path, verifier_dir, edit_config, edit_tensors, message):
    _, out = _export(tmp_path, verifier_dir)
    _rewrite(out, edit_config, edit_tensors)
    with pytest.raises(DraftsmithError, match=message):
        read_draft(out)


def test_reads_drafts_without_embeddings_or_half_the_vocab_map(tmp_path):
    """Others' drafts may omit embed_tokens (vLLM shares the verifier's), d2t or t2d, or the aux ids."""
    verifier = tiny_verifier()
    d, out = _export(tmp_path, save_verifier(verifier, tmp_path / "v"))
    ref = _ttt(d)
    _rewrite(out, lambda c: c.update(eagle_aux_hidden_state_layer_ids=None),
             lambda t: [t.pop("embed_tokens.weight"), t.pop("t2d")])
    with pytest.raises(DraftsmithError, match="load it against its verifier"):
        read_draft(out)
    assert read_draft(out, verifier_layers=LAYERS).embed_tokens_from_verifier
    with torch.no_grad():
        d.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    prop = load_draft(out, verifier)
    assert torch.equal(prop.draft.t2d, d.t2d) and torch.equal(prop.draft.d2t, d.d2t)
    for x, y in zip(_ttt(d), _ttt(prop.draft)):
        assert torch.equal(x, y)
    assert not all(torch.equal(x, y) for x, y in zip(ref, _ttt(d)))  # the embedding did change
    again = save_draft(prop.draft, tmp_path / "again")
    assert "embed_tokens.weight" not in load_file(str(again / "model.safetensors"))  # stays shared


def test_model_card(tmp_path, verifier_dir):
    metrics = {"acceptance_length": 2.75, "per_position_acceptance": [0.8, 0.6, 0.35], "speedup": 1.9}
    training = {"dataset": "sharegpt", "samples": 5000, "epochs": 2}
    _, out = _export(tmp_path, verifier_dir, num_draft_tokens=3, fingerprint="f00d", metrics=metrics,
                     provenance={"training": training})
    card = (out / "README.md").read_text()
    assert "f00d" in card and str(verifier_dir.resolve()) in card
    assert f"vllm serve {out.resolve()}\n" in card
    assert (f"vllm serve {verifier_dir.resolve()} \\\n    --speculative-config "
            f"'{{\"model\": \"{out.resolve()}\", \"method\": \"eagle3\", \"num_speculative_tokens\": 3}}'") in card
    assert "acceptance length: 2.75" in card and "| acceptance | 0.800 | 0.600 | 0.350 |" in card
    assert "1.9x" in card and "dataset: sharegpt" in card and "samples: 5000" in card
    assert torch.__version__ in card
    _, bare = _export(tmp_path, verifier_dir, "bare")
    assert "Not measured yet" in (bare / "README.md").read_text()


def test_write_model_card_records_new_metrics(tmp_path, verifier_dir):
    from draftsmith.export import write_model_card

    _, out = _export(tmp_path, verifier_dir, fingerprint="f2")
    before = {f: (out / f).read_bytes() for f in ("config.json", "model.safetensors")}
    write_model_card(out, {"acceptance_length": 3.1, "per_position_acceptance": [0.9, 0.7], "speedup": 2.2})
    card = (out / "README.md").read_text()
    assert "acceptance length: 3.1" in card and "2.2x" in card and "f2" in card and "parameters" in card
    assert read_provenance(out)["metrics"]["speedup"] == 2.2
    assert before == {f: (out / f).read_bytes() for f in before}


def test_cli_export_reexports_with_new_k_and_name(tmp_path, verifier_dir, capsys):
    d, src = _export(tmp_path, verifier_dir, num_draft_tokens=5, fingerprint="f1",
                     metrics={"acceptance_length": 2.0}, provenance={"training": {"steps": 10}})
    other = save_verifier(tiny_verifier(seed=1), tmp_path / "same-shape")
    rc = main(["export", str(src), "--out", str(tmp_path / "out"), "--num-draft-tokens", "2",
               "--verifier-name", str(other)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "vllm serve" in printed and "--speculative-config" in printed
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert c["speculators_config"]["verifier"]["name_or_path"] == str(other.resolve())
    prov = read_provenance(tmp_path / "out")
    assert prov["verifier"]["fingerprint"] == "f1" and prov["training"] == {"steps": 10}
    assert prov["metrics"] == {"acceptance_length": 2.0} and prov["source"]["path"] == str(src.resolve())
    # re-exporting with the same settings reproduces config.json and the weights
    assert main(["export", str(tmp_path / "out"), "--out", str(tmp_path / "out2")]) == 0
    assert (tmp_path / "out" / "config.json").read_bytes() == (tmp_path / "out2" / "config.json").read_bytes()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (tmp_path / "out2" / "model.safetensors").read_bytes()


def test_cli_export_errors_are_one_line(tmp_path, verifier_dir, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, src = _export(tmp_path, verifier_dir)
    wide = save_verifier(LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=LAYERS, num_attention_heads=4)),
                         tmp_path / "wide")
    assert main(["export", str(src), "--out", str(tmp_path / "x"), "--verifier-name", str(wide)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftsmith: error: draft (for verifier") and "hidden size is 32" in err
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "y")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
