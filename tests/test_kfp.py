"""Kubeflow: the compiled KFP v2 pipeline (components, artifacts, gate condition) and a real local run
with kfp.local's SubprocessRunner on a tiny verifier (gate passing, then failing).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from draftsmith.cli import EXIT_ERROR, build_parser, main
from draftsmith.config import from_args, opt, to_argv
from draftsmith.errors import DraftsmithError
from draftsmith.pipeline import kfp as K
from draftsmith.pipeline.config import build_config
from draftsmith.train.loop import TrainConfig

from conftest import save_tiny_chat_verifier  # noqa: E402


PROMPTS = ["Why is the sky blue?", "Name three prime numbers.", "What is a verb?", "Say hello in French.",
           "Count to five.", "What colour is grass?", "Is ice cold?", "Name a fruit.", "What is 2 + 2?",
           "Spell cat.", "Who wrote Hamlet?", "What do bees make?"]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """(verifier dir, pipeline YAML) for a pipeline run that takes seconds per step. The verifier
    echoes its last token (conftest.echo_model), so the trained draft is really faster and the
    gate's pass path runs on a measured speedup, not on a lowered threshold."""
    root = tmp_path_factory.mktemp("kfp")
    verifier = save_tiny_chat_verifier(root / "verifier", echo=True)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    config = root / "pipeline.yaml"
    config.write_text(yaml.safe_dump({
        "verifier": str(verifier), "preset": "tiny", "out": str(root / "unused"), "device": "cpu",
        "data": {"dataset": str(data), "num_conversations": 4, "max_new_tokens": 48, "batch_size": 4,
                 "max_length": 128, "dtype": "float32"},
        "train": {"epochs": 10, "lr": 3e-3, "draft_vocab_size": 128, "pack_tokens": 128, "eval_every": 10},
        "bench": {"num_prompts": 6, "max_new_tokens": 48, "num_draft_tokens": [3], "hf_reference": False},
    }))
    return verifier, config


# ----------------------------------------------------------------------------- the compiled pipeline
ARTIFACTS = {  # component: ({input artifact: type}, {output artifact: type})
    "prompts": ({}, {"prompts": "system.Dataset"}),
    "regenerate": ({"prompts": "system.Dataset"}, {"regenerated": "system.Dataset"}),
    "capture": ({"regenerated": "system.Dataset"}, {"shards": "system.Dataset"}),
    "train": ({"shards": "system.Dataset"}, {"draft": "system.Model", "metrics": "system.Metrics"}),
    "bench": ({"draft": "system.Model"},
              {"report": "system.Artifact", "report_md": "system.Markdown", "metrics": "system.Metrics"}),
    "gate": ({"report": "system.Artifact"}, {"metrics": "system.Metrics"}),
    "export": ({"draft": "system.Model", "report": "system.Artifact"}, {"deployable": "system.Model"}),
}


def _artifacts(defs: dict) -> dict[str, str]:
    return {k: v["artifactType"]["schemaTitle"] for k, v in defs.get("artifacts", {}).items()}


