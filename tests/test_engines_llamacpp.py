"""llama.cpp as a real engine (``make setup-llamacpp``): the GGUF export, llama-server plain and with an EAGLE-3 draft.

Runs the packaged SmolLM2-135M (its Q4_1 GGUF, as llama.cpp serves it) with a
random-weight draft of SmolLM2's shapes: the draft is almost always wrong, which
is what the lossless check wants (every round rejects and rolls back), and the
counters still have to add up.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from conftest import require_engine, smollm2_tokenizer
from draft_factory import random_draft, tiny_verifier
from draftsmith.cli import EXIT_ERROR, main
from draftsmith.engines.llamacpp import (LlamaCppEngine, check_gguf_pair, draft_gguf, export_gguf, find_build,
                                        parse_metrics, read_gguf, verifier_gguf)
from draftsmith.errors import DraftsmithError
from draftsmith.export import save_draft

pytestmark = pytest.mark.engines

K = 3
NEW_TOKENS = 32
PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the factorial of n.",
           "List three colours of the rainbow."]
DRAFT_VOCAB = 4096


def _build():
    return require_engine(find_build)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _SmolConfig:
    """What ``random_draft`` reads from a verifier: SmolLM2-135M's HF config (no weights needed)."""

    def __init__(self):
        from transformers import AutoConfig

        from draftsmith.models.verifier import resolve_spec

        self.config = AutoConfig.from_pretrained(resolve_spec("smollm2-135m"))


@pytest.fixture(scope="module")
def smol():
    _build()
    return _SmolConfig()


@pytest.fixture(scope="module")
def exported(smol, tmp_path_factory):
    """A random SmolLM2-shaped draft, saved in the speculators format and exported with the CLI."""
    tmp = tmp_path_factory.mktemp("llamacpp")
    draft = random_draft(smol, vd=DRAFT_VOCAB, seed=3)
    src = save_draft(draft, tmp / "draft", verifier_name="smollm2-135m", num_draft_tokens=K)
    out = tmp / "draft.gguf"
    assert main(["export", str(src), "--out", str(out), "--format", "gguf"]) == 0
    return {"tmp": tmp, "draft": draft, "src": src, "gguf": out}


@pytest.fixture(scope="module")
def runs(exported):
    """The prompts served plain and with the draft (one server each, stopped afterwards)."""
    tok = smollm2_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in PROMPTS]
    out = {"prompts": prompts}
    for name, draft in (("plain", None), ("spec", exported["gguf"])):
        with LlamaCppEngine("smollm2-135m", draft=draft, k=K, threads=1, ctx_size=512,
                            work_dir=exported["tmp"] / "logs") as eng:
            out[name] = [eng.generate(p, NEW_TOKENS, ignore_eos=True) for p in prompts]
            out[f"{name}_pid"], out[f"{name}_log"], out[f"{name}_argv"] = eng.pid, eng.server.log_path, eng.argv
    return out


# ---------------------------------------------------------------------------- export
def test_gguf_export_says_what_the_draft_is(exported):
    g = read_gguf(exported["gguf"])
    draft = exported["draft"]
    assert g.meta["general.architecture"] == "eagle3"
    assert g.meta["eagle3.target_layers"] == [2, 15, 27] == draft.config.aux_layer_ids
    assert g.meta["eagle3.target_hidden_size"] == 576 and g.meta["eagle3.norm_before_residual"] is True
    assert g.array("d2t").tolist() == draft.draft_to_target.tolist()  # llama.cpp stores absolute verifier ids
    # float32 weights pass through unchanged (q/k are permuted for llama.cpp's rope layout, the rest are not)
    assert torch.equal(torch.from_numpy(g.array("fc.weight")), draft.fc.weight.detach())
    assert torch.equal(torch.from_numpy(g.array("output.weight")), draft.lm_head.weight.detach())


def test_mismatched_drafts_are_refused_by_the_exporter(smol, tmp_path):
    """Wrong verifier (hidden size, vocabulary), wrong aux layers: refused, nothing written."""
    tiny = tiny_verifier()  # hidden 64, vocab 128: a draft for another model
    cases = {
        "wrong verifier": (random_draft(tiny, vd=48), "hidden size is 576"),
        "wrong aux layers": (random_draft(smol, vd=DRAFT_VOCAB, aux_layer_ids=[2, 15, 29]), None),
    }
    # a 29 is valid for SmolLM2's 30 layers; 30 is not: patch config.json after writing
    for name, (draft, needle) in cases.items():
        src = save_draft(draft, tmp_path / name.replace(" ", "_"), verifier_name=None)
        if name == "wrong aux layers":
            cfg = json.loads((src / "config.json").read_text())
            cfg["eagle_aux_hidden_state_layer_ids"] = [2, 15, 30]
            (src / "config.json").write_text(json.dumps(cfg))
            needle = "aux layer ids [2, 15, 30]"
        out = tmp_path / f"{name.replace(' ', '_')}.gguf"
        with pytest.raises(DraftsmithError, match="does not match the verifier") as e:
            export_gguf(src, out, verifier="smollm2-135m")
        assert needle in str(e.value)
        assert not out.exists()


