"""An interrupted bench continues where it stopped.

A bench of many rows, prompts or serving engines takes hours; a Ctrl-C, SIGTERM or a lost
machine must not throw its timings away. While it measures, the bench keeps
``OUT/bench-state.json`` up to date:

- after its step costs are measured (the calibration, ``--choose-k``'s choice, the draft
  confidence thresholds and ``--weight-layout auto``'s choice come with them), and
- after every prompt that every row has decoded (a *unit*: one prompt of one repeat).

Run with the same settings on the same machine, the bench reads it back: the same layout,
costs, k and thresholds, the units already timed kept as they were, the rows warmed up
again, and the timing goes on from the next unit. A unit half done when the run stopped is
timed again in full, so every prompt's rows stay timed side by side (the paired speedups
rest on that). Anything else that changed (settings, prompts, verifier, drafts, machine,
versions) starts the bench afresh, and it says why. The file is removed once the full
report is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from draftsmith.bench.costmodel import CostModel
from draftsmith.bench.measure import BenchState, RunResult, environment, load_average
from draftsmith.config import to_dict
from draftsmith.decoding.proposers import Proposer
from draftsmith.utils import atomic_write_json

STATE_FILE = "bench-state.json"
#: bumped when the file's layout changes: an older file is not read
FORMAT = 1
#: settings that shape the report only, not what is measured: they may differ on resume
REPORT_ONLY = ("out", "progress", "bootstrap", "target_speedup", "resume")


def module_digest(module: torch.nn.Module) -> str:
    """Hash of a module's weights and buffers as held (names, shapes, dtypes, bytes)."""
    h = hashlib.sha256()

    def add(name: str, t: Any) -> None:
        if isinstance(t, (tuple, list)):  # packed state (a quantized layer's weight and bias)
            for i, x in enumerate(t):
                add(f"{name}.{i}", x)
        elif not isinstance(t, torch.Tensor):
            h.update(f"{name}:{t!r}".encode())
        else:
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if t.is_quantized:
                t = t.int_repr()
            if t.numel():
                h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())

    for name, t in sorted(module.state_dict().items(), key=lambda kv: kv[0]):
        add(name, t)
    return h.hexdigest()[:16]


def proposer_digest(prop: Proposer) -> str | None:
    """The weights a proposer drafts with (an EAGLE-3 draft, a draft model); None for weightless ones."""
    for attr in ("draft", "model"):
        m = getattr(prop, attr, None)
        if isinstance(m, torch.nn.Module):
            return module_digest(m)
    return None


def identity(cfg: Any, provenance: Mapping[str, Any], prompts: Sequence[tuple[str, list[int]]],
             pilot: Sequence[tuple[str, list[int]]], proposers: Mapping[str, Proposer],
             model: torch.nn.Module) -> dict[str, Any]:
    """Everything the timings depend on; a checkpoint is resumed only where this is equal."""
    param = next(model.parameters())
    env = environment()
    return {
        "format": FORMAT,
        "settings": {k: v for k, v in to_dict(cfg).items() if k not in REPORT_ONLY},
        "verifier": provenance.get("fingerprint"), "dataset": provenance.get("dataset"),
        "model": f"{param.dtype}@{param.device}",
        "prompts": hashlib.sha256(json.dumps([list(prompts), list(pilot)]).encode()).hexdigest()[:16],
        "proposers": {label: [type(p).__name__, proposer_digest(p)] for label, p in proposers.items()},
        # the machine and the software: timings of another host or version are not pooled with these
        "machine": {k: env.get(k) for k in ("cpu_model", "cpu_count", "torch_threads", "cuda", "platform",
                                            "draftsmith", "torch", "transformers", "python")},
    }


def differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of what differs between two identities (the first few)."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += differences(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def _int_keys(d: Mapping[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


def _run_to_json(x: RunResult) -> dict[str, Any]:
    d = dataclasses.asdict(x)
    if d["stats"] and "step_seconds" in d["stats"]:
        d["stats"]["step_seconds"] = {str(n): v for n, v in d["stats"]["step_seconds"].items()}
    return d


def _run_from_json(d: Mapping[str, Any]) -> RunResult:
    stats = d.get("stats")
    if stats and "step_seconds" in stats:
        stats = {**stats, "step_seconds": _int_keys(stats["step_seconds"])}
    return RunResult(token_ids=list(d["token_ids"]), seconds=float(d["seconds"]), stats=stats,
                     draft_calls=[tuple(c) for c in d.get("draft_calls", [])], peak_rss=d.get("peak_rss"),
                     peak_cuda=d.get("peak_cuda"))