def test_compiled_pipeline_components_artifacts_and_gate_condition(tmp_path):
    pytest.importorskip("kfp")
    cfg = build_config(None, {"preset": "tiny", "verifier": "smollm2-135m"})
    spec = yaml.safe_load(K.compile_pipeline(cfg, tmp_path / "pipeline.yaml").read_text())
    assert spec["pipelineInfo"]["name"] == "draftsmith"
    assert spec["root"]["inputDefinitions"]["parameters"]["config_json"]["defaultValue"] == K.config_json(cfg)

    comps, execs = spec["components"], spec["deploymentSpec"]["executors"]
    for step in K.STEPS:
        assert comps[f"comp-{step}"]["executorLabel"] == f"exec-{step}"
        container = execs[f"exec-{step}"]["container"]
        assert container["image"] == K.DEFAULT_BASE_IMAGE
        source = "\n".join(container["command"])
        assert "pip install" in source and "'draftsmith'" in source  # the default image installs draftsmith
        assert container["args"][container["args"].index("--function_to_execute") + 1] == step
        assert f"steps.{step}(" in source  # the component calls the library's step, nothing else
        ins, outs = ARTIFACTS[step]
        assert _artifacts(comps[f"comp-{step}"].get("inputDefinitions", {})) == ins, step
        assert _artifacts(comps[f"comp-{step}"]["outputDefinitions"]) == outs, step
    gate_params = comps["comp-gate"]["outputDefinitions"]["parameters"]
    assert {k: v["parameterType"] for k, v in gate_params.items()} == {
        "Output": "BOOLEAN", "reasons": "STRING", "verdict": "STRING"}

    # data flows step to step as artifacts
    tasks = spec["root"]["dag"]["tasks"]
    chain = [("regenerate", "prompts", "prompts", "prompts"), ("capture", "regenerated", "regenerate", "regenerated"),
             ("train", "shards", "capture", "shards"), ("bench", "draft", "train", "draft"),
             ("gate", "report", "bench", "report")]
    for task, arg, producer, key in chain:
        src = tasks[task]["inputs"]["artifacts"][arg]["taskOutputArtifact"]
        assert (src["producerTask"], src["outputArtifactKey"]) == (producer, key), task
    for step in K.STEPS[:-1]:  # each step gets its slice of the configuration from `configure`
        src = tasks[step]["inputs"]["parameters"]["config_json"]["taskOutputParameter"]
        assert (src["producerTask"], src["outputParameterKey"]) == ("configure", step)

    # export is not a root task: it sits in a sub-DAG triggered by the gate's verdict
    assert "export" not in tasks
    (cond_name, cond), = [(n, t) for n, t in tasks.items() if "triggerPolicy" in t]
    assert cond["triggerPolicy"]["condition"] == "inputs.parameter_values['pipelinechannel--gate-Output'] == true"
    verdict_src = cond["inputs"]["parameters"]["pipelinechannel--gate-Output"]["taskOutputParameter"]
    assert (verdict_src["producerTask"], verdict_src["outputParameterKey"]) == ("gate", "Output")
    assert "gate" in cond["dependentTasks"]
    sub = comps[cond["componentRef"]["name"]]["dag"]["tasks"]
    assert list(sub) == ["export"] and sub["export"]["componentRef"]["name"] == "comp-export"
    draft_src = cond["inputs"]["artifacts"]["pipelinechannel--train-draft"]["taskOutputArtifact"]
    assert (draft_src["producerTask"], draft_src["outputArtifactKey"]) == ("train", "draft")


def test_compile_with_own_image_and_gpus(tmp_path):
    pytest.importorskip("kfp")
    rc = main(["kfp", "compile", "--preset", "tiny", "--image", "registry.example/draftsmith:0.1", "--gpus", "1",
               "--out", str(tmp_path / "p.yaml")])
    assert rc == 0
    spec = yaml.safe_load((tmp_path / "p.yaml").read_text())
    for step in K.STEPS:
        container = spec["deploymentSpec"]["executors"][f"exec-{step}"]["container"]
        assert container["image"] == "registry.example/draftsmith:0.1"
        assert "pip install" not in "\n".join(container["command"])  # the image has draftsmith and kfp
        gpu = container.get("resources", {}).get("accelerator", {})
        if step in ("regenerate", "capture", "train", "bench"):
            assert gpu.get("resourceType") == "nvidia.com/gpu" and str(gpu.get("resourceCount")) == "1", step
        else:
            assert not gpu, step


def test_step_configs_give_each_step_what_it_depends_on():
    cfg = build_config(None, {"preset": "tiny"})
    slices = dict(zip(K.STEPS, K.step_configs(K.config_json(cfg))))
    assert set(json.loads(slices["gate"])) == {"gate", "bench"}  # gate.engine is checked against bench.engines
    assert set(json.loads(slices["prompts"])) == {"data"}
    assert json.loads(slices["train"])["num_draft_tokens"] == 3  # k resolved: the tiny preset measures [3]
    assert K.config_from_json(slices["export"]) == dataclasses.replace(cfg, num_draft_tokens=3)
    stricter = K.step_configs(K.config_json(build_config(None, {"preset": "tiny", "gate": {"min_speedup": 2.0}})))
    changed = [s for s, a, b in zip(K.STEPS, K.step_configs(K.config_json(cfg)), stricter) if a != b]
    assert changed == ["gate", "export"]  # a new threshold re-runs the gate, not the training
    with pytest.raises(DraftsmithError, match="train.epochs"):
        K.config_from_json(json.dumps({"train": {"epochs": "many"}}))
    with pytest.raises(DraftsmithError, match="unknown config key"):
        K.config_from_json(json.dumps({"trian": {}}))


