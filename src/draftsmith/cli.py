"""The draftsmith command line: ONE command table, flags generated from config dataclasses."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from draftsmith.bench import BenchConfig, run_bench
from draftsmith.bench.run import BENCH_LAYOUTS
from draftsmith.config import add_arguments, from_args, opt
from draftsmith.drafters import DRAFTER_HELP
from draftsmith.errors import DraftsmithError, GateFailed, Terminated
from draftsmith.evaluate import EvalConfig, run_eval
from draftsmith.models.quantize import DRAFT_PRECISIONS
from draftsmith.pipeline.config import DataSection
from draftsmith.pipeline.kfp import KfpCompileConfig, compile_cli
from draftsmith.pipeline.runner import PipelineRunConfig, RefreshConfig, refresh_cli, run_pipeline_cli
from draftsmith.pipeline.trainjob import KfpTrainJobConfig, trainjob_cli, trainjob_defaults
from draftsmith.train.loop import TrainConfig

EXIT_ERROR = 2
EXIT_GATE_FAILED = 3


# ----------------------------------------------------------------------------- generate
@dataclass
class GenerateConfig:
    """Generate text with the verifier, optionally speculatively, and print the stats."""

    verifier: str = opt(help="verifier: HF model dir, .gguf file, or alias (smollm2-135m)")
    prompt: str = opt(help="prompt text")
    chat: bool = opt(False, "wrap the prompt in the tokenizer's chat template as a user turn")
    drafter: str | None = opt(None, f"drafter: {DRAFTER_HELP}; omitted: plain decoding")
    num_draft_tokens: int = opt(5, "tokens drafted per round (k)")
    max_new_tokens: int = opt(128, "maximum number of new tokens")
    temperature: float = opt(0.0, "0 = greedy; > 0 samples")
    top_k: int | None = opt(None, "top-k filter (verifier and draft alike)")
    top_p: float | None = opt(None, "top-p (nucleus) filter (verifier and draft alike)")
    seed: int | None = opt(None, "random seed for sampling")
    dtype: str = opt("auto", "model dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    device: str = opt("auto", "device: auto, cpu, cuda, cuda:N")
    json: bool = opt(False, "print one JSON object with text, token_ids and stats")
    stream: bool = opt(True, "print the text as it is decided, round by round (not with --json); the time "
                             "it takes is kept out of the tok/s printed after it")
    compile: bool = opt(False, "torch.compile the verifier and draft steps (CUDA graphs on CUDA; on CPU the "
                               "weights frozen into the graph and multiplied by inductor's C++ GEMM kernel, ~2x "
                               "faster steps for a second copy of the weights in memory); the compile time "
                               "(minutes on a CPU the first time, cached on disk after) is reported apart")
    draft_precision: str = opt("as-loaded", "an EAGLE-3 draft's precision: "
                               + "; ".join(f"{k} ({v})" for k, v in DRAFT_PRECISIONS.items()))
    draft_confidence: list[float] = opt(
        default_factory=lambda: [0.0],
        help="an EAGLE-3 draft stops drafting where its probability that all its tokens so far pass falls "
             "below this (one number, or one per draft position, the last repeating; 0: always k tokens). "
             "Output is unchanged; what pays depends on the machine: `draftsmith bench` (its default "
             "--draft-confidence auto) reports the thresholds it derived from this machine's step prices")
    weight_layout: Literal["out-in", "auto", "in-out", "onednn", "cpp"] = opt(
        "out-in", "how the verifier's and draft's Linear weights are held and multiplied: out-in (as loaded); "
                  "onednn (CPU: oneDNN's matmul on the same weights; on AMD EPYC a one-token step ~0.7x MKL's); "
                  "cpp (CPU, float32: draftsmith's few-row C++ kernel for decode and verify steps, built on "
                  "first use; on AMD EPYC a one-token step ~0.7x oneDNN's); "
                  "in-out (transposed, held twice meanwhile); auto (time the verifier's steps in each CPU "
                  "kernel first, a few seconds, and take bench's --weight-layout auto choice). "
                  "Greedy output is the verifier's own in each; between layouts it can differ by rounding")

    def __post_init__(self) -> None:
        if self.weight_layout not in BENCH_LAYOUTS:
            raise DraftsmithError(f"--weight-layout: expected one of {list(BENCH_LAYOUTS)}, got {self.weight_layout!r}")
        if self.draft_precision not in DRAFT_PRECISIONS:
            raise DraftsmithError(f"--draft-precision: expected one of {list(DRAFT_PRECISIONS)}, "
                                  f"got {self.draft_precision!r}")
        if self.num_draft_tokens < 1:
            raise DraftsmithError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if not self.draft_confidence or not all(0.0 <= c <= 1.0 for c in self.draft_confidence):
            raise DraftsmithError(f"--draft-confidence: expected numbers in [0, 1], got {self.draft_confidence}")
        if self.max_new_tokens < 1:
            raise DraftsmithError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


def run_generate(cfg: GenerateConfig) -> int:
    import torch

    from draftsmith.data.chat import encode_prompt
    from draftsmith.decoding.engine import generate
    from draftsmith.drafters import build_proposer
    from draftsmith.models.verifier import load_verifier, weight_layouts

    model, tokenizer, _ = load_verifier(cfg.verifier, dtype=cfg.dtype, device=cfg.device)
    proposer = build_proposer(cfg.drafter, model, tokenizer, dtype=cfg.dtype, draft_precision=cfg.draft_precision)
    if any(cfg.draft_confidence):
        if not hasattr(proposer, "min_confidence"):
            raise DraftsmithError("--draft-confidence applies to an EAGLE-3 draft directory, "
                                  + (f"not to --drafter {cfg.drafter!r}" if cfg.drafter else "and no --drafter is given"))
        proposer.min_confidence = cfg.draft_confidence
    ids = encode_prompt(tokenizer, cfg.prompt, chat=cfg.chat)
    layout = cfg.weight_layout
    if layout == "auto":
        from draftsmith.bench.measure import choose_weight_layout

        layout = choose_weight_layout(model, ids, [cfg.num_draft_tokens], cfg.max_new_tokens,
                                      compiled=cfg.compile)["layout"]
    draft = getattr(proposer, "draft", None)
    streamer = None
    if cfg.stream and not cfg.json:
        from transformers import TextStreamer

        streamer = TextStreamer(tokenizer, skip_special_tokens=True)
    with weight_layouts([model] + ([draft] if isinstance(draft, torch.nn.Module) else []), layout):
        out = generate(model, ids, proposer=proposer, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                       num_draft_tokens=cfg.num_draft_tokens, seed=cfg.seed, compile=cfg.compile,
                       on_tokens=None if streamer is None else lambda new: streamer.put(torch.tensor(new)))
    out.stats["weight_layout"] = layout
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    if cfg.json:
        print(json.dumps({"text": text, "token_ids": out.token_ids, "stats": out.stats}))
    else:
        s = out.stats
        if streamer is not None:
            streamer.end()  # the text's last words, and a newline
        else:
            print(text)
        print(f"\n[{s['new_tokens']} tokens in {s['seconds']:.2f}s = {s['tokens_per_second']:.1f} tok/s; "
              f"verifier forwards {s['verifier_forwards']}; drafts {s['drafts']}, "
              f"acceptance length {s['acceptance_length']:.2f}, acceptance rate {s['acceptance_rate']:.2f}; "
              f"engine {s['engine']}, weights {layout}" + (f", compiled in {s['compile_seconds']:.1f}s" if s["compile_seconds"] else "")
              + "]")
    return 0


# ----------------------------------------------------------------------------- data / train
@dataclass
class DataConfig(DataSection):
    """Regenerate responses with the verifier and capture its hidden states into shards
    (cached and resumable; the shards go to OUT/shards for `draftsmith train --data`)."""

    verifier: str = opt("smollm2-135m", "verifier: HF dir, .gguf file or alias")
    out: str = opt("runs/data", "output directory")
    device: str = opt("auto", "device")

    def setting(self, name: str) -> str:  # the flag, not the pipeline's YAML key
        return "--" + name.replace("_", "-")


def run_data(cfg: Any) -> int:
    from pathlib import Path

    from draftsmith.pipeline import steps
    from draftsmith.pipeline.cache import StepCache

    out = Path(cfg.out)
    v = steps.Verifier(cfg.verifier, steps.data_dtype(cfg.dtype, cfg.device), cfg.device)
    _, r, c = steps.run_data_steps(StepCache(out / "steps"), cfg, v, v.fingerprint)
    link = out / "shards"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(c["dir"]).resolve())
    print(f"{c['tokens']} tokens from {r['count']} conversations captured -> {link}")
    return 0


def run_train(cfg: Any) -> int:
    from draftsmith.train.loop import train

    res = train(cfg)
    print(f"trained {res.steps} steps in {res.seconds:.0f}s; best validation acceptance length "
          f"{res.best_acceptance_length:.2f} (k={cfg.eval_steps}) -> {res.draft_dir}"
          + (f"; training curves: {res.metrics['plot']}" if res.metrics.get("plot") else ""))


# ----------------------------------------------------------------------------- export
@dataclass
class ExportConfig:
    """Write an EAGLE-3 draft in the speculators format vLLM serves (config.json, model.safetensors,
    draftsmith.json, README.md), or as the GGUF llama.cpp serves (--format gguf), after checking it
    against the verifier it names."""

    draft: str = opt(help="draft directory: a draftsmith training output or any speculators-format EAGLE-3 draft",
                     positional=True, metavar="DRAFT")
    out: str = opt(help="output: a directory for --format speculators (replaced atomically; may equal DRAFT), "
                        "a .gguf file for --format gguf")
    format: Literal["speculators", "gguf"] = opt("speculators", "speculators: the directory vLLM serves; gguf: the "
                                                 "file llama-server serves with --spec-type draft-eagle3 (made "
                                                 "with llama.cpp's converter; `make setup-llamacpp`)")
    num_draft_tokens: int | None = opt(None, "speculative tokens (k) vLLM uses by default; omitted: the draft's")
    verifier_name: str | None = opt(None, "verifier name or path written to config.json for vLLM; omitted: the "
                                          "verifier the draft names")
    verifier: str | None = opt(None, "verifier to check the draft against (HF dir, .gguf, alias); omitted: the "
                                     "named verifier when it is on this machine (required there for gguf)")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "q8_0"] = opt(
        "auto", "weight dtype; auto keeps the draft's; q8_0 (--format gguf only): 8-bit blocks of 32 weights, "
                "the int8 precision llama.cpp serves")

    def __post_init__(self) -> None:
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise DraftsmithError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if self.dtype == "q8_0" and self.format != "gguf":
            raise DraftsmithError("--dtype q8_0 is a GGUF type (llama.cpp); use it with --format gguf")
        if self.format == "gguf":
            for flag, value in (("--num-draft-tokens", self.num_draft_tokens), ("--verifier-name", self.verifier_name)):
                if value is not None:
                    raise DraftsmithError(f"{flag} is written to the speculators config.json; a GGUF draft has no such "
                                          "field (llama-server takes k as --spec-draft-n-max): drop it or use "
                                          "--format speculators")
            if not self.out.endswith(".gguf"):
                raise DraftsmithError(f"--out {self.out!r}: --format gguf writes one file; name it *.gguf")


#: Files of an exported draft directory (:func:`draftsmith.export.save_draft`): what export may replace.
DRAFT_DIR_FILES = frozenset({"config.json", "model.safetensors", "draftsmith.json", "README.md"})


def check_replaceable(out: Path, draft: Path) -> None:
    """export replaces ``out`` whole: refuse a non-empty directory that is neither the draft itself nor
    an earlier export (its files among :data:`DRAFT_DIR_FILES`), which would be deleted with its contents."""
    if not out.is_dir() or out.resolve() == draft.resolve():
        return
    others = sorted(p.name for p in out.iterdir() if p.name not in DRAFT_DIR_FILES)
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise DraftsmithError(f"--out {out}: the directory holds files that are not a draft's ({shown}); export "
                              "replaces the whole directory: name a new or empty one, or a draft export")


def run_export(cfg: ExportConfig) -> int:
    from pathlib import Path

    from draftsmith.engines.llamacpp import export_gguf
    from draftsmith.export import save_draft, serve_commands
    from draftsmith.models.speculators import read_draft, read_provenance
    from draftsmith.models.verifier import load_verifier

    if cfg.format == "gguf":
        out = export_gguf(cfg.draft, cfg.out, verifier=cfg.verifier, dtype=cfg.dtype)
        print(f"exported EAGLE-3 draft to {out}\nserve it with:\n\n"
              f"llama-server -m VERIFIER.gguf -md {Path(out).resolve()} --spec-type draft-eagle3 "
              "--spec-draft-n-max K --spec-draft-p-min 0")
        return 0
    check_replaceable(Path(cfg.out), Path(cfg.draft))
    previous = read_provenance(cfg.draft) or {}
    verifier = fp = layers = None
    if cfg.verifier is not None:
        verifier, _, fp = load_verifier(cfg.verifier, dtype="auto", device="auto")  # shapes and fingerprint only
        layers = verifier.config.get_text_config().num_hidden_layers
    draft = read_draft(cfg.draft, verifier_layers=layers)
    old_verifier = previous.get("verifier") or {}
    if fp is None:
        fp = old_verifier.get("fingerprint")
    elif old_verifier.get("fingerprint") not in (None, fp):
        print(f"draftsmith: note: the draft was trained for verifier fingerprint {old_verifier['fingerprint']}, "
              f"{cfg.verifier} has {fp}", file=sys.stderr)
    extra = {k: v for k, v in previous.items() if k in ("training", "data")}
    extra["source"] = {"path": str(Path(cfg.draft).resolve()), "created": previous.get("created"),
                       "draftsmith": previous.get("draftsmith")} if previous else {"path": str(Path(cfg.draft).resolve())}
    name = cfg.verifier_name or (cfg.verifier if draft.config.verifier_name is None else None)
    out = save_draft(draft, cfg.out, verifier_name=name, num_draft_tokens=cfg.num_draft_tokens,
                     fingerprint=fp, provenance=extra, metrics=previous.get("metrics"),
                     dtype=None if cfg.dtype == "auto" else cfg.dtype, verifier=verifier)
    written = json.loads((out / "config.json").read_text())
    k = written["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    name = written["speculators_config"]["verifier"]["name_or_path"]
    print(f"exported EAGLE-3 draft to {out}\nserve it with:\n")
    print("\n\nor\n\n".join(serve_commands(out.resolve(), name, k)))
    return 0


# ----------------------------------------------------------------------------- the table
@dataclass
class Command:
    config: type
    run: Callable[[Any], int]
    help: str
    # flag defaults read from files the command line names (e.g. --config); explicit flags still win
    defaults: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    # what its --out names, checked before any work (:func:`preflight`): "dir", "file", or per config
    out: str | Callable[[Any], str] | None = None


COMMANDS: dict[str, Command] = {
    "generate": Command(GenerateConfig, run_generate, "generate text, optionally with a drafter"),
    "data": Command(DataConfig, run_data, "regenerate responses with the verifier and capture hidden states",
                    out="dir"),
    "train": Command(TrainConfig, run_train, "train an EAGLE-3 draft on captured shards", out="dir"),
    "pipeline run": Command(PipelineRunConfig, run_pipeline_cli,
                            "the whole job: data -> train -> bench -> gate -> export"),
    "refresh": Command(RefreshConfig, refresh_cli, "retrain a draft after the verifier changed"),
    "bench": Command(BenchConfig, run_bench, "measure drafters vs plain decoding: speedup, acceptance, "
                     "break-even; write report.json, report.md and plots", out="dir"),
    "eval": Command(EvalConfig, run_eval, "teacher-forced acceptance of drafts on held-out prompts, in seconds "
                    "(no timing)", out="file"),
    "export": Command(ExportConfig, run_export, "write a draft in the speculators format vLLM serves, or as the GGUF "
                      "llama.cpp serves", out=lambda cfg: "file" if cfg.format == "gguf" else "dir"),
    "kfp compile": Command(KfpCompileConfig, compile_cli, "compile the pipeline for Kubeflow Pipelines v2 (YAML)",
                           out="file"),
    "kfp trainjob": Command(KfpTrainJobConfig, trainjob_cli, "write a Kubeflow Trainer TrainJob for multi-node "
                            "training (torchrun)", defaults=trainjob_defaults, out="file"),
}


def preflight(cmd: Command, cfg: Any) -> None:
    """What every command checks before it loads a model: a device string torch can parse, and an
    ``--out`` it can write (a directory where a directory goes, a file where a file goes)."""
    from draftsmith.utils import check_device_name, check_out_path

    if isinstance(getattr(cfg, "device", None), str):
        check_device_name(cfg.device)
    kind = cmd.out(cfg) if callable(cmd.out) else cmd.out
    if kind and getattr(cfg, "out", None):
        check_out_path(cfg.out, kind)


def build_parser() -> argparse.ArgumentParser:
    from draftsmith import __version__

    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train an EAGLE-3 draft for your LLM, prove it is faster, export it for vLLM.")
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, cmd in COMMANDS.items():
        parent, _, child = name.partition(" ")
        if child:  # two-word commands: "pipeline run", "kfp compile"
            if parent not in groups:
                gp = sub.add_parser(parent, help=f"{parent} commands")
                groups[parent] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            p = groups[parent].add_parser(child, help=cmd.help, description=cmd.config.__doc__)
        else:
            p = sub.add_parser(name, help=cmd.help, description=cmd.config.__doc__)
        add_arguments(p, cmd.config)
        # also after the command (`draftsmith bench -v ...`); SUPPRESS keeps a -v given before it
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress details")
        p.set_defaults(_command=cmd)
    return parser


def _quiet_libraries(verbose: bool) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    parser = build_parser()
    ns = parser.parse_args(argv)
    _quiet_libraries(ns.verbose)
    cmd: Command = ns._command
    try:
        cfg = from_args(cmd.config, ns, cmd.defaults(ns) if cmd.defaults else None)
        preflight(cmd, cfg)
        return cmd.run(cfg) or 0
    except GateFailed as e:
        print(f"draftsmith: gate failed: {e}", file=sys.stderr)
        return EXIT_GATE_FAILED
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        term = isinstance(e, Terminated)
        print(f"draftsmith: interrupted{' (SIGTERM)' if term else ''}; run the same command again to resume",
              file=sys.stderr)
        return 143 if term else 130


if __name__ == "__main__":
    sys.exit(main())
