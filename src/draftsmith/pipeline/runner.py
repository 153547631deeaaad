"""`draftsmith pipeline run` and `draftsmith refresh`: prompts -> ... -> gate -> export.

Every step is cached by a hash of its inputs (see :mod:`draftsmith.pipeline.cache`),
so a re-run with nothing changed does no work and an interrupted run resumes in the
step it stopped in. The verdict and its reasons go to ``OUT/report.json`` and, for
people, ``OUT/report.md`` (:mod:`draftsmith.pipeline.report`); the exit code says it
(0 passed, 3 gate failed, 2 error).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.config import opt, to_dict
from draftsmith.errors import DraftsmithError, GateFailed
from draftsmith.pipeline import budget, steps
from draftsmith.pipeline.cache import StepCache, digest
from draftsmith.pipeline.config import PipelineConfig, build_config
from draftsmith.pipeline.report import write_markdown
from draftsmith.utils import atomic_write_json, command_line, environment_info, resolve_device, resolve_dtype


log = logging.getLogger(__name__)


def _previous_draft(cfg: PipelineConfig, fingerprint: str) -> Path | None:
    """The draft to beat: --previous-draft, else OUT/draft made for this same verifier."""
    from draftsmith.models.speculators import read_provenance

    if cfg.previous_draft:
        p = Path(cfg.previous_draft)
        if not (p / "config.json").is_file():
            raise DraftsmithError(f"previous_draft: {p} is not a draft directory")
        return p
    p = Path(cfg.out) / "draft"
    if (p / "config.json").is_file():
        prov = read_provenance(p) or {}
        if (prov.get("verifier") or {}).get("fingerprint") == fingerprint:
            return p
    return None


def run(cfg: PipelineConfig, *, baseline_draft: Path | None = None, mode: str = "pipeline") -> dict[str, Any]:
    """Run every step; return the report (also written to ``OUT/report.json``).

    Args:
        cfg: the validated configuration.
        baseline_draft: a draft to measure on this verifier before training (refresh's
            drift measurement); it is also the "previous" draft the gate compares with.
        mode: "pipeline" or "refresh" (recorded in the report).
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    v = steps.Verifier(cfg.verifier, cfg.dtype, cfg.device)
    # data is made in its own (often faster) dtype; training and bench use the verifier's own. Where the
    # two resolve to one dtype (bfloat16 both on CUDA, float32 both on a CPU without fast bfloat16), one
    # copy of the weights serves both (an 8B verifier loaded twice would take 32 GB of a GPU).
    dev = resolve_device(cfg.device)
    data_dt = steps.data_dtype(cfg.data.dtype, cfg.device)
    vd = v if resolve_dtype(data_dt, dev) == resolve_dtype(cfg.dtype, dev) else \
        steps.Verifier(cfg.verifier, data_dt, cfg.device)
    cache = StepCache(out / "steps")

    def spent() -> float:
        """Seconds of the budget used: this run's, plus a resumed run's earlier steps' (StepCache.elapsed)."""
        return time.perf_counter() - t0 + (cache.earlier_seconds if cache.count_earlier else 0.0)
    fp = v.fingerprint
    plan = None
    if cfg.budget is not None:
        # Resuming this very budgeted run (its plan is stored): the budget also pays for the
        # steps an earlier attempt finished, so decisions still to make count their time.
        cache.count_earlier = budget.load_plan(out / "plan.json", budget.plan_key(cfg)) is not None
        plan = budget.plan_for(cfg, v, vd, out, say=steps.say)
        steps.say("[plan] " + plan.describe())
        cfg = budget.apply_plan(cfg, plan)
        cache.estimates = dict(plan.predicted_seconds)
        cache.budget_seconds = plan.budget_minutes * 60
    k_export = steps.export_k(cfg)
    report: dict[str, Any] = {"mode": mode, "verifier": cfg.verifier, "verifier_fingerprint": fp,
                              "config": to_dict(cfg), "command": command_line(),
                              "environment": environment_info()}

    previous = baseline_draft or _previous_draft(cfg, fp)
    drift = None
    if baseline_draft is not None:  # refresh: how does the stale draft do on the new verifier?
        b = cache.run("drift", {"fp": fp, "draft": steps.file_digest(baseline_draft / "model.safetensors"),
                                "bench": to_dict(cfg.bench)},
                      lambda w: steps.bench(v, {"candidate": baseline_draft}, cfg.bench, w))
        drift = b["summary"]
        report["before"] = drift

    top_up = None
    if plan is not None:
        def top_up(r: dict[str, Any]) -> int:
            timing = cache.timings.get("regenerate", {})
            def reprice() -> dict[str, float]:
                from draftsmith.data.regenerate import load_regenerated

                replied = load_regenerated(Path(r["path"]))[:cfg.data.capture_batch_size]
                capture, train = budget.capture_and_train_prices(vd, v, replied, cfg.data, cfg.train,
                                                                 out / "calibration")
                return {"capture_per_token": capture, "train_per_position": train,
                        "decode_per_token": budget.decode_price(v, cfg.bench)}

            decision = budget.top_up(cfg, plan, Path(r["path"]), None if timing.get("cached") else
                                     timing.get("seconds"), spent(), out, reprice)
            report["top_up"] = decision
            if "bench_seconds" in decision:
                cache.estimates["bench"] = decision["bench_seconds"]
            if decision["prompts"]:
                cache.estimates["topup_regenerate"] = decision["predicted_seconds"]
                steps.say(f"[topup] the replies hold {decision['tokens']} tokens ({decision['conversations']} "
                          f"conversations); {decision['spare_seconds'] / 60:.1f} min of the budget are spare: "
                          f"regenerating {decision['prompts']} more prompts")
            return decision["prompts"]

    deadline = None
    if plan is not None:
        def deadline(step: str) -> float:
            seconds = budget.regeneration_seconds(plan, spent(), step, cache.estimates.get(step))
            steps.say(f"[{step}] no new chunk of prompts starts after {max(seconds, 0.0) / 60:.1f} min (capture, "
                      "training and the bench keep their time)")
            return time.perf_counter() + seconds

    p, r, c = steps.run_data_steps(cache, cfg.data, vd, fp, top_up, deadline)
    if plan is not None:
        cfg = budget.fit_training(cfg, plan, c.get("tokens") or 0, spent(), out)
        cache.estimates["train"] = cfg.train.max_minutes * 60 / 1.15
    train_inputs = {"fp": fp, "shards": c["sha"], "train": to_dict(cfg.train), "k": k_export}
    if cfg.train.init_from:
        train_inputs["init"] = steps.file_digest(Path(cfg.train.init_from) / "model.safetensors")
    t = cache.run("train", train_inputs,
                  lambda w: steps.train(v, Path(c["dir"]), cfg.train, w, k_export, cfg.verifier_name))
    if previous is not None and steps.file_digest(previous / "model.safetensors") == t["sha"]:
        previous = None  # the deployed draft is this very candidate (a re-run with nothing changed)
    drafts = {"candidate": Path(t["draft_dir"])}
    if previous is not None:
        drafts["previous"] = previous
    bench_inputs = {"fp": fp, "candidate": t["sha"], "bench": to_dict(cfg.bench),
                    "previous": steps.file_digest(previous / "model.safetensors") if previous else None}
    b = cache.run("bench", bench_inputs, lambda w: steps.bench(v, drafts, cfg.bench, w))
    verdict = steps.gate(*steps.gate_inputs(b, cfg.gate.engine), cfg.gate)

    k_export = steps.export_k(cfg, steps.gate_inputs(b, cfg.gate.engine)[0])  # the k the gate judged
    metrics, provenance = steps.export_metadata(cfg, t, c.get("tokens"), b["summary"], verdict, mode=mode,
                                                report=str(out / "report.json"))
    e = cache.run("export", {"draft": t["sha"], "bench": digest(b), "gate": verdict, "k": k_export,
                             "name": cfg.verifier_name},
                  lambda w: steps.export(Path(t["draft_dir"]), w / "draft", verifier_name=cfg.verifier_name,
                                         num_draft_tokens=k_export, fingerprint=fp, metrics=metrics,
                                         provenance=provenance))
    candidate_dir = Path(e["dir"])
    deployed = out / "draft"
    if verdict["passed"] and candidate_dir.resolve() != deployed.resolve():
        tmp = out / ".draft.new"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(candidate_dir, tmp)
        if deployed.exists():
            shutil.rmtree(deployed)
        tmp.rename(deployed)

    report.update({
        "steps": cache.timings, "seconds": time.perf_counter() - t0,
        "seconds_with_earlier_attempts": spent() if cache.count_earlier else None,
        "data": {"prompts": p["count"], "regenerated": r["count"], "tokens": c.get("tokens"),
                 "regeneration_cut": r.get("cut")},
        "train": {**{k: t[k] for k in ("steps", "best_val_acceptance_length", "train_seconds")},
                  "plot": (t.get("summary") or {}).get("plot")},
        "bench": {"report": b["report"], "candidate": b["summary"], "previous": b.get("previous")},
        "gate": verdict, "candidate_draft": str(candidate_dir),
        "deployed_draft": str(deployed) if verdict["passed"] else None,
    })
    report["config"] = to_dict(cfg)  # as run: a budget's plan sets data, training and bench sizes
    if plan is not None:
        actual = {name: cache.timings.get(name, {}).get("seconds") for name in plan.predicted_seconds}
        for name in ("topup_prompts", "topup_regenerate", "topup_merge"):
            if name in cache.timings:
                actual[name] = cache.timings[name]["seconds"]
        curve = budget.extrapolate(Path(cache.timings["train"]["dir"]) / "train" / "metrics.jsonl")
        report["plan"] = {**dataclasses.asdict(plan), "actual_seconds": actual, "top_up": report.pop("top_up", None),
                          "train_cut": t["summary"].get("cut"), "train_fits": t["summary"].get("fits"),
                          "learning_curve": curve, "bigger_budget": budget.bigger_budget_line(curve, cfg.budget)}
    if drift is not None:
        report["after"] = b["summary"]
    atomic_write_json(out / "report.json", report)
    try:
        write_markdown(report, out)
    except Exception as e:  # noqa: BLE001 -- report.json holds everything; the run is done
        log.warning("could not write %s: %s", out / "report.md", e)
    return report