@pytest.mark.parametrize("flags,names", [
    ({"fc_norm": True}, ["fc_norm"]),
    ({"norm_output": True, "norm_before_fc": True}, ["norm_output"]),
    ({"qk_norm": True, "attention_bias": True}, ["qwen3", "attention_bias"]),
])
def test_drafts_llamacpp_would_compute_differently_are_refused(smol, tmp_path, flags, names):
    src = save_draft(random_draft(smol, vd=DRAFT_VOCAB, **flags), tmp_path / "d", verifier_name="smollm2-135m")
    out = tmp_path / "d.gguf"
    with pytest.raises(DraftsmithError, match="cannot be served by llama.cpp as trained") as e:
        export_gguf(src, out)
    for n in names:
        assert n in str(e.value)
    assert "norm_before_fc" not in str(e.value)  # llama.cpp implements that one
    assert not out.exists()


def test_cli_refuses_speculators_only_flags_for_gguf(exported, capsys):
    rc = main(["export", str(exported["src"]), "--out", "x.gguf", "--format", "gguf", "--num-draft-tokens", "4"])
    assert rc == 2 and "--spec-draft-n-max" in capsys.readouterr().err


def test_gguf_pair_check_refuses_a_draft_for_another_verifier(exported, tmp_path):
    check_gguf_pair(exported["gguf"], verifier_gguf("smollm2-135m"))  # the right pair passes
    with pytest.raises(DraftsmithError, match="not an EAGLE-3 draft"):
        check_gguf_pair(verifier_gguf("smollm2-135m"), verifier_gguf("smollm2-135m"))


# ---------------------------------------------------------------------------- serving
def test_q8_0_export_quantizes_the_draft_and_serves_the_same_output(exported, runs):
    """--dtype q8_0: the head and layer matrices stored as llama.cpp's 8-bit blocks; served, the
    output is still plain decoding's (the draft only proposes)."""
    out = exported["tmp"] / "draft-q8_0.gguf"
    assert main(["export", str(exported["src"]), "--out", str(out), "--format", "gguf", "--dtype", "q8_0"]) == 0
    g = read_gguf(out)
    assert g.tensors["output.weight"][0] == 8 and g.tensors["fc.weight"][0] == 8  # GGML_TYPE_Q8_0
    assert out.stat().st_size < 0.4 * exported["gguf"].stat().st_size  # ~8.5 bits a weight against 32
    with pytest.raises(DraftsmithError, match="not a plain one"):  # its blocks are no float array
        g.array("output.weight")
    with LlamaCppEngine("smollm2-135m", draft=out, k=K, threads=1, ctx_size=512,
                        work_dir=exported["tmp"] / "logs") as eng:
        spec = [eng.generate(p, NEW_TOKENS, ignore_eos=True) for p in runs["prompts"]]
    for i, (plain, r) in enumerate(zip(runs["plain"], spec)):
        assert r.token_ids == plain.token_ids, f"prompt {i}: " + _first_divergence(plain.token_ids, r.token_ids)
        assert r.counters.drafts > 0


def test_q8_0_is_a_gguf_type_only(exported, tmp_path):
    assert main(["export", str(exported["src"]), "--out", str(tmp_path / "d"), "--dtype", "q8_0"]) == EXIT_ERROR


def _first_divergence(a: list[int], b: list[int]) -> str:
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"first divergence at new token {i}: plain {a[i] if i < len(a) else 'end'} vs "
            f"draft {b[i] if i < len(b) else 'end'} (lengths {len(a)}, {len(b)})")


def test_draft_loads_in_llama_server(runs):
    log = Path(runs["spec_log"]).read_text(errors="replace")
    assert "loading draft model" in log and "draft acceptance" in log
    assert "--spec-type" in runs["spec_argv"] and "draft-eagle3" in runs["spec_argv"]
    assert all(r.counters is None for r in runs["plain"])


def test_greedy_output_with_the_draft_equals_output_without(runs):
    for i, (plain, spec) in enumerate(zip(runs["plain"], runs["spec"])):
        assert len(plain.token_ids) == NEW_TOKENS
        assert spec.token_ids == plain.token_ids, f"prompt {i}: " + _first_divergence(plain.token_ids, spec.token_ids)


def test_acceptance_counters_are_reported_and_consistent(runs):
    for r in runs["spec"]:
        c = r.counters
        assert c.drafts > 0 and c.draft_tokens > 0
        assert 0 <= c.accepted_tokens <= c.draft_tokens <= K * c.drafts
        # every verification yields its accepted tokens plus one; the first token comes from the prefill
        assert c.drafts + c.accepted_tokens <= len(r.token_ids) - 1
        assert len(c.accepted_per_position) == K and sum(c.accepted_per_position) == c.accepted_tokens
        assert all(a >= b for a, b in zip(c.accepted_per_position, c.accepted_per_position[1:]))
        assert c.accepted_per_position[0] <= c.drafts
        assert 1.0 <= c.acceptance_length <= 1.0 + K


