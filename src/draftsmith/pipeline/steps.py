"""The pipeline's steps as plain functions of paths and configs.

The CLI pipeline and the Kubeflow components call these same functions; each
takes its inputs as files/directories and writes its outputs into a work
directory, returning a small JSON-able summary.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from draftsmith.config import to_dict
from draftsmith.errors import DraftsmithError
from draftsmith.gate import gate, summarize_drafter  # noqa: F401  (gate: the gate step of the table)
from draftsmith.pipeline.cache import file_digest
from draftsmith.pipeline.config import BenchSection, DataSection, PipelineConfig, TrainSection


def data_dtype(dtype: str, device: str) -> str:
    """Resolve ``data.dtype``: "auto" is bfloat16 where it is fast (CUDA; CPUs with AMX or AVX-512
    BF16, :func:`~draftsmith.utils.cpu_fast_bf16`), else float32."""
    if dtype != "auto":
        return dtype
    from draftsmith.utils import cpu_fast_bf16, resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda" or cpu_fast_bf16():
        return "bfloat16"
    return "float32"


class Verifier:
    """The verifier, loaded once per process on first use."""

    def __init__(self, spec: str, dtype: str = "auto", device: str = "auto") -> None:
        self.spec, self.dtype, self.device = spec, dtype, device
        self._loaded: Any = None

    def _load(self) -> Any:
        if self._loaded is None:
            from draftsmith.models.verifier import load_verifier

            self._loaded = load_verifier(self.spec, dtype=self.dtype, device=self.device)
        return self._loaded

    @property
    def model(self) -> torch.nn.Module:
        return self._load().model

    @property
    def tokenizer(self) -> Any:
        return self._load().tokenizer

    @property
    def fingerprint(self) -> str:
        return self._load().fingerprint


def regeneration_key(data: DataSection) -> dict[str, Any]:
    """The data settings the prompts and regeneration steps depend on (capture-only ones left out,
    so changing them re-runs the capture, not the regeneration)."""
    d = to_dict(data)
    d.pop("trim_loops", None)
    # Where the replies come from, not the URL: a restarted server (another port) resumes the same run.
    if d.pop("endpoint", None) is not None:
        d["endpoint"] = True
    return d


def capture_key(data: DataSection) -> dict[str, Any]:
    """The capture settings its cached output depends on (besides the verifier and the replies)."""
    return {"max_length": data.max_length, "trim_loops": data.trim_loops}


def prompts_key(data: DataSection, v: "Verifier") -> dict[str, Any]:
    """The prompts step's cache inputs: the data settings, plus the verifier and its dtype when it
    writes the prompts itself (``--dataset self``)."""
    from draftsmith.data.selfprompts import SELF_DATASET

    key: dict[str, Any] = {"data": regeneration_key(data)}
    key["data"].pop("endpoint", None)  # the prompts do not depend on who answers them
    if data.dataset == SELF_DATASET:
        key.update(fp=v.fingerprint, dtype=v.dtype)
    return key


def prompts(data: DataSection, work: Path, v: "Verifier | None" = None) -> dict[str, Any]:
    """Training prompts (train split, evaluation sets excluded) -> ``prompts.jsonl``.

    With ``--dataset self`` the verifier ``v`` writes them (:mod:`draftsmith.data.selfprompts`).
    """
    from draftsmith.data.sources import load_prompts
    from draftsmith.data.selfprompts import SELF_DATASET, write_self_prompts

    skip = data.skip_conversations
    extra: dict[str, Any] = {}
    if data.dataset == SELF_DATASET:
        if v is None:
            raise DraftsmithError("--dataset self needs the verifier to write the prompts")
        convs, counts = write_self_prompts(v.model, v.tokenizer, data.num_conversations,
                                           work / "attempts.jsonl", seed=data.seed, skip=skip,
                                           batch_size=data.batch_size, fingerprint=v.fingerprint)
        extra["self_prompts"] = counts
        say(f"[prompts] the verifier wrote {counts['kept']} prompts in {counts['attempts']} attempts "
            f"({counts['unfinished']} unfinished, {counts['too_short']} too short, {counts['duplicate']} "
            f"duplicates, {counts['eval_overlap']} overlapping evaluation sets); fresh ones for a later "
            f"run: --skip-conversations {counts['next_skip']}")
    else:
        loaded = load_prompts(data.dataset, split="train", limit=skip + data.num_conversations, seed=data.seed)
        convs = loaded[skip:]
        if not convs:
            raise DraftsmithError(f"--skip-conversations {skip} leaves no prompt: the train split of "
                                  f"{data.dataset!r} has {len(loaded)} conversations")
        if len(convs) < data.num_conversations:
            say(f"[prompts] {data.dataset} gives {len(convs)} conversations after {skip} skipped (its train "
                f"split, evaluation sets left out); {data.num_conversations} were asked for")
    path = work / "prompts.jsonl"
    with open(path, "w") as f:
        for c in convs:
            f.write(json.dumps(c.to_record()) + "\n")
    return {"path": str(path), "count": len(convs), "sha": file_digest(path), **extra}


def regenerate(v: Verifier, prompts_path: Path, data: DataSection, work: Path,
               deadline: float | None = None) -> dict[str, Any]:
    """The verifier's own replies to the prompts -> ``regenerated.jsonl`` (resumable); with a ``deadline``
    (``time.perf_counter()``, a budgeted run's) no chunk of prompts starts after it."""
    from draftsmith.data.regenerate import regenerate as _regenerate
    from draftsmith.data.sources import load_prompts

    convs = load_prompts(prompts_path, split="all", exclude_eval=False, dedupe=False)
    cut: dict[str, int] = {}
    kwargs = dict(max_new_tokens=data.max_new_tokens, temperature=data.temperature, batch_size=data.batch_size,
                  max_prompt_tokens=data.max_prompt_tokens, seed=data.seed, fingerprint=v.fingerprint,
                  deadline=deadline, on_stop=lambda kept, left: cut.update(kept=kept, left=left))
    if data.endpoint:
        from draftsmith.data.endpoint import regenerate_via_endpoint

        path = regenerate_via_endpoint(data.endpoint, v.model, v.tokenizer, convs, work / "regenerated.jsonl",
                                       say=lambda m: say(f"[regenerate] {m}"), **kwargs)
    else:
        path = _regenerate(v.model, v.tokenizer, convs, work / "regenerated.jsonl", **kwargs)
    lines = sum(1 for _ in open(path))
    out = {"path": str(path), "count": lines, "sha": file_digest(path)}
    if cut:  # the data time ran out: the budget's rest goes to capture, training and the bench
        out["cut"] = cut
        say(f"[regenerate] the data time is up: {cut['kept']} replies, {cut['left']} prompts left unanswered; the "
            "rest of the budget goes to capture, training and the bench as planned")
    return out


def merge_regenerated(parts: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    """Regeneration results (their files, in order) -> one ``regenerated.jsonl``."""
    path = work / "regenerated.jsonl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for part in parts:
            data = Path(part["path"]).read_bytes()
            f.write(data if not data or data.endswith(b"\n") else data + b"\n")
    tmp.replace(path)
    return {"path": str(path), "count": sum(part["count"] for part in parts), "sha": file_digest(path)}


def capture(v: Verifier, regenerated: Path, data: DataSection, work: Path) -> dict[str, Any]:
    """Hidden states of the verifier over its regenerated conversations -> shards."""
    from draftsmith.data.capture import capture_to_shards
    from draftsmith.data.regenerate import load_regenerated
    from draftsmith.data.shards import read_manifest

    out = capture_to_shards(v.model, v.tokenizer, load_regenerated(regenerated), work / "shards",
                            fingerprint=v.fingerprint, verifier_spec=v.spec, max_length=data.max_length,
                            batch_size=data.capture_batch_size, samples_per_shard=data.samples_per_shard,
                            trim_loops=data.trim_loops)
    manifest = read_manifest(out)
    return {"dir": str(out), "sha": file_digest(out / "manifest.json"),
            "tokens": manifest.get("total_tokens"), "loss_tokens": manifest.get("total_loss_tokens"),
            "aux_layer_ids": manifest.get("aux_layer_ids")}


def run_data_steps(cache: Any, data: DataSection, vd: Verifier, fp: str,
                   top_up: Callable[[dict[str, Any]], int] | None = None,
                   deadline: Callable[[str], float | None] | None = None) -> tuple[dict, dict, dict]:
    """prompts -> regenerate -> capture through ``cache`` (a :class:`StepCache`); the one wiring of the
    data steps, shared by `draftsmith pipeline run` and `draftsmith data`.

    Args:
        cache: the run's step cache.
        data: the data settings.
        vd: the verifier in the data dtype (it answers and is captured).
        fp: the verifier's fingerprint (the cache keys' identity of the model).
        top_up: called with the regeneration's result; the number of further prompts to
            regenerate (the next ones of the dataset, after those asked for) before capture
            (a budgeted run whose regeneration came in under plan, :func:`budget.top_up`).
        deadline: called with the step's name (``regenerate``, ``topup_regenerate``) as a regeneration
            starts; the ``time.perf_counter()`` after which it starts no further chunk of prompts (a
            budgeted run's: :func:`budget.regeneration_seconds`), or None.

    Returns:
        The three steps' results (the prompts' count includes a top-up; the regeneration's
        result is then the merged file; ``cut``, where a deadline stopped a regeneration: its
        ``{"kept", "left"}`` by step name).
    """
    p = cache.run("prompts", prompts_key(data, vd), lambda w: prompts(data, w, vd))
    until = deadline or (lambda step: None)
    r = cache.run("regenerate", {"fp": fp, "prompts": p["sha"], "data": regeneration_key(data)},
                  lambda w: regenerate(vd, Path(p["path"]), data, w, until("regenerate")))
    if "cut" in r:
        r = {**r, "cut": {"regenerate": r["cut"]}}
    extra = top_up(r) if top_up is not None else 0
    if extra:
        more = dataclasses.replace(data, skip_conversations=data.skip_conversations + data.num_conversations,
                                   num_conversations=extra)
        try:
            p2 = cache.run("topup_prompts", prompts_key(more, vd), lambda w: prompts(more, w, vd))
        except DraftsmithError as e:  # the dataset has no more prompts: train on what there is
            say(f"[topup] no further prompts ({e}); going on with {r['count']} conversations")
        else:
            r2 = cache.run("topup_regenerate", {"fp": fp, "prompts": p2["sha"], "data": regeneration_key(more)},
                           lambda w: regenerate(vd, Path(p2["path"]), more, w, until("topup_regenerate")))
            cut = {**r.get("cut", {}), **({"topup_regenerate": r2["cut"]} if "cut" in r2 else {})}
            r = cache.run("topup_merge", {"parts": [r["sha"], r2["sha"]]}, lambda w: merge_regenerated([r, r2], w))
            p = {**p, "count": p["count"] + p2["count"]}
            if cut:
                r = {**r, "cut": cut}
    c = cache.run("capture", {"fp": fp, "regenerated": r["sha"], **capture_key(data), "dtype": vd.dtype},
                  lambda w: capture(vd, Path(r["path"]), data, w))
    return p, r, c


def train(v: Verifier, shards: Path, section: TrainSection, work: Path, num_draft_tokens: int = 5,
          verifier_name: str | None = None) -> dict[str, Any]:
    """Train the draft on the shards (resumable) -> ``train/draft``."""
    from draftsmith.data.shards import read_manifest
    from draftsmith.train.loop import TrainConfig
    from draftsmith.train.loop import train as _train

    cfg = TrainConfig(verifier=v.spec, data=str(shards), out=str(work / "train"),
                      num_draft_tokens=num_draft_tokens, device=v.device,
                      **{f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
    res = _train(cfg, verifier=v.model, fingerprint=v.fingerprint,
                 aux_layer_ids=read_manifest(shards).get("aux_layer_ids"))
    if not (res.draft_dir / "config.json").is_file():
        raise DraftsmithError(f"training finished without a draft in {res.draft_dir}")
    return {"draft_dir": str(res.draft_dir), "sha": file_digest(res.draft_dir / "model.safetensors"),
            "best_val_acceptance_length": res.best_acceptance_length, "steps": res.steps,
            "train_seconds": res.metrics.get("train_seconds"), "summary": res.metrics}


def bench(v: Verifier, drafts: dict[str, Path], section: BenchSection, work: Path,
          progress: bool = True) -> dict[str, Any]:
    """Measure the drafts (label -> dir) against plain decoding on held-out prompts."""
    from draftsmith.bench import BenchConfig, BenchSettings, benchmark
    from draftsmith.bench.measure import bench_prompts
    from draftsmith.drafters import load_draft
    from draftsmith.utils import command_line

    prompt_list, pilot = bench_prompts(section.dataset, v.tokenizer, section.num_prompts,
                                       section.pilot_prompts if section.choose_k else 0)
    if section.choose_k and not pilot:  # after training, a run does not fail over this: it times every k
        say(f"[bench] {section.dataset} has no prompt left after the first {section.num_prompts} for choose_k's "
            f"pilot decode: timing every k of {section.num_draft_tokens} instead")
        section = dataclasses.replace(section, choose_k=False)
    cfg = BenchConfig(verifier=v.spec, out=work, draft=[str(d) for d in drafts.values()], progress=progress,
                      **{f.name: getattr(section, f.name) for f in dataclasses.fields(BenchSettings)})
    proposers = {label: load_draft(d, v.model) for label, d in drafts.items()}
    report = benchmark(v.model, prompt_list, proposers, cfg, work,
                       {"verifier": v.spec, "fingerprint": v.fingerprint, "command": command_line(),
                        "dataset": section.dataset, "drafts": {k: str(p) for k, p in drafts.items()}}, drafts, pilot)
    return {"report": str(work / "report.json"), "summary": summarize_drafter(report, "candidate"),
            "previous": summarize_drafter(report, "previous") if "previous" in drafts else None,
            "by_engine": {e: {"summary": summarize_drafter(report, "candidate", e),
                              "previous": summarize_drafter(report, "previous", e) if "previous" in drafts else None}
                          for e in section.engines}}


def gate_inputs(b: dict[str, Any], engine: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The candidate's and the previous draft's summaries as ``engine`` measured them."""
    mine = (b.get("by_engine") or {}).get(engine) or {"summary": b["summary"], "previous": b.get("previous")}
    return mine["summary"], mine["previous"]


def export_k(cfg: PipelineConfig, measured: dict[str, Any] | None = None) -> int:
    """The draft length k written into the exported draft: ``num_draft_tokens``, else the k the
    gate judged (``measured``: the candidate's bench summary), else the largest k to measure
    (what training writes before the bench has run)."""
    return cfg.num_draft_tokens or (measured or {}).get("k") or max(cfg.bench.num_draft_tokens)


def export_metadata(cfg: PipelineConfig, trained: dict[str, Any], tokens: int | None,
                    bench_summary: dict[str, Any] | None, verdict: dict[str, Any], *, mode: str,
                    report: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The measurements (for the model card) and the provenance written with the exported draft.

    Args:
        cfg: the pipeline configuration.
        trained: :func:`train`'s result (``steps``, ``best_val_acceptance_length``, ``train_seconds``).
        tokens: captured training tokens.
        bench_summary: :func:`draftsmith.gate.summarize_drafter` of the candidate.
        verdict: :func:`gate`'s verdict.
        mode: what ran the pipeline ("pipeline", "refresh", "kubeflow").
        report: where the pipeline's report is.
    """
    metrics = {**(bench_summary or {}), "val_acceptance_length": trained["best_val_acceptance_length"],
               "bench_dataset": cfg.bench.dataset, "bench_prompts": cfg.bench.num_prompts}
    provenance = {"training": {"data": to_dict(cfg.data), "train": to_dict(cfg.train), "tokens": tokens,
                               "steps": trained["steps"], "train_seconds": trained.get("train_seconds")},
                  "gate": verdict, "pipeline_report": report, "mode": mode}
    return metrics, provenance


def export(draft_dir: Path, out_dir: Path, *, verifier_name: str | None, num_draft_tokens: int | None,
           fingerprint: str, metrics: dict[str, Any], provenance: dict[str, Any]) -> dict[str, Any]:
    """Write the deployable draft (speculators format + model card) to ``out_dir``."""
    from draftsmith.export import save_draft
    from draftsmith.models.speculators import read_draft

    draft = read_draft(draft_dir)
    path = save_draft(draft, out_dir, verifier_name=verifier_name, num_draft_tokens=num_draft_tokens,
                      fingerprint=fingerprint, metrics=metrics, provenance=provenance)
    return {"dir": str(path), "sha": file_digest(Path(path) / "model.safetensors")}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