def verdict_line(report: dict[str, Any]) -> str:
    g = report["gate"]
    s = g.get("speedup")
    head = "PASS" if g["passed"] else "FAIL"
    measured = (f"measured speedup {s:.2f}x at k={g.get('k')}, acceptance length {g['acceptance_length']:.2f}"
                if s is not None else "not measured")
    where = f" -> deployable draft: {report['deployed_draft']}" if g["passed"] else ""
    return f"{head}: {measured}. {'; '.join(g['reasons'])}{where}"


def _finish(report: dict[str, Any], out: Path) -> int:
    print(f"report: {out / 'report.md'} ({out / 'report.json'}; bench details: "
          f"{Path(report['bench']['report']).with_suffix('.md')})")
    if "before" in report:
        b, a = report["before"], report.get("after")
        if b and a:
            drafted = [x.get("drafted_fraction") for x in (b, a)]
            print(f"refresh: acceptance length {b['acceptance_length']:.2f} -> {a['acceptance_length']:.2f}"
                  + (f" (over the rounds that drafted: {100 * drafted[0]:.0f}% -> {100 * drafted[1]:.0f}%)"
                     if None not in drafted and min(drafted) < 1 else "")
                  + f", speedup {b['speedup']:.2f}x -> {a['speedup']:.2f}x")
    print(verdict_line(report))
    plan = report.get("plan")
    if plan:
        cut = plan.get("train_cut")
        earlier = report.get("seconds_with_earlier_attempts")
        print(f"budget: {plan['budget_minutes']:g} min, this run {report['seconds'] / 60:.1f} min"
              + (f" ({earlier / 60:.1f} min with the steps an earlier attempt finished)" if earlier else "")
              + (f"; training stopped at step {cut['step']} of {cut['planned_steps']} ({cut['reason']})" if cut else ""))
        print(plan["bigger_budget"])
    if not report["gate"]["passed"]:
        draft = report.get("candidate_draft")
        if draft:  # not published to OUT/draft; still worth measuring elsewhere
            verifier = (report.get("config") or {}).get("verifier") or "VERIFIER"
            print(f"the draft the gate judged (not published): {draft}; measure it with other settings, e.g. "
                  f"compiled steps: draftsmith bench --verifier {verifier} --draft {draft} --compile "
                  f"--out {Path(out) / 'bench-compiled'}")
        raise GateFailed("; ".join(report["gate"]["reasons"]))
    return 0