def test_counters_add_up_when_drafts_are_accepted(exported, runs):
    """A random draft is never accepted, so the per-position counts above are all zero. llama-server's own
    benchmarking mode accepts drafted tokens with given per-position rates (the output is then not the
    verifier's): the counters this engine reads must still agree with the server's timings and each other."""
    with LlamaCppEngine("smollm2-135m", draft=exported["gguf"], k=K, threads=1, ctx_size=512,
                        work_dir=exported["tmp"] / "logs", extra_args=["--spec-synth-rates", "0.9,0.7,0.5"]) as eng:
        r = eng.generate(runs["prompts"][1], NEW_TOKENS, ignore_eos=True)
    c = r.counters
    assert len(r.token_ids) == NEW_TOKENS
    assert 0 < c.accepted_tokens <= c.draft_tokens <= K * c.drafts
    assert c.drafts + c.accepted_tokens <= NEW_TOKENS - 1
    assert sum(c.accepted_per_position) == c.accepted_tokens and c.accepted_per_position[0] <= c.drafts
    assert all(a >= b for a, b in zip(c.accepted_per_position, c.accepted_per_position[1:]))
    assert c.accepted_per_position[-1] > 0 and c.acceptance_length > 1.0


def test_servers_are_gone_after_use(runs):
    assert not _alive(runs["plain_pid"]) and not _alive(runs["spec_pid"])


def test_an_hf_directory_verifier_is_converted_once_and_served(exported, runs):
    """The float32 path: an HF directory (here SmolLM2 dequantized) becomes an F32 GGUF, cached; a draft
    directory given to the engine is exported for it once (cached by content)."""
    from draftsmith.models.verifier import resolve_spec

    vdir = str(resolve_spec("smollm2-135m"))
    path = verifier_gguf(vdir)
    assert verifier_gguf(vdir) == path and read_gguf(path).meta["general.file_type"] == 0  # cached; all F32
    dgguf = draft_gguf(exported["src"], vdir)
    stamp = dgguf.stat().st_mtime_ns
    assert draft_gguf(exported["src"], vdir) == dgguf and dgguf.stat().st_mtime_ns == stamp
    prompt, out = runs["prompts"][0], {}
    for name, draft in (("plain", None), ("spec", exported["src"])):
        with LlamaCppEngine(vdir, draft=draft, k=K, threads=1, ctx_size=256, work_dir=exported["tmp"] / "logs") as eng:
            out[name] = eng.generate(prompt, 16, ignore_eos=True)
    assert out["spec"].token_ids == out["plain"].token_ids, _first_divergence(out["plain"].token_ids,
                                                                             out["spec"].token_ids)
    assert out["spec"].counters.draft_tokens > 0


def test_metrics_parser_reads_llama_server_names():
    text = ("# HELP llamacpp:spec_decode_num_drafts_total x\nllamacpp:spec_decode_num_drafts_total 7\n"
            "llamacpp:spec_decode_num_draft_tokens_total 21\nllamacpp:spec_decode_num_accepted_tokens_total 5\n"
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 4\n'
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1\n')
    c = parse_metrics(text)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (7, 21, 5, [4, 0, 1])


# ---------------------------------------------------------------------------- failures
def test_a_server_that_cannot_load_its_model_reports_its_log_and_leaves_no_process(tmp_path):
    _build()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    eng = LlamaCppEngine(str(bad), work_dir=tmp_path)
    with pytest.raises(DraftsmithError, match="llama-server exited with code") as e:
        with eng:
            pass
    assert "ends with:" in str(e.value) and "broken.gguf" in str(e.value)
    assert eng.pid is not None and not _alive(eng.pid)


def test_a_taken_port_reports_the_log_and_leaves_no_process(tmp_path):
    _build()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        eng = LlamaCppEngine("smollm2-135m", port=port, work_dir=tmp_path, startup_timeout=60)
        with pytest.raises(DraftsmithError, match="llama-server exited with code") as e:
            eng.start()
    assert "ends with:" in str(e.value) and f"port: {port}" in str(e.value)  # llama-server's "couldn't bind"
    assert eng.pid is not None and not _alive(eng.pid)


def test_ctrl_c_while_serving_stops_the_server(tmp_path):
    _build()
    eng = LlamaCppEngine("smollm2-135m", work_dir=tmp_path, ctx_size=256, threads=1)
    with pytest.raises(KeyboardInterrupt):
        with eng:
            assert _alive(eng.pid)
            raise KeyboardInterrupt
    assert not _alive(eng.pid)


def test_a_missing_build_says_how_to_make_it(tmp_path):
    with pytest.raises(DraftsmithError, match="make setup-llamacpp"):
        find_build(tmp_path)
