"""An interrupted bench continues where it stopped.

A bench of many rows, prompts or serving engines takes hours; a Ctrl-C, SIGTERM, an error or
a lost machine must not throw its timings away. While it measures, the bench keeps

- ``OUT/bench-state.json``, written once its step costs are measured (the calibration,
  ``--choose-k``'s choice, the draft confidence thresholds and ``--weight-layout auto``'s
  choice come with them), and
- ``OUT/bench-units.jsonl``, one line appended after every prompt that every row has decoded
  (a *unit*: one prompt of one repeat), so each write costs one unit, not the bench so far.

Run with the same settings on the same machine, the bench reads them back: the same layout,
costs, k and thresholds, the units already timed kept as they were, the rows warmed up
again, and the timing goes on from the next unit. A unit half done when the run stopped is
timed again in full, so every prompt's rows stay timed side by side (the paired speedups
rest on that). Anything else that changed (settings, prompts, verifier, drafts, machine,
versions of the libraries or of draftsmith's own sources) starts the bench afresh, and it says
why; a serving engine that reports another version than before keeps the step costs but times
every unit again. A checkpoint that cannot be written is warned about once and the bench goes
on.

A bench whose settings differ only in ``--num-prompts`` or ``--repeats`` (its prompts the saved
bench's first ones, or more of them) keeps the saved units that are also the first of its own
order, and times the rest: a finished bench whose interval came out too wide is extended by the
prompts it lacks, not timed again. So the files stay once the full report is written, marked
complete: the same bench once more measures afresh, and ``--no-resume`` removes them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from draftsmith.bench.costmodel import CostModel
from draftsmith.bench.measure import BenchState, RunResult, environment, load_average
from draftsmith.bench.report import layout_choice_json
from draftsmith.config import to_dict
from draftsmith.decoding.proposers import Proposer
from draftsmith.utils import atomic_write_bytes, atomic_write_json, complete_lines

log = logging.getLogger(__name__)

STATE_FILE = "bench-state.json"
UNITS_FILE = "bench-units.jsonl"
#: bumped when the file's layout changes: an older file is not read
FORMAT = 3
#: settings that shape the report only, not what is measured: they may differ on resume
REPORT_ONLY = ("out", "progress", "bootstrap", "target_speedup", "resume")
#: what may differ from a saved bench whose timed units are kept (:func:`kept_units`)
RESIZABLE = ("settings.num_prompts", "settings.repeats", "prompts")


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


@functools.cache
def sources_digest() -> str:
    """Hash of draftsmith's own sources (Python, C++): a resumed bench runs the code that began it
    (the package version alone does not change with each edit)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def engines_identity(rows: Sequence[Any]) -> dict[str, Any]:
    """The serving engines' rows as started (known only once they run): each one's reported version
    and the program it runs (size and modification time), by row name."""
    out: dict[str, Any] = {}
    for row in rows:
        server = getattr(row, "server", None)
        if server is None:
            continue
        argv = getattr(server, "argv", None) or [None]
        try:
            st = os.stat(argv[0]) if argv[0] else None
        except OSError:
            st = None
        out[row.name] = {"version": getattr(server, "version", None),
                         "program": [str(argv[0]), st.st_size, int(st.st_mtime)] if st else str(argv[0])}
    return out


def identity(cfg: Any, provenance: Mapping[str, Any], prompts: Sequence[tuple[str, list[int]]],
             pilot: Sequence[tuple[str, list[int]]], proposers: Mapping[str, Proposer],
             model: torch.nn.Module) -> dict[str, Any]:
    """Everything the timings depend on; a checkpoint is resumed only where this is equal."""
    param = next(model.parameters())
    env = environment()
    verifier = provenance.get("fingerprint")
    if verifier is None:  # a library call without provenance: the weights themselves
        from draftsmith.models.verifier import fingerprint

        verifier = fingerprint(model)
    return {
        "format": FORMAT,
        "settings": {k: v for k, v in to_dict(cfg).items() if k not in REPORT_ONLY},
        "verifier": verifier, "dataset": provenance.get("dataset"),
        "model": f"{param.dtype}@{param.device}",
        # one digest per prompt: a bench of more (or fewer) of the same prompts keeps those timed
        "prompts": [_digest(p) for p in prompts], "pilot": _digest(list(pilot)),
        "proposers": {label: [type(p).__name__, proposer_digest(p)] for label, p in proposers.items()},
        # the machine and the software: timings of another host or version are not pooled with these
        "machine": {**{k: env.get(k) for k in ("cpu_model", "cpu_isa", "cpu_count", "torch_threads", "cuda",
                                               "platform", "draftsmith", "torch", "transformers", "python")},
                    "cuda_runtime": torch.version.cuda, "torchao": _version("torchao"), "sources": sources_digest()},
    }


