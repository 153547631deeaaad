"""Step cache: a step whose inputs hash like last time is not run again.

Each step works in ``OUT/steps/<name>-<key>/`` where ``key`` hashes its inputs
(verifier fingerprint, upstream outputs' hashes, its own config). A finished step
leaves ``done.json`` there; an interrupted one leaves its partial work, which the
step's own resume logic picks up on the next run with the same inputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from draftsmith.utils import atomic_write_json

log = logging.getLogger(__name__)


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


class StepCache:
    """Runs named steps at most once per distinct input."""

    def __init__(self, root: Path, verbose: bool = True) -> None:
        self.root = Path(root)
        self.verbose = verbose
        self.timings: dict[str, dict[str, Any]] = {}
        self.started = time.perf_counter()
        #: predicted seconds per step and the whole budget (a budgeted run): printed beside each step
        self.estimates: dict[str, float] = {}
        self.budget_seconds: float | None = None
        #: seconds the steps found in the cache took when they ran (a resumed run's earlier work)
        self.earlier_seconds = 0.0
        #: count ``earlier_seconds`` in the run's elapsed time (a budgeted run resumed under its stored plan)
        self.count_earlier = False

    def elapsed(self) -> float:
        """Seconds this run has taken, plus its cached steps' own where ``count_earlier`` is set."""
        return time.perf_counter() - self.started + (self.earlier_seconds if self.count_earlier else 0.0)

    def _clock(self, name: str) -> str:
        """Elapsed time of the run, and what the budget has left (when there is one)."""
        elapsed = self.elapsed()
        text = f"elapsed {elapsed / 60:.1f} min"
        if self.budget_seconds is not None:
            text += f", {max(self.budget_seconds - elapsed, 0) / 60:.1f} min of the budget left"
        return text

    def dir_for(self, name: str, inputs: dict[str, Any]) -> Path:
        return self.root / f"{name}-{digest(inputs)}"

    def run(self, name: str, inputs: dict[str, Any], fn: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """Return the cached result of ``fn`` for these inputs, computing it if needed.

        Args:
            name: step name.
            inputs: everything the result depends on (JSON-serialisable).
            fn: ``fn(workdir) -> result`` (JSON-serialisable); it may resume from ``workdir``.
        """
        work = self.dir_for(name, inputs)
        done = work / "done.json"
        if done.is_file():
            stored = json.loads(done.read_text())
            result = stored["result"]
            ran = float(stored.get("seconds") or 0.0)
            self.earlier_seconds += ran
            self.timings[name] = {"cached": True, "seconds": 0.0, "ran_seconds": ran, "dir": str(work)}
            self._say(f"[{name}] up to date (cached in {work})")
            return result
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_json(work / "inputs.json", inputs)
        est = f", predicted {self.estimates[name] / 60:.1f} min" if name in self.estimates else ""
        self._say(f"[{name}] running" + (" (resuming)" if any(p.name != "inputs.json" for p in work.iterdir())
                                         else "") + f" ({self._clock(name)}{est})")
        t0 = time.perf_counter()
        result = fn(work)
        seconds = time.perf_counter() - t0
        atomic_write_json(done, {"result": result, "seconds": seconds})
        self.timings[name] = {"cached": False, "seconds": seconds, "dir": str(work)}
        self._say(f"[{name}] done in {seconds:.0f}s ({self._clock(name)})")
        for stale in self.root.glob(f"{name}-*"):  # older inputs of the same step
            if stale != work and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        return result

    def _say(self, msg: str) -> None:
        if self.verbose:
            print(msg, file=sys.stderr, flush=True)
