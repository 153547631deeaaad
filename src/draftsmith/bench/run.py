"""`draftsmith bench`: its configuration, and one function that measures and writes the report."""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from draftsmith.bench.measure import (LAYOUT_TIE, BenchState, Row, apply_draft_confidence, bench_prompts, build_rows,
                                      choose_ks, choose_weight_layout, engine_rows, judge_outputs, judge_quality,
                                      measure_costs, measure_interleaved, parse_confidence, precision_label,
                                      quantized_rows)
from draftsmith.bench import resume
from draftsmith.bench.report import build_report, render_markdown, write_report
from draftsmith.config import opt
from draftsmith.decoding.proposers import Eagle3Proposer, Proposer
from draftsmith.decoding.runner import shared_aux_layers, shared_aux_outputs
from draftsmith.drafters import DRAFTER_HELP
from draftsmith.engines import ENGINES, OURS
from draftsmith.errors import DraftsmithError, interruption
from draftsmith.models.quantize import DRAFT_PRECISIONS, QUANTIZATIONS, quantize_draft
from draftsmith.models.verifier import WEIGHT_LAYOUTS, weight_layouts

log = logging.getLogger(__name__)

EVAL_DATASETS = ("mt-bench", "humaneval")
#: ``--weight-layout`` choices: ``auto`` (the bench times the candidates and picks one) or a layout
BENCH_LAYOUTS = ("auto", *WEIGHT_LAYOUTS)


