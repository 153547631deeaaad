"""The pipeline: end to end on a tiny verifier, caching, kill/resume, gate, refresh, bad config."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import save_tiny_chat_verifier
from draftsmith.cli import EXIT_ERROR, EXIT_GATE_FAILED, main

HERE = Path(__file__).parent
WORDS = ("sky blue grass green sun hot ice cold cat dog bird fish tree leaf rain snow red one two three "
         "apple pear plum river hill stone").split()


def _prompts(n: int) -> list[dict]:
    return [{"id": f"p{i}", "prompt": f"Tell me about {WORDS[i % len(WORDS)]} and {WORDS[(3 * i + 1) % len(WORDS)]}."}
            for i in range(n)]


def _config(root: Path, verifier: Path, out: str, **over) -> Path:
    data = root / "prompts.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(p) + "\n" for p in _prompts(24)))
    cfg = {"verifier": str(verifier), "preset": "tiny", "out": str(root / out), "device": "cpu",
           "data": {"dataset": str(data), "num_conversations": 16, "max_new_tokens": 24, "batch_size": 4,
                    "max_length": 128, "dtype": "float32", "samples_per_shard": 4},
           "train": {"epochs": 4, "draft_vocab_size": 128, "pack_tokens": 128, "eval_every": 4,
                     "checkpoint_every": 2, "lr": 3e-3},
           # the tiny drafts here are near random: --draft-confidence auto would draft almost no round, and
           # the drift test compares acceptance lengths, which need drafted rounds (auto: tests/test_bench.py)
           "bench": {"num_prompts": 2, "max_new_tokens": 16, "num_draft_tokens": [3], "hf_reference": False,
                     "draft_confidence": ["off"]}}
    for key, value in over.items():
        section, _, name = key.partition("__")
        if name:
            cfg[section][name] = value
        else:
            cfg[section] = value
    path = root / f"{out}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    return root, save_tiny_chat_verifier(root / "verifier")


def _worker(config: Path, where: str | None = None, sig: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "src")])}
    args = [sys.executable, str(HERE / "pipeline_worker.py"), str(config)] + ([where, sig] if where else [])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)


def _step_dir(out: Path, name: str) -> Path:
    (d,) = (out / "steps").glob(f"{name}-*")
    return d


@pytest.fixture(scope="module")
def reference(setup):
    """An uninterrupted run (subprocess, like the interrupted ones). A draft of a random tiny
    verifier trained for seconds is not faster: the gate's honest no (exit code 3)."""
    root, verifier = setup
    cfg = _config(root, verifier, "ref")
    proc = _worker(cfg)
    assert proc.returncode == EXIT_GATE_FAILED, proc.stderr[-2000:]
    return root / "ref"


def test_end_to_end_report_and_cache(setup, reference, capsys):
    report = json.loads((reference / "report.json").read_text())
    gate = report["gate"]
    assert set(gate) >= {"passed", "speedup", "speedup_ci95", "acceptance_length", "reasons"}
    assert gate["passed"] is False and any("too few prompts to judge" in r for r in gate["reasons"]), gate
    assert not (reference / "draft").exists() and report["deployed_draft"] is None
    assert (Path(report["candidate_draft"]) / "config.json").is_file()
    assert report["bench"]["candidate"]["identical_output_rate"] == 1.0
    assert report["bench"]["candidate"]["outputs"] == {"identical": 2, "tie": 0, "mismatch": 0}
    # report.md: the verdict first, every step, and links that resolve (the training curves, the bench's report)
    md = (reference / "report.md").read_text()
    assert md.splitlines()[2].startswith("**FAIL**") and all(f"- {r}" in md for r in gate["reasons"])
    assert all(f"| {name} |" in md for name in report["steps"])
    links = re.findall(r"\]\(([^)]+)\)", md)
    assert any(x.endswith("training.png") for x in links) and any(x.endswith("report.md") for x in links)
    assert any(x.endswith("tokens_per_second.png") for x in links)
    assert all((reference / x).is_file() for x in links), links
    # a second run with nothing changed does no work: every step comes from the cache
    root, verifier = setup
    rc = main(["pipeline", "run", str(root / "ref.yaml")])
    assert rc == EXIT_GATE_FAILED
    again = json.loads((reference / "report.json").read_text())
    assert all(t["cached"] for t in again["steps"].values()), again["steps"]


