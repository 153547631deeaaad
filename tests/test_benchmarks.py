"""The benchmark scripts still run against the library as it is now.

They are not imported by the library, so a renamed function or a changed return value breaks them
silently until someone measures (lean_engine.py's draft section unpacked two values from
``Eagle3Proposer._choose`` after it came to return three, and crashed after ten minutes of a run).
Every script's ``--help`` runs (its module-level imports and argument parser), and lean_engine.py
runs its plain, context and draft sections end to end on a tiny random verifier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


#: Runs each script named in argv (under ./benchmarks) as ``__main__`` with ``--help``; prints one line
#: per script that raised, returned, or exited otherwise than 0 with its usage; exits 1 if any did.
HELP_PROGRAM = r"""
import contextlib, io, runpy, sys
bad = []
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path("benchmarks/" + name, run_name="__main__")
        bad.append(f"{name}: --help returned without exiting")
    except SystemExit as e:
        if e.code not in (0, None) or "usage" not in buf.getvalue().lower():
            bad.append(f"{name}: exit {e.code!r}, printed {buf.getvalue()[:200]!r}")
    except BaseException as e:
        bad.append(f"{name}: {type(e).__name__}: {e}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
"""


def _help(cwd: Path, names: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HELP_PROGRAM, *names], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=600)


def test_every_benchmark_script_parses_its_arguments():
    """One process runs every script's ``--help`` (its module-level imports and its parser)."""
    assert len(SCRIPTS) >= 20  # the glob found them
    r = _help(ROOT, SCRIPTS)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def test_a_broken_script_is_reported(tmp_path):
    """The negative control of the check above: a script whose import fails, and one with no parser,
    are named; a sound one is not."""
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "broken.py").write_text("import argparse\nfrom draftsmith.decoding.runner import no_such_name\n"
                                     "argparse.ArgumentParser().parse_args()\n")
    (bench / "silent.py").write_text("x = 1\n")
    (bench / "fine.py").write_text("import argparse\nif __name__ == '__main__':\n"
                                   "    argparse.ArgumentParser().parse_args()\n")
    r = _help(tmp_path, ["broken.py", "silent.py", "fine.py"])
    assert r.returncode == 1
    assert "broken.py: ImportError" in r.stdout and "silent.py: --help returned" in r.stdout
    assert "fine.py" not in r.stdout


@pytest.mark.slow
def test_lean_engine_runs_its_sections_on_a_tiny_verifier(tmp_path):
    """lean_engine.py's plain, context and draft sections, eager, on a random 4-layer Llama: it writes
    its JSON with our loop's tokens identical to ``generate`` and a draft/verifier ratio per draft."""
    out = tmp_path / "lean.json"
    r = subprocess.run([sys.executable, "benchmarks/lean_engine.py", "--verifier", "random-tiny", "--sections",
                        "plain", "context", "draft", "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1",
                        "--contexts", "16", "32", "--step-repeats", "3", "--threads", "1", "--out", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["plain"]["identical_to_hf_generate"] == {"hf-generate": 2, "ours-lean": 2, "ours-hf-dynamic": 2}
    assert res["complete"] is True and res["sections_done"] == ["plain", "context", "draft"]
    assert set(res["context"]["median_ms"]) >= {"lean"}
    png = tmp_path / "lean.context.png"  # the curve, drawn by the run and again from its JSON
    assert png.read_bytes()[:4] == b"\x89PNG"
    png.unlink()
    r = subprocess.run([sys.executable, "benchmarks/lean_engine.py", "--plot", str(out)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", r.stderr[-2000:]
    ratios = res["draft"]["draft_over_verifier"]
    assert {"draft-8192", "draft-8192-int8"} <= set(ratios) and all(v > 0 for v in ratios.values())
    # the int8 draft is int8 in its 8 step layers (q, k, v, o, gate, up, down, head); fc stays float
    assert res["draft"]["layer_kinds"]["draft-8192-int8"] == {"Linear": 1, "Int8WeightLinear": 8}


def test_lean_engine_keeps_the_sections_it_finished_when_a_later_one_fails(tmp_path, monkeypatch):
    """The GPU check runs lean_engine.py under a time limit: its JSON is written after each section, so
    a run cut short keeps what it measured, marked incomplete; rss is a default section on the CPU only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lean_engine_script", ROOT / "benchmarks" / "lean_engine.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def cut(*_a, **_k):
        raise KeyboardInterrupt("the time limit")

    monkeypatch.setattr(script, "section_context", cut)
    out = tmp_path / "lean.json"
    with pytest.raises(KeyboardInterrupt):
        script.main(["--verifier", "random-tiny", "--sections", "plain", "context", "draft", "--num-prompts", "1",
                     "--max-new-tokens", "4", "--repeats", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["sections_done"] == ["plain"]
    assert res["plain"]["identical_to_hf_generate"]["ours-lean"] == 1 and "draft" not in res
    seen = []
    monkeypatch.setattr(script, "load", lambda args: seen.append(list(args.sections)) or (_ for _ in ()).throw(
        KeyboardInterrupt()))
    for device in ("cpu", "cuda"):
        with pytest.raises(KeyboardInterrupt):
            script.main(["--verifier", "random-tiny", "--device", device, "--out", str(out)])
    assert seen == [["plain", "context", "draft", "rss"], ["plain", "context", "draft"]]


def test_lean_engine_draft_section_in_the_cpp_layout_times_both_int8_kernels(tmp_path):
    """In the cpp layout the context curve has the eager step's attention on the C++ kernel and on SDPA
    side by side; the int8 draft's step layers are the kernel's int8 form, and the same int8
    draft on ATen's kernel is timed beside it; the float draft's Linears are the kernel's too. (A draft
    quantized after its layout was entered once kept its decoder layer in float32: the layer counts
    would show it.)"""
    out = tmp_path / "lean.json"
    r = subprocess.run([sys.executable, "benchmarks/lean_engine.py", "--verifier", "random-tiny", "--sections", "draft",
                        "context", "--contexts", "16", "32", "--weight-layout", "cpp", "--step-repeats", "3",
                        "--threads", "1", "--out", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["context"]["median_ms"]) == {"lean", "lean-sdpa", "hf-dynamic"}  # cpp's attention, and SDPA's
    kinds = res["draft"]["layer_kinds"]
    assert kinds["draft-8192"] == {"CppLinear": 9}
    assert kinds["draft-8192-int8"] == {"CppLinear": 1, "CppInt8WeightLinear": 8}
    assert kinds["draft-8192-int8-aten"] == {"Linear": 1, "Int8WeightLinear": 8}
