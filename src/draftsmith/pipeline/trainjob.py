"""Kubeflow Trainer v2: a ``TrainJob`` that runs ``draftsmith train`` under torchrun on N nodes.

``draftsmith kfp trainjob`` writes the manifest; the ``torch-distributed`` runtime
injects the rendezvous settings torchrun reads. Needs PyYAML alone (not the kfp SDK).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from draftsmith.config import opt, to_argv, to_dict
from draftsmith.errors import DraftsmithError
from draftsmith.pipeline.config import TrainSection, build_config

DEFAULT_PACKAGE = "draftsmith"
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
GPU = "nvidia.com/gpu"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def trainjob_manifest(train: Any, *, name: str = "draftsmith-train", namespace: str | None = None,
                      num_nodes: int = 1, nproc_per_node: int | None = None, gpus_per_node: int = 0,
                      image: str | None = None, package: str = DEFAULT_PACKAGE, pvc: str | None = None,
                      mount_path: str = "/data", runtime: str = "torch-distributed") -> dict[str, Any]:
    """A Kubeflow Trainer v2 ``TrainJob`` running ``draftsmith train`` under torchrun on every node.

    The ``torch-distributed`` runtime sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
    ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` from ``numNodes`` and
    ``numProcPerNode``; torchrun reads them, so the command carries no rendezvous flags.
    Training is DDP: every rank reads the shards, rank 0 writes the draft.

    Args:
        train: a :class:`~draftsmith.train.loop.TrainConfig` whose paths are as the pods see
            them (``verifier``, ``data``, ``out``); its non-default fields become flags.
        name: the TrainJob's name (an RFC 1035 label).
        namespace: its namespace (None: kubectl's current one).
        num_nodes: training nodes.
        nproc_per_node: processes per node (None: the runtime's default, one per GPU).
        gpus_per_node: ``nvidia.com/gpu`` limit per node (0: none requested).
        image: a container image with draftsmith installed; None: the runtime's own
            (PyTorch) image, with ``package`` pip-installed before training starts.
        package: the pip requirement installed when ``image`` is None.
        pvc: a PersistentVolumeClaim mounted at ``mount_path`` on every node (for the shards,
            the verifier and the output; ReadWriteMany when there is more than one node).
        mount_path: where the claim is mounted.
        runtime: the ClusterTrainingRuntime to run on.

    Raises:
        DraftsmithError: a bad name or count (naming the flag).
    """
    if not (_DNS_LABEL.match(name) and len(name) <= 63):
        raise DraftsmithError(f"--name {name!r}: a TrainJob name must be a lowercase RFC 1035 label "
                              "(letters, digits, '-'; at most 63 characters; starting with a letter)")
    if num_nodes < 1:
        raise DraftsmithError(f"--num-nodes must be >= 1, got {num_nodes}")
    if nproc_per_node is not None and nproc_per_node < 1:
        raise DraftsmithError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if gpus_per_node < 0:
        raise DraftsmithError(f"--gpus-per-node must be >= 0, got {gpus_per_node}")
    argv = ["torchrun", "--module", "draftsmith.cli", "train", *to_argv(train)]
    trainer: dict[str, Any] = {}
    if image:
        trainer["image"] = image
        trainer["command"] = argv
    else:
        trainer["command"] = ["bash", "-c", f"pip install --quiet {shlex.quote(package)} && exec {shlex.join(argv)}"]
    trainer["numNodes"] = num_nodes
    if nproc_per_node is not None:
        trainer["numProcPerNode"] = nproc_per_node
    if gpus_per_node:
        trainer["resourcesPerNode"] = {"limits": {GPU: gpus_per_node}}
    trainer["env"] = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"}]
    spec: dict[str, Any] = {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                           "name": runtime},
                            "trainer": trainer}
    if pvc:
        pod = {"volumes": [{"name": "draftsmith-data", "persistentVolumeClaim": {"claimName": pvc}}],
               "containers": [{"name": "node", "volumeMounts": [{"name": "draftsmith-data", "mountPath": mount_path}]}]}
        # runtimePatches (Trainer >= 2.2) replaced podTemplateOverrides; "node" is the trainer's job and container.
        spec["runtimePatches"] = [{"manager": "draftsmith", "trainingRuntimeSpec": {"template": {"spec": {
            "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}]
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "draftsmith",
                                                         "app.kubernetes.io/component": "train"}}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": metadata, "spec": spec}


def write_manifest(manifest: dict[str, Any], out_path: str | Path) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(manifest, sort_keys=False, width=120))
    return out



# ----------------------------------------------------------------------------- CLI entry
@dataclass(kw_only=True)
class KfpTrainJobConfig(TrainSection):
    """Write a Kubeflow Trainer v2 TrainJob that trains the draft with `draftsmith train` under torchrun
    on one or more nodes (DDP), on shards made by `draftsmith data` (e.g. on a shared volume).
    Training settings: the flags below, over the train section (and preset) of --config.
    Apply it with `kubectl apply -f trainjob.yaml`."""

    verifier: str = opt(help="verifier as the pods see it: an alias, or a path in the image or on --pvc")
    data: str = opt(help="directory of captured shards as the pods see it (e.g. /data/run/shards on --pvc)")
    out: str = opt("trainjob.yaml", "where the TrainJob manifest goes")
    draft_out: str = opt("/data/draft", "training output directory in the pods (checkpoints, the draft)")
    config: str | None = opt(None, "YAML pipeline configuration whose preset and train section set the training "
                                   "defaults (flags still win)")
    preset: str | None = opt(None, "budget preset for the training defaults: tiny, small (default), full")
    num_draft_tokens: int = opt(5, "speculative tokens (k) written into the draft's config")
    num_nodes: int = opt(1, "training nodes")
    nproc_per_node: int | None = opt(None, "processes per node (default: the runtime's, one per GPU)")
    gpus_per_node: int = opt(0, "nvidia.com/gpu limit per node")
    image: str | None = opt(None, "container image with draftsmith installed; omitted: the runtime's PyTorch image "
                                  "with --package pip-installed first")
    package: str = opt(DEFAULT_PACKAGE, "pip requirement for draftsmith when --image is omitted")
    pvc: str | None = opt(None, "PersistentVolumeClaim mounted on every node at --mount-path")
    mount_path: str = opt("/data", "where --pvc is mounted")
    name: str = opt("draftsmith-train", "TrainJob name")
    namespace: str | None = opt(None, "TrainJob namespace")
    runtime: str = opt("torch-distributed", "ClusterTrainingRuntime to run on")


def trainjob_defaults(ns: Any) -> dict[str, Any]:
    """Training defaults from ``--config``/``--preset`` (the pipeline's train section), under the flags."""
    file, preset = getattr(ns, "config", None), getattr(ns, "preset", None)
    if file is None and preset is None:
        return {}
    return to_dict(build_config(file, {"preset": preset}).train)


def trainjob_config(args: KfpTrainJobConfig) -> Any:
    """The ``draftsmith train`` configuration the TrainJob runs."""
    from draftsmith.train.loop import TrainConfig

    section = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSection)}
    return TrainConfig(verifier=args.verifier, data=args.data, out=args.draft_out,
                       num_draft_tokens=args.num_draft_tokens, **section)


def trainjob_cli(args: KfpTrainJobConfig) -> int:
    manifest = trainjob_manifest(trainjob_config(args), name=args.name, namespace=args.namespace,
                                 num_nodes=args.num_nodes, nproc_per_node=args.nproc_per_node,
                                 gpus_per_node=args.gpus_per_node, image=args.image, package=args.package,
                                 pvc=args.pvc, mount_path=args.mount_path, runtime=args.runtime)
    out = write_manifest(manifest, args.out)
    print(f"wrote TrainJob {args.name!r} ({args.num_nodes} node(s)) -> {out}\napply it with: kubectl apply -f {out}")
    return 0
