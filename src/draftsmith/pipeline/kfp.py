"""Kubeflow Pipelines v2: the pipeline's steps as a KFP pipeline.

``draftsmith kfp compile`` writes a KFP v2 pipeline (IR YAML) of lightweight Python
components, one per step; each component body rebuilds the configuration from a
JSON string and calls the same :mod:`draftsmith.pipeline.steps` function the local
pipeline runs, so the two cannot drift apart. Steps hand each other KFP artifacts
(``Dataset``: prompts, regenerated replies, hidden-state shards; ``Model``: the
trained draft and the deployable one; ``Metrics``; the bench report), and the
export step runs only under a ``dsl.If`` on the gate's verdict.

A first ``configure`` step validates the configuration and gives every step only
the part of it that step depends on, so KFP's cache reruns no more than the runner's
step cache would: raising the gate's threshold re-runs the gate, not the training.

Multi-node training on Kubeflow (a Trainer v2 ``TrainJob``) is :mod:`draftsmith.pipeline.trainjob`.

The kfp SDK (the ``kfp`` extra) is imported only while building the pipeline. (No
``from __future__ import annotations`` in this module: KFP reads the components'
annotations as objects.)
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from draftsmith.config import from_dict, opt, to_dict
from draftsmith.errors import DraftsmithError
from draftsmith.pipeline.config import PipelineConfig, build_config
from draftsmith.pipeline.trainjob import DEFAULT_PACKAGE, GPU

DEFAULT_BASE_IMAGE = "python:3.11-slim"

STEPS = ("prompts", "regenerate", "capture", "train", "bench", "gate", "export")
# What each step depends on (the keys of its slice of the configuration), as in the runner's cache
# keys; None: the whole configuration (export records all of it in the draft's provenance).
STEP_FIELDS: dict[str, tuple[str, ...] | None] = {
    "prompts": ("data",),
    "regenerate": ("verifier", "device", "data"),
    "capture": ("verifier", "device", "data"),
    "train": ("verifier", "dtype", "device", "num_draft_tokens", "verifier_name", "train"),
    "bench": ("verifier", "dtype", "device", "previous_draft", "bench"),
    "gate": ("gate", "bench"),  # bench: gate.engine must be one it measured
    "export": None,
}


# ----------------------------------------------------------------------------- helpers the components call
def config_json(cfg: PipelineConfig) -> str:
    """The pipeline configuration as the JSON string the components receive."""
    return json.dumps(to_dict(cfg), sort_keys=True)


def config_from_json(text: str) -> PipelineConfig:
    """Rebuild (and validate) the configuration; missing keys take their defaults."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"config_json: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise DraftsmithError("config_json: expected a JSON object")
    return from_dict(PipelineConfig, raw)


def step_configs(text: str) -> tuple[str, ...]:
    """Each step's slice of the configuration (JSON), in :data:`STEPS` order.

    The draft length k is resolved here (:func:`steps.export_k`) so that training
    depends on k, not on the whole bench section it may come from.
    """
    from draftsmith.pipeline.steps import export_k

    cfg = config_from_json(text)
    full = to_dict(dataclasses.replace(cfg, num_draft_tokens=export_k(cfg)))
    return tuple(json.dumps(full if STEP_FIELDS[s] is None else {k: full[k] for k in STEP_FIELDS[s]},
                            sort_keys=True) for s in STEPS)