# ----------------------------------------------------------------------------- a real local run
def _run_dir(root: Path) -> Path:
    (run,) = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("draftsmith-")]
    return run


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # kfp.local: "custom or non-Python base image"
def test_local_subprocess_run_gate_pass_then_fail(tiny_setup, tmp_path):
    kfp = pytest.importorskip("kfp")
    from kfp import local

    from draftsmith.models.speculators import read_draft, read_provenance

    verifier, config = tiny_setup
    cfg = build_config(str(config))
    cache = tmp_path / "cache"
    # use_venv=False: the steps run in this interpreter's environment, where draftsmith is installed;
    # an --image means nothing is pip-installed.
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "pass"),
               workspace_root=str(tmp_path / "workspace"), enable_caching=True, cache_root=str(cache))
    K.build_pipeline(cfg, image="draftsmith:local")()
    run = _run_dir(tmp_path / "pass")
    deployable = run / "export" / "deployable"
    draft = read_draft(deployable)
    assert draft.config.num_draft_tokens == 3
    prov = read_provenance(deployable)
    assert prov["mode"] == "kubeflow" and prov["gate"]["passed"] is True
    assert prov["training"]["tokens"] > 0 and prov["metrics"]["acceptance_length"] >= 1.0
    assert json.loads((deployable / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert (run / "gate" / "reasons").read_text().startswith("measured speedup")
    report = json.loads((run / "bench" / "report" / "summary.json").read_text())
    assert report["summary"]["identical_output_rate"] == 1.0
    assert (run / "bench" / "report_md").read_text().startswith("#")
    assert json.loads((run / "train" / "metrics").read_text())["steps"] >= 1
    assert json.loads((run / "gate" / "metrics").read_text())["passed"] == 1.0

    # the same library steps as `draftsmith pipeline run`: the same configuration trains the same draft
    from draftsmith.pipeline import runner

    local_report = runner.run(dataclasses.replace(cfg, out=str(tmp_path / "cli")))
    assert local_report["gate"]["passed"]
    ours = read_draft(tmp_path / "cli" / "draft").state_dict()
    assert all(torch.equal(t, ours[k]) for k, t in draft.state_dict().items())

    # the same data, training and bench in bfloat16 (the GPU path, as far as a CPU runs it), an
    # unreachable threshold: the gate fails and export is skipped
    strict = build_config(str(config), {"gate": {"min_speedup": 100.0}, "dtype": "bfloat16"})
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "fail"),
               workspace_root=str(tmp_path / "workspace"), enable_caching=True, cache_root=str(cache))
    K.build_pipeline(strict, image="draftsmith:local")()
    run = _run_dir(tmp_path / "fail")
    verdict = json.loads((run / "gate" / "verdict").read_text())
    assert verdict["passed"] is False and "below the gate's 100.00x" in verdict["reasons"][0]
    assert verdict["outputs"]["mismatch"] == 0
    assert not (run / "export").exists()
    bf16 = json.loads((run / "bench" / "report" / "report.json").read_text())
    assert bf16["provenance"]["dtype"] == "bfloat16"
    assert not (run / "capture").exists()  # served from the cache: the data steps' slices did not change
    del kfp


def test_to_argv_round_trips_through_the_parser():
    from draftsmith.bench import BenchConfig

    cfg = BenchConfig(verifier="v", out=Path("/tmp/b"), drafter=["ngram", "ngram:2"], num_draft_tokens=[2, 4],
                      hf_reference=False, threads=1)
    argv = to_argv(cfg)
    assert "--no-hf-reference" in argv and argv[argv.index("--num-draft-tokens") + 1:][:2] == ["2", "4"]
    assert from_args(BenchConfig, build_parser().parse_args(["bench", *argv])) == cfg
    assert to_argv(TrainConfig(verifier="v")) == ["--verifier", "v"]

    @dataclasses.dataclass
    class Odd:
        name: str | None = opt("x", "a default that None would not restore")

    with pytest.raises(DraftsmithError, match="--name"):
        to_argv(Odd(name=None))


def test_draftsmith_works_without_the_kfp_sdk(monkeypatch, tmp_path):
    import subprocess
    import sys

    code = "import sys; import draftsmith.cli; print('kfp' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    monkeypatch.setitem(sys.modules, "kfp", None)  # `import kfp` now raises ImportError
    with pytest.raises(DraftsmithError, match=r"pip install 'draftsmith\[kfp\]'"):
        K.build_pipeline(build_config(None, {"preset": "tiny"}))
    assert main(["kfp", "compile", "--out", str(tmp_path / "p.yaml")]) == EXIT_ERROR
    assert main(["kfp", "trainjob", "--verifier", "v", "--data", "d", "--out", str(tmp_path / "t.yaml")]) == 0