@pytest.mark.parametrize("kills", [[("capture", "INT"), ("train", "KILL")], [("capture", "KILL"), ("train", "INT")],
                                   [("capture", "TERM"), ("train", "TERM")]])
def test_killed_run_resumes_to_the_same_result(setup, reference, kills):
    """Killed in capture, then killed in training, then run to the end: same shards, same draft."""
    root, verifier = setup
    out = "kill-" + "-".join(f"{w}{s}" for w, s in kills)
    cfg = _config(root, verifier, out)
    for where, sig in kills:
        proc = _worker(cfg, where, sig)
        assert proc.returncode != 0, (where, sig)  # it really died
        if sig == "TERM":  # ... through the interrupt path (checkpoint first), not by the default action
            assert proc.returncode == 143 and "interrupted (SIGTERM)" in proc.stderr, (proc.returncode, where)
        assert not (root / out / "report.json").exists()
    final = _worker(cfg)
    assert final.returncode == EXIT_GATE_FAILED, final.stderr[-2000:]
    assert "[capture] up to date" in final.stderr and "[train] running (resuming)" in final.stderr
    ref_shards = sorted((_step_dir(reference, "capture") / "shards").glob("shard-*.safetensors"))
    got_shards = sorted((_step_dir(root / out, "capture") / "shards").glob("shard-*.safetensors"))
    assert [p.name for p in ref_shards] == [p.name for p in got_shards] and len(ref_shards) >= 3
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(ref_shards, got_shards))
    ref_w = (_step_dir(reference, "train") / "train" / "draft" / "model.safetensors").read_bytes()
    got_w = (_step_dir(root / out, "train") / "train" / "draft" / "model.safetensors").read_bytes()
    assert ref_w == got_w


def test_a_run_killed_in_its_bench_resumes_the_bench_where_it_stopped(setup, reference):
    """kill -9 after the bench's first prompt: the next run takes every step before the bench from the
    cache and resumes the bench from that prompt, to the reference run's verdict and outputs."""
    root, verifier = setup
    cfg = _config(root, verifier, "kill-bench")
    proc = _worker(cfg, "bench", "KILL")
    assert proc.returncode == -9, proc.stderr[-2000:]
    final = _worker(cfg)
    assert final.returncode == EXIT_GATE_FAILED, final.stderr[-2000:]
    assert "[train] up to date" in final.stderr and "[bench] running (resuming)" in final.stderr
    assert "resuming the interrupted bench" in final.stderr
    report = json.loads((root / "kill-bench" / "report.json").read_text())
    bench = json.loads(Path(report["bench"]["report"]).read_text())
    assert [a["units_done"] for a in bench["resumed"]] == [1] and not bench["partial"]
    ref = json.loads((reference / "report.json").read_text())
    assert report["bench"]["candidate"]["outputs"] == ref["bench"]["candidate"]["outputs"]
    assert report["gate"]["passed"] == ref["gate"]["passed"]


def test_gate_failure_exit_code_and_no_deploy(setup, reference, capsys):
    """Same data/train/bench as the reference (all cached), a gate it cannot pass: a draft
    deployed earlier stays."""
    import shutil

    root, verifier = setup
    shutil.copytree(_step_dir(reference, "train") / "train" / "draft", reference / "draft")
    deployed = (reference / "draft" / "model.safetensors").read_bytes()
    cfg = _config(root, verifier, "strict", gate={"min_speedup": 50.0})
    rc = main(["pipeline", "run", str(cfg), "--out", str(reference)])
    assert rc == EXIT_GATE_FAILED
    report = json.loads((reference / "report.json").read_text())
    assert report["gate"]["passed"] is False and "below the gate" in report["gate"]["reasons"][0]
    assert report["deployed_draft"] is None
    assert (reference / "draft" / "model.safetensors").read_bytes() == deployed  # the deployed draft stays
    assert report["steps"]["train"]["cached"] and report["steps"]["bench"]["cached"]
    assert "gate failed" in capsys.readouterr().err