def workdir(artifact: Any) -> Path:
    """An output artifact's path, as a directory (created)."""
    path = Path(artifact.path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_metrics(metrics: Any, values: dict[str, Any] | None) -> None:
    """Log the numeric entries of ``values`` (KFP metrics hold numbers) and write them to the artifact's file.

    The file makes the artifact exist on disk, which kfp.local's cache requires of every
    output (``log_metric`` alone only sets metadata).
    """
    nums = {k: float(v) for k, v in (values or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for name, value in nums.items():
        metrics.log_metric(name, value)
    path = Path(metrics.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nums, indent=2, sort_keys=True))


# ----------------------------------------------------------------------------- components
def _components(base_image: str, packages: list[str], install_kfp: bool) -> dict[str, Any]:
    """The lightweight components, one per step (plus ``configure``).

    KFP ships each function's *source* to the container and runs it there, so the
    bodies import what they use and keep logic to calling draftsmith. They are
    defined here rather than at module level because their annotations need the
    kfp SDK, which draftsmith does not require.
    """
    from kfp import dsl
    from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Model, Output, OutputPath

    def configure(config_json: str) -> NamedTuple("StepConfigs", [  # noqa: UP014 (KFP reads the functional form)
            ("prompts", str), ("regenerate", str), ("capture", str), ("train", str), ("bench", str),
            ("gate", str), ("export", str)]):
        """Validate the configuration; give each step the part it depends on."""
        from draftsmith.pipeline.kfp import step_configs

        return step_configs(config_json)

    def prompts(config_json: str, prompts: Output[Dataset]):
        """Training prompts -> prompts.jsonl."""
        from draftsmith.pipeline import steps
        from draftsmith.pipeline.kfp import config_from_json, workdir

        cfg = config_from_json(config_json)
        res = steps.prompts(cfg.data, workdir(prompts))
        prompts.metadata.update({"count": res["count"], "sha": res["sha"], "dataset": cfg.data.dataset})

    def regenerate(config_json: str, prompts: Input[Dataset], regenerated: Output[Dataset]):
        """The verifier's own replies to the prompts -> regenerated.jsonl."""
        from pathlib import Path

        from draftsmith.pipeline import steps
        from draftsmith.pipeline.kfp import config_from_json, workdir

        cfg = config_from_json(config_json)
        v = steps.Verifier(cfg.verifier, steps.data_dtype(cfg.data.dtype, cfg.device), cfg.device)
        res = steps.regenerate(v, Path(prompts.path) / "prompts.jsonl", cfg.data, workdir(regenerated))
        regenerated.metadata.update({"count": res["count"], "sha": res["sha"], "verifier_fingerprint": v.fingerprint})

    def capture(config_json: str, regenerated: Input[Dataset], shards: Output[Dataset]):
        """Hidden states of the verifier over its replies -> shards/ (safetensors + manifest)."""
        from pathlib import Path

        from draftsmith.pipeline import steps
        from draftsmith.pipeline.kfp import config_from_json, workdir

        cfg = config_from_json(config_json)
        v = steps.Verifier(cfg.verifier, steps.data_dtype(cfg.data.dtype, cfg.device), cfg.device)
        res = steps.capture(v, Path(regenerated.path) / "regenerated.jsonl", cfg.data, workdir(shards))
        shards.metadata.update({k: res[k] for k in ("sha", "tokens", "loss_tokens", "aux_layer_ids")})

    def train(config_json: str, shards: Input[Dataset], draft: Output[Model], metrics: Output[Metrics]):
        """Train the EAGLE-3 draft on the shards -> the draft directory (speculators format)."""
        import shutil
        import tempfile
        from pathlib import Path

        from draftsmith.pipeline import steps
        from draftsmith.pipeline.kfp import config_from_json, log_metrics

        cfg = config_from_json(config_json)
        v = steps.Verifier(cfg.verifier, cfg.dtype, cfg.device)
        with tempfile.TemporaryDirectory() as work:  # checkpoints stay out of the artifact store
            res = steps.train(v, Path(shards.path) / "shards", cfg.train, Path(work), steps.export_k(cfg),
                              cfg.verifier_name)
            shutil.copytree(res["draft_dir"], draft.path)
        draft.metadata.update({"steps": res["steps"], "best_val_acceptance_length": res["best_val_acceptance_length"],
                               "train_seconds": res["train_seconds"], "tokens": shards.metadata.get("tokens"),
                               "sha": res["sha"]})
        log_metrics(metrics, {**res["summary"], "steps": res["steps"]})

    def bench(config_json: str, draft: Input[Model], report: Output[Artifact], report_md: Output[Markdown],
              metrics: Output[Metrics]):
        """Measure the draft against plain decoding -> report (json, md, plots) and metrics."""
        import json
        import shutil
        from pathlib import Path

        from draftsmith.pipeline import steps
        from draftsmith.pipeline.kfp import config_from_json, log_metrics, workdir

        cfg = config_from_json(config_json)
        v = steps.Verifier(cfg.verifier, cfg.dtype, cfg.device)
        drafts = {"candidate": Path(draft.path)}
        if cfg.previous_draft:
            drafts["previous"] = Path(cfg.previous_draft)
        work = workdir(report)
        res = steps.bench(v, drafts, cfg.bench, work, progress=False)
        (work / "summary.json").write_text(json.dumps(res, indent=2))
        shutil.copyfile(work / "report.md", report_md.path)
        log_metrics(metrics, res["summary"])

    def gate(config_json: str, report: Input[Artifact], metrics: Output[Metrics], reasons: OutputPath(str),
             verdict: OutputPath(str)) -> bool:
        """The deploy verdict; its return value (``Output``) is what the export condition tests."""
        import json
        from pathlib import Path

        from draftsmith.pipeline import steps
        from draftsmith.pipeline.kfp import config_from_json, log_metrics

        cfg = config_from_json(config_json)
        measured = json.loads((Path(report.path) / "summary.json").read_text())
        result = steps.gate(*steps.gate_inputs(measured, cfg.gate.engine), cfg.gate)
        Path(reasons).write_text("; ".join(result["reasons"]))
        Path(verdict).write_text(json.dumps(result))
        log_metrics(metrics, {**result, "passed": float(result["passed"])})
        print(("PASS: " if result["passed"] else "FAIL: ") + "; ".join(result["reasons"]))
        return bool(result["passed"])

    def export(config_json: str, draft: Input[Model], report: Input[Artifact], verdict: str,
               deployable: Output[Model]):
        """Write the deployable draft (speculators format, model card, provenance) for `vllm serve`."""
        import json
        from pathlib import Path

        from draftsmith.models.speculators import read_provenance
        from draftsmith.pipeline import steps
        from draftsmith.pipeline.kfp import config_from_json

        cfg = config_from_json(config_json)
        measured = json.loads((Path(report.path) / "summary.json").read_text())
        trained = {**draft.metadata, "steps": int(draft.metadata["steps"])}  # KFP metadata numbers are floats
        tokens = draft.metadata.get("tokens")
        metrics, provenance = steps.export_metadata(cfg, trained, None if tokens is None else int(tokens),
                                                    measured["summary"], json.loads(verdict), mode="kubeflow",
                                                    report=report.uri)
        fingerprint = ((read_provenance(draft.path) or {}).get("verifier") or {}).get("fingerprint")
        out = Path(deployable.path)
        out.parent.mkdir(parents=True, exist_ok=True)
        k = steps.export_k(cfg, steps.gate_inputs(measured, cfg.gate.engine)[0])  # the k the gate judged
        res = steps.export(Path(draft.path), out, verifier_name=cfg.verifier_name, num_draft_tokens=k,
                           fingerprint=fingerprint, metrics=metrics,
                           provenance=provenance)
        deployable.metadata.update({"sha": res["sha"], "num_draft_tokens": k,
                                    "speedup": (measured["summary"] or {}).get("speedup")})

    funcs: list[Callable[..., Any]] = [configure, prompts, regenerate, capture, train, bench, gate, export]
    return {f.__name__: dsl.component(f, base_image=base_image, packages_to_install=packages,
                                      install_kfp_package=install_kfp) for f in funcs}


# ----------------------------------------------------------------------------- the pipeline
def build_pipeline(cfg: PipelineConfig, image: str | None = None, package: str | None = None, gpus: int = 0,
                   name: str = "draftsmith") -> Any:
    """The KFP pipeline (a ``dsl.pipeline`` function) for ``cfg``.

    Args:
        cfg: the pipeline configuration; it becomes the ``config_json`` parameter's default.
        image: a container image with draftsmith and kfp installed; None: ``python:3.11-slim``
            plus a pip install of ``package`` (and of kfp) when each step starts.
        package: pip requirement for draftsmith (default ``draftsmith`` when ``image`` is None;
            with ``image``, installed on top of it only when given).
        gpus: GPUs (``nvidia.com/gpu``) for each model step (regenerate, capture, train, bench).
        name: the pipeline's name.
    """
    try:
        from kfp import dsl
    except ImportError:
        raise DraftsmithError("the Kubeflow Pipelines SDK is not installed: pip install 'draftsmith[kfp]'") from None
    if gpus < 0:
        raise DraftsmithError(f"--gpus must be >= 0, got {gpus}")
    if image is None:
        base, packages = DEFAULT_BASE_IMAGE, [package or DEFAULT_PACKAGE]
    else:
        base, packages = image, [package] if package else []
    c = _components(base, packages, install_kfp=image is None or bool(package))
    default_config = config_json(cfg)

    @dsl.pipeline(name=name, description="draftsmith: train an EAGLE-3 draft for the verifier, measure it against "
                                         "plain decoding, and export it only if the gate passes.")
    def draftsmith_pipeline(config_json: str = default_config):
        conf = c["configure"](config_json=config_json)
        p = c["prompts"](config_json=conf.outputs["prompts"])
        r = c["regenerate"](config_json=conf.outputs["regenerate"], prompts=p.outputs["prompts"])
        s = c["capture"](config_json=conf.outputs["capture"], regenerated=r.outputs["regenerated"])
        t = c["train"](config_json=conf.outputs["train"], shards=s.outputs["shards"])
        b = c["bench"](config_json=conf.outputs["bench"], draft=t.outputs["draft"])
        g = c["gate"](config_json=conf.outputs["gate"], report=b.outputs["report"])
        for task in (r, s, t, b) if gpus else ():
            task.set_accelerator_type(GPU).set_accelerator_limit(gpus)
        # The gate's return value is its "Output"; kfp.local (2.17) resolves a condition on a
        # task output only under that name, not on a NamedTuple field.
        with dsl.If(g.outputs["Output"] == True, name="gate-passed"):  # noqa: E712 (a KFP expression)
            c["export"](config_json=conf.outputs["export"], draft=t.outputs["draft"], report=b.outputs["report"],
                        verdict=g.outputs["verdict"])

    return draftsmith_pipeline


def compile_pipeline(cfg: PipelineConfig, out_path: str | Path, image: str | None = None,
                     package: str | None = None, gpus: int = 0, name: str = "draftsmith") -> Path:
    """Compile the pipeline for ``cfg`` to a KFP v2 IR YAML file; returns its path."""
    pipeline = build_pipeline(cfg, image=image, package=package, gpus=gpus, name=name)
    from kfp import compiler

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, package_path=str(out))
    return out


# ----------------------------------------------------------------------------- CLI entry
@dataclass
class KfpCompileConfig:
    """Compile the pipeline for Kubeflow Pipelines v2: one lightweight component per step (prompts,
    regenerate, capture, train, bench, gate, export) calling draftsmith's own step functions, with
    export under a condition on the gate. Submit the YAML in the KFP UI or with
    `kfp.Client().create_run_from_pipeline_package`. Needs the kfp extra (pip install 'draftsmith[kfp]')."""

    config: str | None = opt(None, "YAML file with the pipeline configuration (sections: data, train, bench, gate)",
                             positional=True, metavar="CONFIG.yaml")
    verifier: str | None = opt(None, "verifier as the step containers see it: an alias, or a path in the image or "
                                     "on a mounted volume (overrides the file; default smollm2-135m)")
    preset: str | None = opt(None, "budget preset: tiny, small (default), full")
    out: str = opt("pipeline.yaml", "where the compiled pipeline goes")
    image: str | None = opt(None, f"container image with draftsmith and kfp installed; omitted: {DEFAULT_BASE_IMAGE} "
                                  "with --package pip-installed when each step starts")
    package: str | None = opt(None, f"pip requirement for draftsmith (default {DEFAULT_PACKAGE!r} without --image): "
                                    "a version, a wheel URL or git+https://...")
    gpus: int = opt(0, "GPUs per model step (regenerate, capture, train, bench)")
    name: str = opt("draftsmith", "pipeline name")


def compile_cli(args: KfpCompileConfig) -> int:
    cfg = build_config(args.config, {"verifier": args.verifier, "preset": args.preset})
    out = compile_pipeline(cfg, args.out, image=args.image, package=args.package, gpus=args.gpus, name=args.name)
    print(f"compiled the Kubeflow pipeline {args.name!r} (verifier {cfg.verifier}, preset {cfg.preset}) -> {out}\n"
          f"submit it in the KFP UI, or: python -c \"import kfp; kfp.Client(host='$KFP_HOST')"
          f".create_run_from_pipeline_package('{out}')\"")
    return 0
