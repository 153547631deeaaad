"""CLI: clear one-line errors and exit codes for bad input; help texts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from draftsmith.cli import EXIT_ERROR, main


def _run(args, capsys):
    rc = main(args)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("args, needle", [
    (["generate", "--verifier", "no-such-model", "--prompt", "hi"], "not found"),
    (["generate", "--verifier", "/nonexistent/model.gguf", "--prompt", "hi"], "GGUF file not found"),
    (["generate", "--verifier", "smollm2-135m", "--prompt", "hi", "--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["generate", "--verifier", "smollm2-135m", "--prompt", "hi", "--drafter", "what"], "unknown --drafter"),
    (["pipeline", "run", "/nonexistent.yaml"], "not found"),
])
def test_bad_input_is_one_line(args, needle, capsys):
    rc, err = _run(args, capsys)
    assert rc == EXIT_ERROR
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_corrupt_gguf(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    rc, err = _run(["generate", "--verifier", str(bad), "--prompt", "hi"], capsys)
    assert rc == EXIT_ERROR and "cannot read GGUF file" in err and "Traceback" not in err


def test_pipeline_config_errors_name_the_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("verifier: smollm2-135m\ntrain:\n  epochz: 3\n")
    rc, err = _run(["pipeline", "run", str(cfg), "--out", str(tmp_path / "o")], capsys)
    assert rc == EXIT_ERROR and "train.epochz" in err
    cfg.write_text("train:\n  epochs: lots\n")
    rc, err = _run(["pipeline", "run", str(cfg), "--out", str(tmp_path / "o")], capsys)
    assert rc == EXIT_ERROR and "train.epochs" in err
    blocker = tmp_path / "a-file"  # a path under a file cannot be created, whoever runs the test
    blocker.write_text("x")
    rc, err = _run(["pipeline", "run", "--out", str(blocker / "out")], capsys)
    assert rc == EXIT_ERROR and "not writable" in err and str(blocker) in err
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            rc, err = _run(["pipeline", "run", "--out", str(ro / "out")], capsys)
            assert rc == EXIT_ERROR and "not writable" in err
        finally:
            ro.chmod(0o700)


@pytest.mark.slow
def test_prompt_longer_than_context(tmp_path):
    long_prompt = "word " * 9000
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "generate", "--verifier", "smollm2-135m",
                           "--prompt", long_prompt], capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_ERROR
    assert "context" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_draft_with_other_tokenizer_drafts_through_text(tmp_path, capsys):
    """Same vocabulary size, different token ids: once refused, now drafted through text (issue 22),
    with the verifier's own greedy output."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.models.verifier import resolve_spec

    src = resolve_spec("smollm2-135m")
    d = tmp_path / "other-draft"
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(d)
    tj = json.loads((src / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids
    (d / "tokenizer.json").write_text(json.dumps(tj))
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            (d / f).write_text((src / f).read_text())
    base = ["generate", "--verifier", "smollm2-135m", "--prompt", "hello world", "--max-new-tokens", "12", "--json"]
    outs = []
    for extra in ([], ["--drafter", f"model:{d}"]):
        assert main(base + extra) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[1]["token_ids"] == outs[0]["token_ids"] and outs[1]["stats"]["drafts"] > 0


@pytest.mark.slow
def test_generate_weight_layouts_keep_greedy_output_the_verifiers(capsys):
    """generate --weight-layout: inside each layout a drafter's greedy tokens are plain decoding's in
    the same layout; auto names the layout its probe picked."""
    base = ["generate", "--verifier", "smollm2-135m", "--prompt", "hello world", "--max-new-tokens", "12", "--json"]
    outs = {}
    for layout in ("onednn", "cpp", "auto"):
        for extra in ([], ["--drafter", "ngram"]):
            assert main(base + ["--weight-layout", layout] + extra) == 0
            outs[layout, bool(extra)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert outs[layout, True]["token_ids"] == outs[layout, False]["token_ids"], layout
    assert outs["onednn", False]["stats"]["weight_layout"] == "onednn"
    assert outs["cpp", False]["stats"]["weight_layout"] == "cpp"
    assert outs["auto", False]["stats"]["weight_layout"] in ("out-in", "onednn", "cpp")
    with pytest.raises(SystemExit):  # not a layout: argparse refuses it
        main(base + ["--weight-layout", "columns"])


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "data", "train", "pipeline", "refresh", "eval", "bench", "export"):
        assert cmd in out


@pytest.mark.parametrize("cmd", [["generate"], ["data"], ["train"], ["pipeline", "run"], ["refresh"], ["eval"],
                                 ["bench"], ["export"], ["kfp"]])
def test_every_command_help_renders(cmd, capsys):
    """`--help` of every command prints its options (a literal % in a help text once crashed `data --help`)."""
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--" in out


def test_help_text_with_a_percent_sign_renders():
    """argparse %-formats help texts: a literal % must reach it escaped (it once crashed `data --help`)."""
    import argparse
    from dataclasses import dataclass

    from draftsmith.config import add_arguments, opt

    @dataclass
    class Odd:
        share: float = opt(0.5, "70% of replies loop")

    parser = argparse.ArgumentParser(prog="odd")
    add_arguments(parser, Odd)
    assert "70% of replies loop" in parser.format_help()