def test_bench_step_without_pilot_prompts_times_every_k(setup, reference, tmp_path, capsys):
    """bench.choose_k on a dataset the judged prompts use up: the pipeline's bench (after training)
    says so and times every k rather than failing; `draftsmith bench` itself refuses (test_bench)."""
    from draftsmith.bench import BenchSettings
    from draftsmith.pipeline import steps

    root, verifier = setup
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps(p) + "\n" for p in _prompts(2)))
    section = BenchSettings(dataset=str(two), num_prompts=2, max_new_tokens=8, num_draft_tokens=[1, 2],
                            choose_k=True, hf_reference=False, warmup_tokens=2, bootstrap=100)
    draft = Path(json.loads((reference / "report.json").read_text())["candidate_draft"])
    b = steps.bench(steps.Verifier(str(verifier), "float32", "cpu"), {"candidate": draft}, section,
                    tmp_path / "bench", progress=False)
    report = json.loads(Path(b["report"]).read_text())
    assert sorted(r["k"] for r in report["rows"] if r["kind"] == "drafter") == [1, 2] and report["k_choice"] == {}
    assert "no prompt left after the first 2 for choose_k's pilot decode" in capsys.readouterr().err


def test_bad_config_fails_before_any_work(setup, capsys, tmp_path):
    root, verifier = setup
    cases = [({"train": {"epochz": 2}}, "train.epochz"), ({"train": {"epochs": "many"}}, "epochs"),
             ({"verifier": str(tmp_path / "missing")}, "not found"), ({"gate": [1, 2]}, "gate")]
    for over, needle in cases:
        cfg = {"verifier": str(verifier), "out": str(tmp_path / "o"), **over}
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(cfg))
        rc = main(["pipeline", "run", str(path)])
        err = capsys.readouterr().err
        assert rc == EXIT_ERROR and needle in err, (over, err)
        assert not (tmp_path / "o" / "steps").exists()  # nothing ran


def test_bfloat16_end_to_end(setup):
    """The GPU path as far as a CPU runs it: every step in bfloat16, verdicts tie-aware."""
    root, verifier = setup
    cfg = _config(root, verifier, "bf16", dtype="bfloat16", data__dtype="bfloat16")
    assert main(["pipeline", "run", str(cfg)]) == EXIT_GATE_FAILED  # a seconds-old draft is not faster
    report = json.loads((root / "bf16" / "report.json").read_text())
    bench = json.loads(Path(report["bench"]["report"]).read_text())
    assert bench["provenance"]["dtype"] == "bfloat16" and report["config"]["data"]["dtype"] == "bfloat16"
    assert report["train"]["steps"] >= 1 and report["gate"]["outputs"]["mismatch"] == 0
    shards = json.loads((Path(_step_dir(root / "bf16", "capture")) / "shards" / "manifest.json").read_text())
    assert shards["total_tokens"] > 0