class Checkpoint:
    """``OUT/bench-state.json``: what a resumed bench needs, written as the bench goes."""

    def __init__(self, out_dir: Path, ident: dict[str, Any]) -> None:
        self.path = Path(out_dir) / STATE_FILE
        self.ident = ident
        self.layout: str | None = None
        self.layout_choice: dict[str, Any] | None = None

    def load(self, say: bool = True) -> dict[str, Any] | None:
        """The saved state when it belongs to this bench; None (and why, on stderr) otherwise."""
        if not self.path.is_file():
            return None
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            why = f"it cannot be read ({e})"
        else:
            diff = differences(saved.get("identity") or {}, self.ident)
            if not diff:
                return saved
            why = "these differ: " + ", ".join(diff[:6]) + (" ..." if len(diff) > 6 else "")
        if say:
            print(f"bench: {self.path} holds an interrupted bench that is not this one ({why}); "
                  "starting afresh", file=sys.stderr)
        return None

    def save(self, state: BenchState, units_done: int) -> None:
        """Write the state with its first ``units_done`` units (prompt x repeat) timed by every row."""
        c = state.costs
        atomic_write_json(self.path, {
            "identity": self.ident, "saved": time.time(), "units_done": units_done,
            "rows": [r.name for r in state.rows],
            "layout": self.layout, "layout_choice": self.layout_choice and {
                **self.layout_choice, "t_seconds": {lay: {str(n): s for n, s in t.items()}
                                                    for lay, t in self.layout_choice["t_seconds"].items()}},
            "costs": None if c is None else {**dataclasses.asdict(c), "t_verify": {str(n): t for n, t in
                                                                                   c.t_verify.items()}},
            "plain_steps": state.plain_steps,
            "verify_steps": {d: {str(n): v for n, v in s.items()} for d, s in state.verify_steps.items()},
            "draft_per_call": {d: {str(n): v for n, v in s.items()} for d, s in state.draft_per_call.items()},
            "draft_fit": state.draft_fit, "costs_compile_seconds": state.costs_compile_seconds,
            "k_choice": state.k_choice, "draft_confidence": state.draft_confidence,
            "started": state.started, "load_at_start": state.load_at_start,
            "seconds": state.measuring_seconds(), "attempts": state.attempts,
            "results": [{"row": r, "prompt": p, "runs": [_run_to_json(x) for x in xs]}
                        for (r, p), xs in sorted(state.results.items())],
        })

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def layout_of(saved: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The weight layout the saved bench measured with, and ``--weight-layout auto``'s evidence."""
    choice = saved.get("layout_choice")
    if choice:
        choice = {**choice, "t_seconds": {lay: _int_keys(t) for lay, t in choice["t_seconds"].items()}}
    return saved["layout"], choice


def restore_costs(state: BenchState, saved: Mapping[str, Any]) -> None:
    """Put the saved step costs, k choice and draft confidence rules into ``state``."""
    c = saved["costs"]
    state.costs = None if c is None else CostModel(**{**c, "t_verify": _int_keys(c["t_verify"])})
    state.plain_steps = list(saved["plain_steps"])
    state.verify_steps = {d: _int_keys(s) for d, s in saved["verify_steps"].items()}
    state.draft_per_call = {d: _int_keys(s) for d, s in saved["draft_per_call"].items()}
    state.draft_fit = {d: tuple(v) for d, v in saved["draft_fit"].items()}
    state.costs_compile_seconds = float(saved["costs_compile_seconds"])
    state.k_choice = saved["k_choice"]
    state.draft_confidence = saved["draft_confidence"]
    state.started, state.load_at_start = saved["started"], saved["load_at_start"]


def restore_results(state: BenchState, saved: Mapping[str, Any]) -> int:
    """Put the saved timed runs into ``state`` (its rows must be the saved ones); returns the
    units done, where the timing goes on."""
    if [r.name for r in state.rows] != saved["rows"]:
        raise ValueError(f"rows differ from the saved bench's: {[r.name for r in state.rows]} != {saved['rows']}")
    state.results = {(e["row"], e["prompt"]): [_run_from_json(x) for x in e["runs"]] for e in saved["results"]}
    state.earlier_seconds = float(saved["seconds"])
    state.attempts = [*saved.get("attempts", []), {"resumed": time.time(), "units_done": int(saved["units_done"]),
                                                       "load": load_average()}]
    return int(saved["units_done"])


def restore_confidence(proposers: Mapping[str, Proposer], draft_confidence: Mapping[str, Mapping[str, Any]]) -> None:
    """Give each drafter the stop rule the saved bench gave it (:func:`~draftsmith.bench.measure.apply_draft_confidence`)."""
    for name, rule in draft_confidence.items():
        proposers[name].min_confidence = rule["thresholds"]