@dataclass
class BenchSettings:
    """What to measure and how: the pipeline's ``bench`` section and `draftsmith bench`'s options."""

    dataset: str = opt("mt-bench", "held-out eval prompts: mt-bench (first turns), humaneval, or a JSONL file")
    num_prompts: int = opt(20, "number of prompts (the first N of the dataset)")
    max_new_tokens: int = opt(128, "new tokens per prompt")
    num_draft_tokens: list[int] = opt(default_factory=lambda: [3, 5],
                                      help="k, tokens drafted per round; several values are swept (the gate "
                                           "then chooses k on half of the prompts and judges it on the rest), "
                                           "or with --choose-k the cost model picks one before timing")
    choose_k: bool = opt(False, "time each drafter at one k only: the k of --num-draft-tokens whose predicted "
                                "speedup is best, from this machine's measured step costs and a pilot decode at "
                                "the largest k (acceptance per position) on --pilot-prompts held-out prompts that "
                                "are neither timed nor judged; the bench then spends its time on that k")
    pilot_prompts: int = opt(2, "prompts of --choose-k's pilot decode: the dataset's last ones, never among the "
                                "timed and judged first --num-prompts; the choice is as good as they are typical "
                                "(raise it, or time every k, for a drafter whose acceptance swings from prompt to "
                                "prompt, like n-gram lookup)")
    temperature: float = opt(0.0, "0 = greedy (outputs must equal plain decoding, up to numerical ties); "
                                  "> 0 samples")
    repeats: int = opt(1, "timed passes over all prompts (per-prompt median is used)")
    warmup_tokens: int = opt(32, "new tokens of the untimed warm-up run of every row")
    hf_reference: bool = opt(True, "also measure HF transformers generate and HF prompt lookup")
    hf_lookup_tokens: int | None = opt(None, "HF prompt_lookup_num_tokens (default: the largest k)")
    target_speedup: float = opt(1.0, "speedup a drafter should reach; the report explains a miss")
    bootstrap: int = opt(2000, "bootstrap resamples for the speedup confidence interval")
    seed: int = opt(0, "seed for sampling and the bootstrap")
    threads: int | None = opt(None, "torch CPU threads (default: torch's choice); pin it on a shared machine")
    engines: list[str] = opt(default_factory=lambda: [OURS],
                             help=f"where to measure the EAGLE-3 drafts, side by side: {', '.join(ENGINES)} "
                                  "(vllm and llama.cpp are started as real servers on 127.0.0.1; greedy only)")
    weight_layout: Literal["auto", "out-in", "in-out", "onednn", "cpp"] = opt(
        "auto", "how the verifier's and drafts' Linear weights are held and multiplied while measuring: "
                "auto (the default: before anything is timed, the verifier's one-token and verify steps are "
                "timed as loaded and, on a CPU, through oneDNN and through draftsmith's few-row kernel; the "
                "layout whose one-token step (plain "
                f"decoding, the baseline) is fastest, within {LAYOUT_TIE:.0%}, wins, and among those the one with "
                "the cheapest verify steps; the report says which and why); out-in (as loaded); in-out "
                "(transposed in memory: float32 CPU verify steps of 4+ tokens, k >= 3, avoid MKL's GEMM cliff, "
                "~15% cheaper on Intel; 2 tokens ~4% dearer; the weights are held twice meanwhile); onednn "
                "(CPU: oneDNN's matmul instead of MKL's float32 GEMM, on the same weights; on AMD EPYC a "
                "one-token step ~0.9x, a verify step of 2-6 tokens 1.16-1.28x a one-token step instead of "
                "1.4-2.2x); cpp (CPU, float32: draftsmith's few-row C++ kernel for steps of up to 16 tokens, a "
                "prefill on MKL's GEMM; built on first use, ~25 s once; on AMD EPYC a one-token step ~0.7x "
                "oneDNN's, and a row's result does not depend on how many tokens the step has). Results differ "
                "between layouts by rounding; every row of a run uses the same one")
    quantize: list[str] = opt(default_factory=list,
                              help="also measure the verifier quantized, plainly and with each drafter: "
                                   + "; ".join(f"{k} ({v[1]})" for k, v in QUANTIZATIONS.items())
                                   + ". Faster, not lossless: the report says what it changes")
    compile: bool = opt(False, "decode our engine's rows (plain and every drafter) with compiled steps "
                               "(torch.compile; CUDA graphs on CUDA; on CPU frozen weights through inductor's C++ GEMM "
                               "kernel, a second copy of the weights in memory), step costs included; compile time is kept "
                               "out of the timings and reported apart; HF rows run as users run them (eager)")
    draft_precision: list[str] = opt(
        default_factory=lambda: ["as-loaded"],
        help="precision(s) of the EAGLE-3 drafts in our engine, side by side: "
             + "; ".join(f"{k} ({v})" for k, v in DRAFT_PRECISIONS.items())
             + ". The first keeps the draft's label; the others are measured as LABEL@PRECISION")
    draft_confidence: list[str] = opt(
        default_factory=lambda: ["auto"],
        help="when an EAGLE-3 draft in our engine stops drafting early, side by side: auto (the default: a "
             "token is proposed only while the draft's probability that all its tokens so far pass is at least "
             "what verifying it costs, (T_verify(i+1) - T_verify(i) + one draft step) / T(1), from this "
             "machine's step prices measured before timing; near 0 where verifying more tokens is nearly free); "
             "off (always k tokens); or a number in [0, 1] (that cumulative confidence at every position). "
             "Output is unchanged. The first keeps the draft's label; the others are measured as LABEL~VALUE. "
             "Serving engines (--engines) draft every token, so off is added where they are measured: their "
             "acceptance is compared with our off rows")

    def __post_init__(self) -> None:
        bad_q = [q for q in self.quantize if q not in QUANTIZATIONS]
        if bad_q:
            raise DraftsmithError(f"--quantize: expected some of {list(QUANTIZATIONS)}, got {self.quantize}")
        self.quantize = list(dict.fromkeys(self.quantize))
        bad_p = [p for p in self.draft_precision if p not in DRAFT_PRECISIONS]
        if bad_p or not self.draft_precision:
            raise DraftsmithError(f"--draft-precision: expected some of {list(DRAFT_PRECISIONS)}, "
                                  f"got {self.draft_precision}")
        self.draft_precision = list(dict.fromkeys(self.draft_precision))
        if not self.draft_confidence:
            raise DraftsmithError("--draft-confidence: give at least one of auto, off or a number in [0, 1]")
        self.draft_confidence = list(dict.fromkeys(parse_confidence(c) for c in self.draft_confidence))
        if self.quantize and OURS not in self.engines:
            raise DraftsmithError(f"--quantize: quantized rows are measured in {OURS}'s engine; add it to --engines")
        bad = [e for e in self.engines if e not in ENGINES]
        if bad or not self.engines:
            raise DraftsmithError(f"--engines: expected some of {list(ENGINES)}, got {self.engines}")
        self.engines = list(dict.fromkeys(self.engines))
        if any(e != OURS for e in self.engines) and "off" not in self.draft_confidence:
            # serving engines draft every token: our off rows are what their acceptance is compared with
            self.draft_confidence.append("off")
        if self.temperature > 0 and self.engines != [OURS]:
            raise DraftsmithError("--engines: serving engines are measured greedy (--temperature 0) only")
        if self.dataset == "self":
            raise DraftsmithError("--dataset: 'self' writes training prompts; measure on held-out prompts "
                                  "(mt-bench, humaneval or a JSONL file)")
        if self.dataset not in EVAL_DATASETS and not Path(self.dataset).is_file():
            raise DraftsmithError(f"--dataset {self.dataset!r}: expected one of {list(EVAL_DATASETS)} "
                                  "or an existing JSONL file (measure on held-out prompts)")
        if self.seed < 0:
            raise DraftsmithError(f"--seed must be >= 0, got {self.seed}")
        for name in ("num_prompts", "max_new_tokens", "repeats", "warmup_tokens", "bootstrap", "pilot_prompts"):
            if getattr(self, name) < 1:
                raise DraftsmithError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.num_draft_tokens or min(self.num_draft_tokens) < 1:
            raise DraftsmithError(f"--num-draft-tokens must be integers >= 1, got {self.num_draft_tokens}")
        self.num_draft_tokens = sorted(set(self.num_draft_tokens))
        if self.hf_lookup_tokens is not None and self.hf_lookup_tokens < 1:
            raise DraftsmithError(f"--hf-lookup-tokens must be >= 1, got {self.hf_lookup_tokens}")
        if self.temperature < 0:
            raise DraftsmithError(f"--temperature must be >= 0, got {self.temperature}")
        if self.threads is not None and self.threads < 1:
            raise DraftsmithError(f"--threads must be >= 1, got {self.threads}")
        if self.weight_layout not in BENCH_LAYOUTS:
            raise DraftsmithError(f"--weight-layout: expected one of {list(BENCH_LAYOUTS)}, "
                                  f"got {self.weight_layout!r}")
        if self.target_speedup <= 0:
            raise DraftsmithError(f"--target-speedup must be > 0, got {self.target_speedup}")