def _fine_tune(src: Path, dst: Path, noise: float = 0.25) -> Path:
    """A simulated fine-tune: the verifier's weights moved by noise (the tokenizer stays)."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    model.save_pretrained(dst)
    return dst


def test_refresh_detects_drift_and_recovers(setup, reference, capsys):
    root, verifier = setup
    old = Path(json.loads((reference / "report.json").read_text())["candidate_draft"])
    before_train = json.loads((reference / "report.json").read_text())["bench"]["candidate"]
    new_verifier = _fine_tune(verifier, root / "verifier-ft")
    cfg = _config(root, new_verifier, "refresh-cfg")
    rc = main(["refresh", "--verifier", str(new_verifier), "--draft", str(old), "--out", str(root / "refreshed"),
               "--config", str(cfg), "--epochs", "4"])
    report = json.loads((root / "refreshed" / "report.json").read_text())
    stale, fresh = report["before"], report["after"]
    # drift: the old draft accepts less on the fine-tuned verifier than on its own
    assert stale["acceptance_length"] < before_train["acceptance_length"]
    # recovery: the refreshed draft accepts more than the stale one on the new verifier
    assert fresh["acceptance_length"] > stale["acceptance_length"]
    assert report["mode"] == "refresh" and rc in (0, EXIT_GATE_FAILED)
    assert "refresh: acceptance length" in capsys.readouterr().out


def test_data_and_train_commands(setup, tmp_path):
    """The single-step commands chain: data -> train (the shards carry aux ids and fingerprint)."""
    root, verifier = setup
    data = root / "prompts.jsonl"
    rc = main(["data", "--verifier", str(verifier), "--dataset", str(data), "--num-conversations", "6",
               "--max-new-tokens", "12", "--batch-size", "6", "--max-length", "96", "--dtype", "float32",
               "--out", str(tmp_path / "d")])
    assert rc == 0 and (tmp_path / "d" / "shards" / "manifest.json").is_file()
    rc = main(["train", "--verifier", str(verifier), "--data", str(tmp_path / "d" / "shards"), "--out",
               str(tmp_path / "t"), "--draft-vocab-size", "64", "--pack-tokens", "96", "--epochs", "1",
               "--val-fraction", "0.2", "--device", "cpu", "--precision", "fp32"])
    assert rc == 0 and (tmp_path / "t" / "draft" / "config.json").is_file()
    assert json.loads((tmp_path / "t" / "train_config.json").read_text())["verifier_fingerprint"]


def test_skip_conversations_gives_the_next_prompts_of_the_train_split(tmp_path, capsys):
    """`--skip-conversations N` answers the conversations after the first N: fresh data for a run
    that already used them, none in common, under another cache key."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.pipeline import steps
    from draftsmith.pipeline.config import DataSection

    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"question {i}: why is {i * 7} odd or even?"}) + "\n"
                           for i in range(60)))

    def ids(**kw) -> list[str]:
        work = tmp_path / f"w{len(list(tmp_path.iterdir()))}"
        work.mkdir()
        res = steps.prompts(DataSection(dataset=str(src), **kw), work)
        return [json.loads(line)["id"] for line in open(res["path"])]

    first, after = ids(num_conversations=10), ids(num_conversations=10, skip_conversations=10)
    assert len(after) == 10 and not set(first) & set(after)
    assert "were asked for" not in capsys.readouterr().err
    fewer = ids(num_conversations=50, skip_conversations=20)  # fewer than asked: said, not silent
    assert 0 < len(fewer) < 50 and f"gives {len(fewer)} conversations after 20 skipped" in capsys.readouterr().err
    assert first + after == ids(num_conversations=20)
    assert steps.regeneration_key(DataSection()) != steps.regeneration_key(DataSection(skip_conversations=10))
    with pytest.raises(DraftsmithError, match="leaves no prompt: the train split .* has [0-9]+ conversations"):
        ids(skip_conversations=1000)
    with pytest.raises(DraftsmithError, match="skip_conversations must be >= 0"):
        DataSection(skip_conversations=-1)


def test_previous_draft_is_the_deployed_one_of_the_same_verifier(tmp_path):
    """OUT/draft is the draft to beat when it was made for this verifier (by fingerprint)."""
    from conftest import tiny_model
    from draft_factory import random_draft
    from draftsmith.export import save_draft
    from draftsmith.pipeline.config import build_config
    from draftsmith.pipeline.runner import _previous_draft

    save_draft(random_draft(tiny_model("llama", layers=8)), tmp_path / "out" / "draft", fingerprint="abc")
    cfg = build_config(None, {"preset": "tiny", "out": str(tmp_path / "out")})
    assert _previous_draft(cfg, "abc") == tmp_path / "out" / "draft"
    assert _previous_draft(cfg, "other") is None