# ----------------------------------------------------------------------------- CLI entries
@dataclass
class PipelineRunConfig:
    """Run the whole pipeline: prompts -> regenerate -> capture -> vocab -> train -> bench -> gate -> export.

    With no arguments it runs the embedded default (SmolLM2-135M, the `small` preset).
    Steps are cached by their inputs: re-running with nothing changed does no work, and
    an interrupted run resumes in the step it stopped in. The run ends with OUT/report.md
    (verdict, step times, training curves, the bench's numbers) and OUT/report.json.
    Exit code: 0 gate passed, 3 gate failed, 2 error.
    """

    config: str | None = opt(None, "YAML file with the pipeline configuration (sections: data, train, bench, gate)",
                             positional=True, metavar="CONFIG.yaml")
    verifier: str | None = opt(None, "verifier (overrides the file; default smollm2-135m)")
    preset: str | None = opt(None, "budget preset: tiny, small (default), full")
    out: str | None = opt(None, "output directory (default runs/demo)")
    budget: float | None = opt(None, "minutes the run may take on this machine (default: the small preset's "
                                     "20); the first seconds measure this machine and size data, training and "
                                     "bench to fit")


def run_pipeline_cli(args: PipelineRunConfig) -> int:
    cfg = build_config(args.config, {"verifier": args.verifier, "preset": args.preset, "out": args.out,
                                     "budget": args.budget})
    return _finish(run(cfg), Path(cfg.out))