@dataclass(kw_only=True)
class BenchConfig(BenchSettings):
    """Measure drafters against plain decoding: speedup, acceptance, break-even; write a report."""

    verifier: str = opt(help="verifier: HF model dir, .gguf file, or alias (smollm2-135m)")
    out: Path = opt(help="output directory for report.json, report.md and plots")
    drafter: list[str] = opt(default_factory=list, help=f"drafter(s) to measure, repeatable: {DRAFTER_HELP}")
    draft: list[str] = opt(default_factory=list, help="EAGLE-3 draft directory(ies) to measure, repeatable")
    dtype: str = opt("auto", "model dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    device: str = opt("auto", "device: auto, cpu, cuda, cuda:N")
    progress: bool = opt(True, "show a progress bar")
    resume: bool = opt(True, "continue an interrupted bench in --out where it stopped: its step costs, chosen k, "
                             "thresholds and weight layout, and every prompt all rows had timed, are kept, and the "
                             "timing goes on from the next prompt; only with the same settings, prompts, verifier, "
                             "drafts, machine and versions (otherwise it starts afresh and says what differs). "
                             "A larger --num-prompts or --repeats extends the bench in --out, finished or not, "
                             "timing only the prompts it lacks (an interval too wide: add prompts); the same "
                             "finished bench again measures afresh. --no-resume times everything again")

    def __post_init__(self) -> None:
        if not self.drafter and not self.draft:
            raise DraftsmithError("give at least one --drafter or --draft to measure")
        for d in self.draft:
            if not Path(d).is_dir():
                raise DraftsmithError(f"--draft {d!r}: not a directory")
        super().__post_init__()


def benchmark(model: torch.nn.Module, prompts: list[tuple[str, list[int]]], proposers: dict[str, Proposer],
              cfg: BenchConfig, out_dir: Path, provenance: dict[str, Any] | None = None,
              draft_dirs: dict[str, Path] | None = None,
              pilot: list[tuple[str, list[int]]] | None = None) -> dict[str, Any]:
    """Measure every row and write the report (partial on Ctrl-C, which is re-raised).

    Args:
        model: the verifier.
        prompts: ``(id, token ids)`` eval prompts.
        proposers: drafter label -> proposer.
        cfg: run settings (k sweep, repeats, temperature, ...).
        out_dir: where report.json, report.md and the plots go.
        provenance: verifier spec and fingerprint, command line, dataset name.
        draft_dirs: label -> speculators draft directory, for the serving engines of
            ``cfg.engines`` (each is started plainly and with each draft at each k).
        pilot: ``cfg.choose_k``'s pilot prompts (:func:`bench_prompts`), never timed or judged.

    Returns:
        The report as written to ``report.json``.
    """
    # compiled: the plain rows and the step table run the drafts' compiled graphs (one compile, not two)
    shared = shared_aux_outputs(model, drafts_aux(proposers)) if cfg.compile else contextlib.nullcontext()
    with shared, contextlib.ExitStack() as servers:  # every engine server is stopped on the way out, whatever happens
        return _benchmark(model, prompts, proposers, cfg, out_dir, provenance, draft_dirs or {}, servers, pilot or [])


def _benchmark(model: torch.nn.Module, prompts: list[tuple[str, list[int]]], proposers: dict[str, Proposer],
               cfg: BenchConfig, out_dir: Path, provenance: dict[str, Any] | None, draft_dirs: dict[str, Path],
               servers: contextlib.ExitStack, pilot: list[tuple[str, list[int]]]) -> dict[str, Any]:
    checkpoint = resume.Checkpoint(out_dir, resume.identity(cfg, provenance or {}, prompts, pilot, proposers, model))
    saved = checkpoint.load() if cfg.resume else None
    if not cfg.resume:
        checkpoint.remove()  # --no-resume: an interruption of this bench must not bring the old timings back
    proposers, confidence = with_draft_confidences(with_draft_precisions(proposers, cfg.draft_precision),
                                                   cfg.draft_confidence)
    layout, layout_choice = cfg.weight_layout, None
    if saved is not None:
        layout, layout_choice = resume.layout_of(saved)
        resized = saved.get("resized")
        what = "" if resized is None else (
            f" (it was {'finished' if resized['complete'] else 'interrupted'}, "
            f"{resized['prompts'][0]} prompts x {resized['repeats'][0]} repeat(s), now {len(prompts)} x {cfg.repeats})")
        print(f"bench: {'extending' if resized else 'resuming'} the {'' if resized else 'interrupted '}bench in "
              f"{out_dir}{what}: its step costs and its first {saved['units_done']} of {cfg.repeats * len(prompts)} "
              "prompt passes, timed by every row, are kept (--no-resume times everything again)", file=sys.stderr)
    elif layout == "auto":
        if cfg.progress:
            print("bench: choosing the weight layout (--weight-layout auto): timing the verifier's steps ...",
                  file=sys.stderr)
        layout_choice = choose_weight_layout(model, prompts[0][1], cfg.num_draft_tokens, cfg.max_new_tokens,
                                             compiled=cfg.compile)
        layout = layout_choice["layout"]
    checkpoint.layout, checkpoint.layout_choice = layout, layout_choice
    # the EAGLE-3 drafts' weights are held as the verifier's, so draft and verifier steps stay comparable
    drafts = [p.draft for p in proposers.values() if isinstance(getattr(p, "draft", None), torch.nn.Module)]

    pre = None
    if cfg.choose_k and proposers and saved is None:
        if not pilot:
            raise DraftsmithError("--choose-k: no pilot prompts (the dataset has no prompt left after the first "
                                  "--num-prompts); lower --num-prompts or leave --choose-k off")
        pre = BenchState([Row("plain (ours)", "plain", model, compile=cfg.compile)], prompts)
        with weight_layouts([model, *drafts], layout):
            if cfg.progress:
                print(f"bench: measuring step costs and a pilot decode on {len(pilot)} prompt(s) to choose k ...",
                      file=sys.stderr)
            measure_costs(pre, proposers, cfg.num_draft_tokens, cfg.max_new_tokens, cfg.temperature, cfg.seed,
                          cfg.compile)
            apply_draft_confidence(pre, proposers, confidence, cfg.num_draft_tokens)
            pre.k_choice = choose_ks(pre, proposers, cfg.num_draft_tokens, pilot, cfg.max_new_tokens,
                                     cfg.temperature, cfg.seed, cfg.compile)
    k_choice = saved["k_choice"] if saved is not None else pre.k_choice if pre else {}
    chosen = {name: c["k"] for name, c in k_choice.items()}
    rows = build_rows(model, proposers, cfg.num_draft_tokens, cfg.hf_reference, cfg.hf_lookup_tokens, cfg.compile,
                      chosen)
    if OURS not in cfg.engines:
        rows = rows[:1]  # our plain row stays: the verdicts and the cost model rest on it
    rows += quantized_rows(model, proposers, cfg.num_draft_tokens, cfg.quantize, chosen)
    rows += engine_rows(servers, cfg.engines, model, cfg.verifier, draft_dirs, cfg.num_draft_tokens,
                        Path(out_dir) / "engine-logs", cfg.threads, cfg.draft_precision, chosen)
    state = BenchState(rows, prompts)
    checkpoint.engines = resume.engines_identity(rows)
    start_unit = 0
    if saved is not None:  # the costs, k choice and stop rules of the interrupted bench, and its timed prompts
        resume.restore_costs(state, saved)
        resume.restore_confidence(proposers, state.draft_confidence)
        same_engines = saved.get("engines", {}) == checkpoint.engines
        if not same_engines:
            print("bench: the serving engines are not those the interrupted bench timed (version or program: "
                  + ", ".join(sorted(set(saved.get("engines", {})) | set(checkpoint.engines))) + "); its step costs "
                  "are kept, every prompt is timed again", file=sys.stderr)
        try:
            start_unit = resume.restore_results(state, saved, keep_units=same_engines)
        except ValueError as e:
            raise DraftsmithError(f"{checkpoint.path}: cannot resume: {e}; run with --no-resume") from e
    elif pre is not None:  # the costs measured for the choice are the bench's, and its clock started with them
        for name in ("costs", "plain_steps", "verify_steps", "draft_per_call", "draft_fit", "costs_compile_seconds",
                     "k_choice", "draft_confidence", "started", "attempt_started", "load_at_start"):
            setattr(state, name, getattr(pre, name))
    state.layout_choice = layout_choice
    param = next(model.parameters())
    provenance = {**(provenance or {}), "dtype": str(param.dtype).removeprefix("torch."), "device": str(param.device),
                  "weight_layout": layout, "weight_layout_asked": cfg.weight_layout,
                  "draft_precision": cfg.draft_precision, "compile": cfg.compile,
                  # compiled: the aux layers whose graphs the plain rows and the step table ran (dropping them)
                  "compile_shared_aux": list(shared_aux_layers(model))}
    # every row decodes inside the block (the quantized rows hold their own copies, made above)
    with weight_layouts([model, *drafts], layout):
        return _measure(state, model, proposers, cfg, out_dir, provenance, confidence, checkpoint, start_unit)


def drafts_aux(proposers: dict[str, Proposer]) -> tuple[int, ...]:
    """The aux layers the proposers that read the verifier's hidden states read most often (ties:
    the first seen); ``()`` when none does."""
    wanted = [tuple(p.aux_layer_ids) for p in proposers.values() if p.requires_hidden_states]
    return max(wanted, key=wanted.count) if wanted else ()


def with_draft_confidences(proposers: dict[str, Proposer],
                           settings: list[str]) -> tuple[dict[str, Proposer], dict[str, str]]:
    """Each EAGLE-3 proposer at each ``--draft-confidence`` setting: the first keeps its label and
    object, the others come as ``LABEL~SETTING`` (a proposer of their own on the same draft); other
    proposers pass through. Returns the proposers, drafting every token until
    :func:`apply_draft_confidence` gives them their rule, and label -> setting."""
    out: dict[str, Proposer] = {}
    chosen: dict[str, str] = {}
    for label, prop in proposers.items():
        if not isinstance(prop, Eagle3Proposer):
            out[label] = prop
            continue
        for i, setting in enumerate(settings):
            name = label if i == 0 else f"{label}~{setting}"
            out[name] = prop if i == 0 else Eagle3Proposer(prop.draft)
            out[name].min_confidence = 0.0  # the step costs are measured drafting every token
            chosen[name] = setting
    return out, chosen


def with_draft_precisions(proposers: dict[str, Proposer], precisions: list[str]) -> dict[str, Proposer]:
    """Each EAGLE-3 proposer at each of ``precisions``: the first keeps its label (and object when
    ``as-loaded``), the others come as ``LABEL@PRECISION``; other proposers pass through."""
    out: dict[str, Proposer] = {}
    for label, prop in proposers.items():
        if not isinstance(prop, Eagle3Proposer):
            out[label] = prop
            continue
        for precision in precisions:
            draft = quantize_draft(prop.draft, precision)
            out[precision_label(label, precisions, precision)] = prop if draft is prop.draft else Eagle3Proposer(draft)
    return out


def _measure(state: BenchState, model: torch.nn.Module, proposers: dict[str, Proposer], cfg: BenchConfig,
             out_dir: Path, provenance: dict[str, Any], confidence: dict[str, str], checkpoint: resume.Checkpoint,
             start_unit: int) -> dict[str, Any]:
    try:
        if state.costs is None:  # (measured already where --choose-k chose k with them, or a resumed bench did)
            if cfg.progress:
                print("bench: measuring verifier and draft step costs ...", file=sys.stderr)
            measure_costs(state, proposers, cfg.num_draft_tokens, cfg.max_new_tokens, cfg.temperature, cfg.seed,
                          cfg.compile)
            apply_draft_confidence(state, proposers, confidence, cfg.num_draft_tokens)
        checkpoint.start(state, start_unit)
        measure_interleaved(state, cfg.max_new_tokens, cfg.temperature, cfg.repeats, cfg.seed,
                            progress=cfg.progress, warmup_tokens=cfg.warmup_tokens, start_unit=start_unit,
                            on_unit=lambda units: checkpoint.add_unit(state, units))
        if cfg.temperature == 0:
            judge_outputs(state, model)
        judge_quality(state, model, greedy=cfg.temperature == 0)
    except KeyboardInterrupt as e:
        state.partial, state.note = True, interruption(e)
        write_report(build_report(state, cfg, provenance), out_dir)
        e.partial_report = out_dir / "report.md"  # type: ignore[attr-defined]
        raise
    except Exception as e:  # a server that died, memory, a bug: what was timed is reported, then the error
        if state.results:
            state.partial, state.note = True, f"stopped by an error ({type(e).__name__}: {e})"
            try:
                write_report(build_report(state, cfg, provenance), out_dir)
                e.partial_report = out_dir / "report.md"  # type: ignore[attr-defined]
            except Exception as report_error:  # noqa: BLE001 -- the first error is the one to see
                log.warning("bench: no partial report after the error: %s", report_error)
        raise
    report = build_report(state, cfg, provenance)
    write_report(report, out_dir)
    checkpoint.finish(state)  # complete: the same bench again measures afresh, one of more prompts extends it
    return report


def run_bench(cfg: BenchConfig) -> int:
    """CLI entry: load the verifier, prompts and drafters, measure, write the report."""
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run_bench(cfg)
    finally:  # a library call does not leave the process on its --threads
        torch.set_num_threads(threads)


def _continue_hint(cfg: BenchConfig, when: str = "") -> str:
    """How an interrupted bench in ``cfg.out`` continues, where its checkpoint was kept."""
    if not resume.interrupted(Path(cfg.out)):
        return ""
    how = "the same command" if cfg.resume else "the same command without --no-resume"
    return f"; {when + ', ' if when else ''}{how} continues where it stopped"


def _run_bench(cfg: BenchConfig) -> int:
    from draftsmith.drafters import build_proposer
    from draftsmith.models.verifier import load_verifier
    from draftsmith.utils import command_line

    model, tokenizer, fp = load_verifier(cfg.verifier, dtype=cfg.dtype, device=cfg.device)
    prompts, pilot = bench_prompts(cfg.dataset, tokenizer, cfg.num_prompts, cfg.pilot_prompts if cfg.choose_k else 0)
    if len(prompts) < cfg.num_prompts:
        print(f"bench: {cfg.dataset} holds {len(prompts)} usable prompts; measuring those {len(prompts)} "
              f"(--num-prompts {cfg.num_prompts} asked for more)", file=sys.stderr)
    proposers: dict[str, Proposer] = {}
    for spec in cfg.drafter:
        proposers[spec] = build_proposer(spec, model, tokenizer, dtype=cfg.dtype)
    draft_dirs = {f"eagle3:{Path(d).name}": Path(d) for d in cfg.draft}
    for label, d in draft_dirs.items():
        proposers[label] = build_proposer(str(d), model, tokenizer, dtype=cfg.dtype)
    asked = [p for p in cfg.draft_precision if p != "as-loaded"]
    if asked and not any(isinstance(p, Eagle3Proposer) for p in proposers.values()):
        raise DraftsmithError(f"--draft-precision {' '.join(asked)} applies to EAGLE-3 drafts, and none is "
                              "measured here: add one (--draft DIR) or drop the flag")
    provenance = {"verifier": cfg.verifier, "fingerprint": fp, "command": command_line(), "dataset": cfg.dataset}
    try:
        report = benchmark(model, prompts, proposers, cfg, Path(cfg.out), provenance, draft_dirs, pilot)
    except KeyboardInterrupt as e:
        written = getattr(e, "partial_report", None)
        print((f"bench: partial report written to {written}" if written else
               "bench: stopped before its timed runs; no report written") + _continue_hint(cfg), file=sys.stderr)
        raise
    except Exception as e:
        written = getattr(e, "partial_report", None)
        if written:
            print(f"bench: partial report written to {written}" + _continue_hint(cfg, "once the error below is mended"),
                  file=sys.stderr)
        raise
    print(render_markdown(report))
    return 0