def test_top_up_regenerates_the_next_prompts_and_captures_them_all(setup, tmp_path):
    """A budget's top-up: the next prompts of the dataset are regenerated after the planned ones,
    merged, and captured together; a rerun hits the cache in every step."""
    import dataclasses

    from draftsmith.data.regenerate import load_regenerated
    from draftsmith.pipeline import steps
    from draftsmith.pipeline.cache import StepCache
    from draftsmith.pipeline.config import DataSection

    root, verifier = setup
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in _prompts(24)))
    data = DataSection(dataset=str(src), num_conversations=6, max_new_tokens=12, batch_size=3, max_length=96,
                       dtype="float32", samples_per_shard=4)
    vd = steps.Verifier(str(verifier), "float32", "cpu")
    seen = []

    def run(asked: int):
        cache = StepCache(tmp_path / "steps")
        out = steps.run_data_steps(cache, data, vd, vd.fingerprint, lambda r: seen.append(r["count"]) or asked)
        return out, cache.timings

    (p, r, c), timings = run(4)
    assert seen == [6] and p["count"] == r["count"] == 10
    (tmp_path / "all").mkdir()
    want = [json.loads(line)["id"] for line in open(steps.prompts(
        dataclasses.replace(data, num_conversations=10), tmp_path / "all")["path"])]
    assert sorted(conv.id for conv in load_regenerated(Path(r["path"]))) == sorted(want)
    assert {"topup_prompts", "topup_regenerate", "topup_merge", "capture"} <= set(timings)
    shards = json.loads((Path(c["dir"]) / "manifest.json").read_text())
    assert shards["total_tokens"] == c["tokens"] > 0
    (p2, r2, c2), timings = run(4)
    assert (p2, r2, c2) == (p, r, c) and all(t["cached"] for t in timings.values())
    (_, r0, c0), _ = run(0)  # no top-up: the planned prompts alone, a different capture
    assert r0["count"] == 6 and c0["sha"] != c["sha"]


def test_data_steps_give_each_regeneration_its_deadline(setup, tmp_path):
    """A budgeted run's deadline reaches the planned regeneration and the top-up's: past it no chunk
    of prompts starts (the first always runs); what was answered is captured, and the cut is recorded."""
    import time

    from draftsmith.data.regenerate import CHUNK_BATCHES
    from draftsmith.pipeline import steps
    from draftsmith.pipeline.cache import StepCache
    from draftsmith.pipeline.config import DataSection

    root, verifier = setup
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in _prompts(30)))
    chunk = 3 * CHUNK_BATCHES
    data = DataSection(dataset=str(src), num_conversations=chunk + 6, max_new_tokens=8, batch_size=3, max_length=96,
                       dtype="float32", samples_per_shard=4)
    vd = steps.Verifier(str(verifier), "float32", "cpu")

    def run(name: str, deadline):
        firsts, asked = [], []
        cache = StepCache(tmp_path / name)
        until = None if deadline is None else (lambda step: asked.append(step) or deadline())
        p, r, c = steps.run_data_steps(cache, data, vd, vd.fingerprint, lambda r: firsts.append(r) or 4, until)
        return firsts[0], r, c, asked

    first, r, c, asked = run("cut", time.perf_counter)  # every deadline already past
    assert asked == ["regenerate", "topup_regenerate"]
    assert first["count"] == chunk and first["cut"] == {"regenerate": {"kept": chunk, "left": 6}}
    assert r["count"] == chunk + 4 and r["cut"] == first["cut"]  # the top-up's first chunk ran (all of it)
    assert json.loads((Path(c["dir"]) / "manifest.json").read_text())["total_tokens"] == c["tokens"] > 0
    # control: no deadline, nothing cut
    first, r, _, asked = run("whole", None)
    assert asked == [] and "cut" not in first and "cut" not in r
    assert first["count"] == chunk + 6 and r["count"] == chunk + 10


class _Stop(Exception):
    pass


