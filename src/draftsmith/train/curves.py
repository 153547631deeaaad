"""The training run as a picture: ``OUT/training.png`` from ``OUT/metrics.jsonl``.

Three panels over the optimizer steps: the TTT-weighted training loss, the training accuracy
at each unrolled draft position (the top-1 agreement with the verifier the draft is taught),
and the validation acceptance length (the number the pipeline selects the draft by), the best
validation marked. A run resumed after ``kill -9`` appends to ``metrics.jsonl`` from its last
checkpoint: where the steps go back, the records from that step on are the abandoned
attempt's and are dropped (the later run's weights are the ones that went on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.utils import complete_lines

PLOT = "training.png"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s records of the run as it went on, in step order: where the steps go back
    (a resume, or a step logged again with more in it), every record from that step on is replaced
    by what follows. ``[]`` when there is no file."""
    recs: list[dict[str, Any]] = []
    for line in complete_lines(Path(path), cut=False):
        if line.strip():
            rec = json.loads(line)
            while recs and recs[-1]["step"] >= rec["step"]:
                recs.pop()
            recs.append(rec)
    return recs


def plot_training(metrics_path: Path, out_png: Path, title: str = "") -> Path | None:
    """Draw ``metrics_path``'s run into ``out_png``; None (nothing written) without a trained step."""
    recs = read_metrics(metrics_path)
    trained = [r for r in recs if "loss" in r]
    if not trained:
        return None
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend is left alone

    val = [r for r in recs if "val_acceptance_length" in r]
    fig = Figure(figsize=(6.4, 7.2))
    axes = fig.subplots(3, 1, sharex=True)
    steps = [r["step"] for r in trained]
    ax = axes[0]
    ax.plot(steps, [r["loss"] for r in trained], lw=1)
    ax.set(ylabel="training loss", title=f"Training {title}".strip())
    ax.grid(alpha=0.3)
    ax = axes[1]
    positions = max(len(r.get("step_acc", [])) for r in trained)
    for j in range(positions):
        pts = [(r["step"], r["step_acc"][j]) for r in trained if len(r.get("step_acc", [])) > j]
        ax.plot([s for s, _ in pts], [a for _, a in pts], lw=1, label=f"position {j + 1}")
    ax.set(ylabel="training accuracy\n(top-1 = verifier's)", ylim=(0, 1))
    ax.grid(alpha=0.3)
    if positions:
        ax.legend(fontsize="small", ncol=min(positions, 4))
    ax = axes[2]
    if val:
        lengths = [r["val_acceptance_length"] for r in val]
        ax.plot([r["step"] for r in val], lengths, "o-", ms=3)
        best = max(range(len(val)), key=lambda i: lengths[i])  # the first best: the draft kept
        ax.plot([val[best]["step"]], [lengths[best]], "*", ms=12,
                label=f"best {lengths[best]:.2f} at step {val[best]['step']} (the draft kept)")
        ax.legend(fontsize="small")
        k = val[-1].get("val_k")
        ax.set(ylabel="validation acceptance\nlength" + (f" (k={k})" if k else ""))
    else:
        ax.text(0.5, 0.5, "no validation in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set(ylabel="validation acceptance\nlength")
    ax.set(xlabel="optimizer step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120, bbox_inches="tight")
    return out_png