@dataclass
class RefreshConfig:
    """Refresh a draft after the verifier changed: measure the stale draft on the new verifier
    (drift), retrain warm-started from it, gate, and report before/after side by side."""

    verifier: str = opt(help="the NEW verifier: HF dir, .gguf file or alias")
    draft: str = opt(help="the OLD draft directory (speculators format)")
    out: str = opt("runs/refresh", "output directory")
    config: str | None = opt(None, "YAML pipeline configuration (data/train/bench/gate sections)")
    preset: str | None = opt(None, "budget preset: tiny, small (default), full")
    epochs: float | None = opt(None, "training epochs of the warm start (default: a third of the preset's)")


def refresh(cfg: RefreshConfig) -> dict[str, Any]:
    old = Path(cfg.draft)
    if not (old / "config.json").is_file():
        raise DraftsmithError(f"--draft {old}: not a draft directory (no config.json)")
    pc = build_config(cfg.config, {"verifier": cfg.verifier, "preset": cfg.preset, "out": cfg.out})
    epochs = cfg.epochs if cfg.epochs is not None else max(1.0, pc.train.epochs / 3)
    pc = dataclasses.replace(pc, train=dataclasses.replace(pc.train, init_from=str(old), epochs=epochs))
    return run(pc, baseline_draft=old, mode="refresh")


def refresh_cli(cfg: RefreshConfig) -> int:
    return _finish(refresh(cfg), Path(cfg.out))