def test_budgeted_run_calibrates_plans_tops_up_and_reruns_from_the_cache(setup, tmp_path, capsys, monkeypatch):
    """`--budget`: calibration, the plan (stored), the top-up decision (stored), training fitted to the
    time left; the report carries the plan with what each step took, a rerun does no work, and a
    resumed attempt counts the time its cached steps took."""
    root, verifier = setup
    ver = tmp_path / "verifier"
    shutil.copytree(verifier, ver)
    cfg_json = json.loads((ver / "config.json").read_text())
    cfg_json["max_position_embeddings"] = 4096  # MT-Bench prompts in this byte-level tokenizer run past 512
    (ver / "config.json").write_text(json.dumps(cfg_json))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in _prompts(24)))
    cfg = _config(tmp_path, ver, "budget", budget=0.5, bench__num_draft_tokens=[1, 3], bench__choose_k=True)
    rc = main(["pipeline", "run", str(cfg)])
    assert rc == EXIT_GATE_FAILED
    out = tmp_path / "budget"
    report = json.loads((out / "report.json").read_text())
    # bench.choose_k: one k timed, chosen on pilot prompts; the exported draft carries the k the gate judged
    cand = report["bench"]["candidate"]
    assert cand["k"] in (1, 3) and "pilot decode on 2 prompt(s) that are not judged" in cand["k_selection"]
    exported = json.loads((Path(report["candidate_draft"]) / "config.json").read_text())
    assert exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cand["k"]
    stored = json.loads((out / "plan.json").read_text())
    plan = report["plan"]
    assert plan["budget_minutes"] == 0.5 and plan["num_conversations"] == stored["plan"]["num_conversations"]
    assert set(plan["predicted_seconds"]) == {"fixed", "regenerate", "capture", "train", "bench"}
    assert all(plan["actual_seconds"][k] is not None for k in ("regenerate", "capture", "train", "bench"))
    top = plan["top_up"]
    assert top == stored["top_up"] and top["conversations"] > 0 and top["tokens"] > 0
    # the replies came out short, so it asked for more prompts than this 24-prompt dataset has: it trains on 24
    assert top["prompts"] > 0 and report["data"]["prompts"] == 24
    assert stored["train_fit"]["tokens"] == report["data"]["tokens"]
    # capture and training were timed again on the replies made; training fills the time left itself
    assert top["repriced"]["capture_per_token"] > 0 and top["repriced"]["train_per_position"] > 0
    assert top["repriced"]["decode_per_token"] > 0 and 0 < top["bench_seconds"] <= plan["predicted_seconds"]["bench"]
    assert report["config"]["train"]["target_minutes"] == stored["train_fit"]["target_minutes"] > 0
    assert isinstance(plan["train_fits"], list)
    assert "[plan] plan for 0.5 min on this machine" in capsys.readouterr().err
    # a rerun: the stored plan, every step from the cache
    assert main(["pipeline", "run", str(cfg)]) == EXIT_GATE_FAILED
    cap = capsys.readouterr()
    err = cap.err
    assert "[plan] reusing" in err
    assert "min with the steps an earlier attempt finished)" in cap.out
    for step in ("prompts", "regenerate", "capture", "train", "bench", "export"):
        assert f"[{step}] up to date" in err
    assert "[topup] no further prompts" in err  # the only work: finding the dataset exhausted again
    # A resumed attempt (the stored plan, the data steps cached, training's fit not yet decided):
    # the budget also counts the time the cached steps took when they ran.
    from draftsmith.pipeline import budget

    raw = json.loads((out / "plan.json").read_text())
    del raw["train_fit"]
    (out / "plan.json").write_text(json.dumps(raw))
    seen = []

    def fit(cfg, plan, tokens, elapsed, out_dir):
        seen.append(elapsed)
        raise _Stop

    monkeypatch.setattr(budget, "fit_training", fit)
    with pytest.raises(_Stop):
        main(["pipeline", "run", str(cfg)])
    earlier = sum(json.loads((d / "done.json").read_text())["seconds"] for d in (out / "steps").iterdir()
                  if d.name.split("-")[0] in ("prompts", "regenerate", "topup_prompts", "topup_regenerate",
                                              "topup_merge", "capture") and (d / "done.json").is_file())
    assert earlier > 0 and len(seen) == 1 and seen[0] >= earlier


