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
    (["bench", "--verifier", "smollm2-135m", "--drafter", "ngram", "--draft-precision", "int8", "--out",
      "runs/never-written"], "applies to EAGLE-3 drafts"),
    (["generate", "--verifier", "smollm2-135m", "--prompt", "hi", "--drafter", "/no/such/draft"], "no such directory"),
    (["generate", "--verifier", "smollm2-135m", "--prompt", "hi", "--drafter", "model:no-such-model"],
     "the draft model: "),
    (["generate", "--verifier", "smollm2-135m", "--prompt", "hi", "--draft-confidence", "0.5"], "no --drafter is given"),
    (["data", "--num-conversations", "0"], "--num-conversations must be >= 1, got 0"),  # the flag, not data.*
    (["data", "--dataset", "mt-bench"], "--dataset: 'mt-bench' is a held-out evaluation set"),
])
def test_bad_input_is_one_line(args, needle, capsys):
    rc, err = _run(args, capsys)
    assert rc == EXIT_ERROR
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


#: each command's least arguments (DIR: a directory, to be filled in), with where its --out goes
LEAST_ARGS = {
    "generate": (["generate", "--verifier", "smollm2-135m", "--prompt", "hi"], None),
    "data": (["data", "--dataset", "sharegpt"], "dir"),
    "train": (["train", "--verifier", "smollm2-135m", "--data", "DIR"], "dir"),
    "bench": (["bench", "--verifier", "smollm2-135m", "--drafter", "ngram"], "dir"),
    "eval": (["eval", "--verifier", "smollm2-135m", "--draft", "DIR"], "file"),
    "export": (["export", "DIR"], "dir"),
    "kfp compile": (["kfp", "compile"], "file"),
    "kfp trainjob": (["kfp", "trainjob", "--verifier", "smollm2-135m", "--data", "DIR"], "file"),
}


@pytest.mark.parametrize("name", list(LEAST_ARGS))
def test_a_bad_device_or_an_out_of_the_wrong_kind_is_refused_before_any_work(name, tmp_path, monkeypatch, capsys):
    """A typo'd --device and an --out where a file is and a directory goes (or the reverse) are one-line
    errors before the command starts (it used to run first and fail writing its results)."""
    from draftsmith import cli

    args, out_kind = LEAST_ARGS[name]
    args = [str(tmp_path) if a == "DIR" else a for a in args]

    def never(cfg):
        raise AssertionError(f"{name} ran")

    monkeypatch.setattr(cli.COMMANDS[name], "run", never)
    a_file, a_dir = tmp_path / "a-file.yaml", tmp_path / "a-dir"
    a_file.write_text("x")
    a_dir.mkdir()
    fields = {f.name for f in __import__("dataclasses").fields(cli.COMMANDS[name].config)}
    good_out = ["--out", str(tmp_path / "new" / ("out" if out_kind == "dir" else "out.yaml"))] if out_kind else []
    if "device" in fields:
        rc, err = _run(args + good_out + ["--device", "gpu0"], capsys)
        assert rc == EXIT_ERROR and "--device: unknown device 'gpu0'" in err and len(err.strip().splitlines()) == 1
    if out_kind is not None:
        wrong = a_file if out_kind == "dir" else a_dir
        rc, err = _run(args + ["--out", str(wrong)], capsys)
        assert rc == EXIT_ERROR and f"--out {wrong}" in err and len(err.strip().splitlines()) == 1, err
        rc, err = _run(args + ["--out", str(a_file / "under")], capsys)
        assert rc == EXIT_ERROR and "is a file" in err, err
    with pytest.raises(AssertionError, match="ran"):  # control: right input reaches the command
        main(args + good_out)


def test_export_does_not_replace_a_directory_that_holds_other_files(tmp_path, capsys):
    """export replaces its --out whole: a directory with files that are no draft's is refused (it was
    emptied); a new directory, the draft itself and an earlier export are written."""
    from draft_factory import random_draft

    from conftest import tiny_model
    from draftsmith.export import save_draft

    draft = tmp_path / "draft"
    save_draft(random_draft(tiny_model("llama", layers=8)), draft, num_draft_tokens=2)
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "notes.txt").write_text("mine")
    rc, err = _run(["export", str(draft), "--out", str(precious)], capsys)
    assert rc == EXIT_ERROR and "notes.txt, sub" in err and (precious / "notes.txt").read_text() == "mine"
    for out in (tmp_path / "new", tmp_path / "new", draft):  # a new one, then again over it, then in place
        rc, err = _run(["export", str(draft), "--out", str(out)], capsys)
        assert rc == 0 and (out / "model.safetensors").is_file(), err
    rc, err = _run(["generate", "--verifier", str(draft), "--prompt", "hi"], capsys)  # a draft is no verifier
    assert rc == EXIT_ERROR and "is an EAGLE-3 draft" in err and "--drafter" in err


def test_messages_name_the_range_and_the_value_and_point_at_the_right_directory(tmp_path, capsys):
    rc, err = _run(["train", "--verifier", "smollm2-135m", "--data", str(tmp_path), "--epochs", "0",
                    "--val-fraction", "1.5"], capsys)
    assert rc == EXIT_ERROR and "--epochs must be > 0, got 0.0" in err and "--val-fraction must be in [0, 1), got 1.5" in err
    from draftsmith.data.shards import read_manifest
    from draftsmith.errors import DraftsmithError

    (tmp_path / "capture" / "shards").mkdir(parents=True)
    (tmp_path / "capture" / "shards" / "manifest.json").write_text("{}")
    with pytest.raises(DraftsmithError, match="did you mean .*capture/shards"):
        read_manifest(tmp_path / "capture")
    with pytest.raises(DraftsmithError, match="does not exist"):
        read_manifest(tmp_path / "nothing")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    rc, err = _run(["pipeline", "run", str(empty), "--out", str(tmp_path / "o")], capsys)
    assert rc == EXIT_ERROR and "is empty" in err


def test_verbose_flag_after_the_command(capsys):
    from draftsmith.cli import build_parser

    assert build_parser().parse_args(["generate", "-v", "--verifier", "x", "--prompt", "p"]).verbose is True
    assert build_parser().parse_args(["-v", "generate", "--verifier", "x", "--prompt", "p"]).verbose is True
    assert build_parser().parse_args(["generate", "--verifier", "x", "--prompt", "p"]).verbose is False


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


@pytest.mark.slow
def test_generate_streams_the_text_it_prints_with_json(capsys):
    """Text mode streams round by round (--stream, the default): the streamed text is --json's text,
    and the stats line follows it; --no-stream prints the same text at the end."""
    base = ["generate", "--verifier", "smollm2-135m", "--prompt", "The capital of France is", "--max-new-tokens",
            "16", "--drafter", "ngram", "--weight-layout", "out-in"]
    assert main(base + ["--json"]) == 0
    text = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
    for extra in ([], ["--no-stream"]):
        assert main(base + extra) == 0
        shown, stats = capsys.readouterr().out.rsplit("\n[", 1)
        assert shown.strip() == text.strip() and stats.startswith("16 tokens in"), (extra, shown, text)
