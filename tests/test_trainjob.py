"""Kubeflow Trainer v2: the TrainJob manifest that runs `draftsmith train` under torchrun."""

from __future__ import annotations

import yaml

from draftsmith.cli import EXIT_ERROR, build_parser, main
from draftsmith.config import from_args
from draftsmith.pipeline import trainjob as T
from draftsmith.pipeline.config import build_config
from draftsmith.train.loop import TrainConfig


def _train_argv(command: list[str]) -> list[str]:
    assert command[:4] == ["torchrun", "--module", "draftsmith.cli", "train"]
    return command[4:]


def test_trainjob_manifest_runs_draftsmith_train_under_torchrun():
    train = TrainConfig(verifier="/data/verifier", data="/data/run/shards", out="/data/draft", epochs=2.5,
                        lr=3e-4, precision="bf16", draft_vocab_size=16384)
    m = T.trainjob_manifest(train, num_nodes=4, nproc_per_node=8, gpus_per_node=8, image="reg/draftsmith:1",
                            pvc="draftsmith-data", namespace="ml")
    assert m["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and m["kind"] == "TrainJob"
    assert m["metadata"] == {"name": "draftsmith-train", "namespace": "ml",
                             "labels": {"app.kubernetes.io/name": "draftsmith", "app.kubernetes.io/component": "train"}}
    assert m["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                       "name": "torch-distributed"}
    trainer = m["spec"]["trainer"]
    assert trainer["image"] == "reg/draftsmith:1"
    assert trainer["numNodes"] == 4 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8}}
    # the flags after `train` parse back, with the `draftsmith train` parser, into the same config
    ns = build_parser().parse_args(["train", *_train_argv(trainer["command"])])
    assert from_args(TrainConfig, ns) == train
    # the claim is mounted into the trainer container ("node") of every node
    (patch,) = m["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    assert job["name"] == "node" and pod["volumes"] == [
        {"name": "draftsmith-data", "persistentVolumeClaim": {"claimName": "draftsmith-data"}}]
    assert pod["containers"] == [{"name": "node", "volumeMounts": [{"name": "draftsmith-data", "mountPath": "/data"}]}]
    # YAML round trip
    assert yaml.safe_load(yaml.safe_dump(m)) == m


def test_trainjob_without_image_installs_draftsmith_in_the_runtime_image():
    m = T.trainjob_manifest(TrainConfig(verifier="smollm2-135m", data="/d/shards"), package="draftsmith==0.1.0")
    trainer = m["spec"]["trainer"]
    assert "image" not in trainer and "numProcPerNode" not in trainer and "runtimePatches" not in m["spec"]
    assert trainer["command"][:2] == ["bash", "-c"]
    script = trainer["command"][2]
    assert script.startswith("pip install --quiet draftsmith==0.1.0 && exec torchrun --module draftsmith.cli train ")
    import shlex

    argv = shlex.split(script.split("exec ", 1)[1])
    assert argv[4:] == ["--verifier", "smollm2-135m", "--data", "/d/shards"]


def test_trainjob_cli_layers_flags_over_config_file(tmp_path):
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump({"preset": "full", "train": {"lr": 5e-4}}))
    out = tmp_path / "tj.yaml"
    rc = main(["kfp", "trainjob", "--verifier", "/data/v", "--data", "/data/shards", "--config", str(config),
               "--epochs", "2", "--num-nodes", "2", "--nproc-per-node", "4", "--image", "img", "--pvc", "claim",
               "--name", "eagle-train", "--out", str(out)])
    assert rc == 0
    m = yaml.safe_load(out.read_text())
    assert m["metadata"]["name"] == "eagle-train" and m["spec"]["trainer"]["numNodes"] == 2
    cfg = from_args(TrainConfig, build_parser().parse_args(["train", *_train_argv(m["spec"]["trainer"]["command"])]))
    full = build_config(str(config)).train
    assert cfg.epochs == 2  # the flag wins over the file
    default_ttt = TrainConfig.__dataclass_fields__["ttt_steps"].default
    assert full.ttt_steps != default_ttt  # the preset sets it, so it shows whether the preset travelled
    assert cfg.lr == 5e-4 and cfg.ttt_steps == full.ttt_steps  # the file (and its preset) under it
    assert (cfg.verifier, cfg.data, cfg.out) == ("/data/v", ["/data/shards"], "/data/draft")
    assert main(["kfp", "trainjob", "--verifier", "v", "--data", "d", "--name", "Bad_Name",
                 "--out", str(tmp_path / "x.yaml")]) == EXIT_ERROR
    assert main(["kfp", "trainjob", "--verifier", "v", "--data", "d", "--num-nodes", "0",
                 "--out", str(tmp_path / "x.yaml")]) == EXIT_ERROR