def test_a_failed_gate_names_the_draft_it_did_not_publish(tmp_path, capsys):
    """A FAIL leaves OUT/draft alone; the last lines say where the judged draft is, so it can be measured
    otherwise (compiled steps, a serving engine). A PASS, the control, does not print that line."""
    from draftsmith.cli import build_parser
    from draftsmith.config import from_args
    from draftsmith.errors import GateFailed
    from draftsmith.pipeline.runner import _finish

    draft = tmp_path / "steps" / "export-1" / "draft"
    draft.mkdir(parents=True)
    failed = {"passed": False, "speedup": 1.01, "k": 1, "acceptance_length": 1.47, "reasons": ["below 1.20x"]}
    with pytest.raises(GateFailed, match="below 1.20x"):
        _finish({"gate": failed, "bench": {"report": "r"}, "candidate_draft": str(draft),
                 "deployed_draft": None, "config": {"verifier": "smollm2-135m"}}, tmp_path)
    out = capsys.readouterr().out
    assert f"the draft the gate judged (not published): {draft}" in out
    command = f"draftsmith bench --verifier smollm2-135m --draft {draft} --compile --out {tmp_path / 'bench-compiled'}"
    assert command in out
    # the command it prints is a valid bench configuration (its required options given)
    ns = build_parser().parse_args(command.split()[1:])
    assert from_args(ns._command.config, ns, None).draft == [str(draft)]
    passed = {**failed, "passed": True, "speedup": 1.3, "reasons": []}
    assert _finish({"gate": passed, "bench": {"report": "r"}, "candidate_draft": str(draft),
                    "deployed_draft": "runs/x/draft"}, tmp_path) == 0
    assert "not published" not in capsys.readouterr().out


def test_refresh_line_says_when_a_draft_stopped_early(tmp_path, capsys):
    """With --draft-confidence a row's acceptance is over the rounds that drafted: the refresh line says
    how many did, and says nothing of it when every round drafted (the negative control)."""
    from draftsmith.pipeline.runner import _finish

    gate = {"passed": True, "speedup": 1.1, "k": 2, "acceptance_length": 1.6, "reasons": []}
    for fractions, shown in (((0.4, 0.76), "over the rounds that drafted: 40% -> 76%"), ((1.0, 1.0), None)):
        before = {"acceptance_length": 1.3, "speedup": 0.95, "drafted_fraction": fractions[0]}
        after = {"acceptance_length": 1.6, "speedup": 1.1, "drafted_fraction": fractions[1]}
        _finish({"before": before, "after": after, "gate": gate, "bench": {"report": "r"},
                 "deployed_draft": "d"}, tmp_path)
        out = capsys.readouterr().out
        assert "refresh: acceptance length 1.30 -> 1.60" in out
        assert (shown in out) if shown else "drafted" not in out


@pytest.mark.parametrize("data_dtype, shared", [("float32", True), ("bfloat16", False)])
def test_one_verifier_copy_serves_data_and_bench_when_their_dtypes_agree(tmp_path, monkeypatch, data_dtype, shared):
    """The data steps' verifier is the bench's own object when both resolve to one dtype (on CUDA both
    are bfloat16: an 8B verifier loaded twice would take 32 GB of the GPU); a second copy otherwise."""
    from draftsmith.pipeline import runner, steps
    from draftsmith.pipeline.config import build_config

    made = []

    class Stop(Exception):
        pass

    class Recorded(steps.Verifier):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

        @property
        def fingerprint(self):  # the run's first use of a verifier: stop there
            raise Stop

    monkeypatch.setattr(steps, "Verifier", Recorded)
    path = _config(tmp_path, tmp_path / "no-model-needed", "o", data__dtype=data_dtype)
    with pytest.raises(Stop):
        runner.run(build_config(str(path), {}))
    assert [m.dtype for m in made] == (["auto"] if shared else ["auto", "bfloat16"])