def _digest(x: Any) -> str:
    return hashlib.sha256(json.dumps(x).encode()).hexdigest()[:16]


def kept_units(units: Sequence[Mapping[str, Any]], prompts_before: int, prompts_now: int, repeats_now: int) -> int:
    """How many of a saved bench's units (in their order) a bench of ``prompts_now`` prompts and
    ``repeats_now`` repeats keeps, the first ``min(prompts_before, prompts_now)`` prompts being the
    same: the longest run of them that is also the start of its own order (unit ``u`` is prompt
    ``u % P`` of repeat ``u // P``), so the units left to time follow them as usual."""
    if prompts_before < 1:
        return 0
    for i, unit in enumerate(units):
        p, r = i % prompts_before, i // prompts_before
        if unit.get("prompt") != p or p >= prompts_now or r >= repeats_now or r * prompts_now + p != i:
            return i
    return len(units)


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
    """``OUT/bench-state.json`` and ``OUT/bench-units.jsonl``: what a resumed bench needs, written as
    the bench goes."""

    def __init__(self, out_dir: Path, ident: dict[str, Any]) -> None:
        self.path = Path(out_dir) / STATE_FILE
        self.units_path = Path(out_dir) / UNITS_FILE
        self.ident = ident
        self.layout: str | None = None
        self.layout_choice: dict[str, Any] | None = None
        self.engines: dict[str, Any] = {}  # engines_identity of the rows, once they are built
        self.broken = False  # a write failed: warned once, no more checkpoints this run
        self.kept_lines: list[bytes] | None = None  # a resized bench's kept units, written back by start()

    def load(self, say: bool = True) -> dict[str, Any] | None:
        """The saved state when it belongs to this bench, with ``units`` (the units timed, in order)
        and ``units_done``, and for a bench of other ``--num-prompts``/``--repeats`` ``resized``
        (prompts and repeats before and now, units saved); None otherwise (a checkpoint of another
        bench is removed, and why is said on stderr; a complete one of this very bench silently:
        the same bench again measures afresh)."""
        if not self.path.is_file():
            return None
        complete = False
        try:
            saved = json.loads(self.path.read_text())
            before = saved.get("identity") or {}
            complete = bool(saved.get("complete"))
            diff = differences(before, self.ident)
            why = "these differ: " + ", ".join(diff[:6]) + (" ..." if len(diff) > 6 else "")
            if not diff:
                if complete:  # the same bench again: measured afresh
                    self.remove()
                    return None
                units = [json.loads(line) for line in complete_lines(self.units_path)]  # a torn last line: cut
                return {**saved, "units": units, "units_done": len(units)}
            if set(diff) <= set(RESIZABLE):
                old, new = before["prompts"], self.ident["prompts"]
                n = min(len(old), len(new))
                if old[:n] != new[:n]:
                    why = "its prompts are not the first of these"
                else:
                    lines = complete_lines(self.units_path)
                    units = [json.loads(line) for line in lines]
                    keep = kept_units(units, len(old), len(new), self.ident["settings"]["repeats"])
                    if keep:
                        # the file holds those kept only, before a unit is appended to it (start())
                        self.kept_lines = lines[:keep] if keep < len(lines) else None
                        return {**saved, "units": units[:keep], "units_done": keep,
                                "resized": {"prompts": [len(old), len(new)],
                                            "repeats": [before["settings"]["repeats"],
                                                        self.ident["settings"]["repeats"]],
                                            "units_saved": len(units), "complete": complete}}
                    why = "none of its timed prompts comes first in this bench's order"
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = f"it cannot be read ({e})"
        if say:
            what = "a finished bench" if complete else "an interrupted bench"
            print(f"bench: {self.path} holds {what} that is not this one ({why}); starting afresh", file=sys.stderr)
        self.remove()
        return None

    def _write(self, what: str, fn: Any) -> None:
        if self.broken:
            return
        try:
            fn()
        except OSError as e:
            self.broken = True
            log.warning("bench: cannot write the checkpoint's %s (%s); the bench goes on, but an interruption "
                        "from here on would start it afresh", what, e)

    def start(self, state: BenchState, units_done: int, complete: bool = False) -> None:
        """Write the header: the step costs and choices, the rows, the attempts so far. ``units_done``
        0 starts the units afresh; a resumed bench keeps its ``units_done`` units (a resized one's
        file cut to them first, so no other unit is ever read with this header). ``complete``: the
        full report is written (:meth:`finish`)."""
        c = state.costs
        header = {
            "identity": self.ident, "saved": time.time(), "rows": [r.name for r in state.rows],
            "engines": self.engines,
            "layout": self.layout, "layout_choice": layout_choice_json(self.layout_choice),
            "costs": None if c is None else {**dataclasses.asdict(c), "t_verify": {str(n): t for n, t in
                                                                                   c.t_verify.items()}},
            "plain_steps": state.plain_steps,
            "verify_steps": {d: {str(n): v for n, v in s.items()} for d, s in state.verify_steps.items()},
            "draft_per_call": {d: {str(n): v for n, v in s.items()} for d, s in state.draft_per_call.items()},
            "draft_fit": state.draft_fit, "costs_compile_seconds": state.costs_compile_seconds,
            "k_choice": state.k_choice, "draft_confidence": state.draft_confidence,
            "started": state.started, "load_at_start": state.load_at_start,
            "seconds": state.measuring_seconds(), "attempts": state.attempts, "complete": complete,
        }

        def write() -> None:
            if units_done == 0:
                self.units_path.unlink(missing_ok=True)
            elif self.kept_lines is not None:
                atomic_write_bytes(self.units_path, b"".join(line + b"\n" for line in self.kept_lines))
                self.kept_lines = None
            atomic_write_json(self.path, header)
        self._write("header", write)

    def finish(self, state: BenchState) -> None:
        """Mark the checkpoint complete, its units kept: a bench of more prompts or repeats extends it
        (:meth:`load`), the same bench again measures afresh."""
        self.start(state, -1, complete=True)

    def add_unit(self, state: BenchState, units_done: int) -> None:
        """Append unit ``units_done - 1``: its prompt's latest run by every row."""
        p = (units_done - 1) % len(state.prompts)
        line = json.dumps({"unit": units_done - 1, "prompt": p, "seconds": state.measuring_seconds(),
                           "runs": [[r, _run_to_json(state.results[(r, p)][-1])] for r in range(len(state.rows))]})

        def write() -> None:
            with open(self.units_path, "a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        self._write("units", write)

    def remove(self) -> None:
        for f in (self.path, self.units_path):
            try:
                f.unlink(missing_ok=True)
            except OSError as e:
                log.warning("bench: cannot remove %s (%s)", f, e)


def interrupted(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds the checkpoint of a bench that has not finished."""
    try:
        return not json.loads((Path(out_dir) / STATE_FILE).read_text()).get("complete")
    except (OSError, ValueError, AttributeError):
        return False


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


def restore_results(state: BenchState, saved: Mapping[str, Any], keep_units: bool = True) -> int:
    """Put the saved timed runs into ``state`` (its rows must be the saved ones; with ``keep_units``
    False none are: every unit is timed again) and count this attempt; returns the units done,
    where the timing goes on."""
    if [r.name for r in state.rows] != saved["rows"]:
        raise ValueError(f"rows differ from the saved bench's: {[r.name for r in state.rows]} != {saved['rows']}")
    units = saved["units"] if keep_units else []
    state.results = {}
    for unit in units:
        for r, run in unit["runs"]:
            state.results.setdefault((r, unit["prompt"]), []).append(_run_from_json(run))
    state.earlier_seconds = float(units[-1]["seconds"] if units else saved["seconds"])
    state.attempts = [*saved.get("attempts", []), {"resumed": time.time(), "units_done": len(units),
                                                       "load": load_average(),
                                                       **({"resized": saved["resized"]} if "resized" in saved else {})}]
    return len(units)


def restore_confidence(proposers: Mapping[str, Proposer], draft_confidence: Mapping[str, Mapping[str, Any]]) -> None:
    """Give each drafter the stop rule the saved bench gave it (:func:`~draftsmith.bench.measure.apply_draft_confidence`)."""
    for name, rule in draft_confidence.items():
        proposers[name].min_confidence = rule["thresholds"]
