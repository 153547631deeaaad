"""The gate: is a measured draft deployable?

A draft passes only on evidence that luck cannot supply:

* **no mismatch**: every greedy output equals plain decoding, or parts from it only
  at a numerical tie (:mod:`draftsmith.bench.verdict`); ``strict`` also refuses ties
  (the right rule in float32, where there are none);
* **k chosen apart from the judgement**: with one k measured, that k; with several,
  k is chosen on every other prompt (the even positions) and judged on the rest, so
  the luckiest k of a sweep is not also the one whose numbers decide;
* **a speedup the interval supports**: on at least :data:`MIN_JUDGED_PROMPTS` judged
  prompts, the lower end of the 95% bootstrap interval of the paired per-prompt speedup
  is above 1.0 and the median reaches ``min_speedup`` (with fewer prompts, even "faster on
  every one" happens by chance more than once in twenty when a draft has no effect);
* and, optionally, it is not slower than the previous draft of the same verifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from draftsmith.bench.stats import bootstrap_ci
from draftsmith.config import opt
from draftsmith.engines import ENGINES, OURS
from draftsmith.errors import DraftsmithError

#: fewest prompts a speedup is judged on: all n faster by chance has probability 2**-n
#: under no effect (a sign test), below 0.05 from n = 5 on
MIN_JUDGED_PROMPTS = 5


@dataclass
class GateSection:
    """When a draft is deployable."""

    min_speedup: float = opt(1.2, "smallest median speedup over plain decoding that passes (the lower end of its "
                                  "95% interval must also be above 1.0)")
    strict: bool = opt(False, "refuse outputs that part from plain decoding even at a numerical tie (the exact "
                              "rule; right in float32, too strict in bfloat16); a mismatch always fails")
    not_worse_than_previous: bool = opt(True, "a previous draft of the same verifier must not be faster")
    engine: str = opt(OURS, "the engine whose measurement decides: draftsmith (ours), vllm or llama.cpp (it must "
                            "be one of bench.engines)")

    def __post_init__(self) -> None:
        if self.min_speedup <= 0:
            raise DraftsmithError(f"--min-speedup must be > 0, got {self.min_speedup}")
        if self.engine not in ENGINES:
            raise DraftsmithError(f"--engine: expected one of {list(ENGINES)}, got {self.engine!r}")


def choose_k(rows: list[dict[str, Any]], n_resamples: int = 2000, seed: int = 0) -> dict[str, Any] | None:
    """Pick one k of a drafter's bench rows and judge its speedup on prompts that did not pick it.

    Args:
        rows: the drafter's rows of a bench report (one per k), each with ``speedup``
            ``per_prompt`` ratios and the ``prompts`` they belong to.
        n_resamples: bootstrap resamples for the interval.
        seed: bootstrap seed.

    Returns:
        ``{"k", "median", "ci95", "judged_prompts", "selection"}``, or None without rows.
        ``selection`` says how k was chosen; ``judged_prompts`` is 0 when there were too
        few prompts to choose and judge apart.
    """
    rows = [r for r in rows if r["speedup"].get("per_prompt")]
    if not rows:
        return None
    ratio = [{pid: x for pid, x in zip(r["speedup"]["prompts"], r["speedup"]["per_prompt"])} for r in rows]
    if len(rows) == 1:
        chosen, judged, how = 0, list(ratio[0]), "the only k measured"
    else:
        common = [pid for pid in rows[0]["speedup"]["prompts"] if all(pid in m for m in ratio)]
        pick, judged = common[0::2], common[1::2]
        score = [float(np.median([m[pid] for pid in pick])) if pick else 0.0 for m in ratio]
        chosen = max(range(len(rows)), key=lambda i: (score[i], -rows[i]["k"]))
        how = (f"best median speedup on {len(pick)} of {len(common)} prompts (every other one), judged on the "
               f"other {len(judged)}")
    values = [ratio[chosen][pid] for pid in judged]
    if not values:  # one prompt: the numbers that chose k are all there is (the gate refuses them)
        values, how = list(ratio[chosen].values()), how + " (too few prompts to judge apart)"
    return {"k": rows[chosen]["k"], "median": float(np.median(values)),
            "ci95": list(bootstrap_ci(values, n_resamples=n_resamples, seed=seed)),
            "judged_prompts": len(judged), "selection": how}


def summarize_drafter(report: dict[str, Any], label: str, engine: str = OURS) -> dict[str, Any] | None:
    """What the gate needs to know of one drafter of a bench report, as ``engine`` measured it.

    The speedup is :func:`choose_k`'s (k chosen apart from the prompts that judge it);
    output verdicts are summed over all of the drafter's rows (a mismatch at any k is a bug).
    """
    rows = sorted((r for r in report.get("rows", []) if r.get("drafter") == label
                   and r.get("engine", OURS) == engine), key=lambda r: r["k"])
    cfg = report.get("config", {})
    choice = choose_k(rows, cfg.get("bootstrap", 2000), cfg.get("seed", 0))
    if choice is None:
        return None
    chosen = (report.get("k_choice") or {}).get(label)
    if chosen is not None and len(rows) == 1:  # bench --choose-k: one k, chosen on other prompts
        choice["selection"] = (f"chosen before timing by the cost model (predicted "
                               f"{chosen['predicted_speedup'][str(choice['k'])]:.2f}x, the best of k = "
                               f"{', '.join(chosen['predicted_speedup'])}) from a pilot decode on "
                               f"{len(chosen['pilot_prompts'])} prompt(s) that are not judged")
    row = next(r for r in rows if r["k"] == choice["k"])
    outputs = {"identical": 0, "tie": 0, "mismatch": 0}
    judged = [r for r in rows if r.get("outputs")]
    for r in judged:
        for kind in outputs:
            outputs[kind] += r["outputs"][kind]
    be = report.get("break_even", {}).get(label, {}) if engine == OURS else {}
    hf = [r for r in report.get("rows", []) if r["kind"].startswith("hf") and r["tokens_per_second"]["median"]
          and engine == OURS]
    return {"engine": engine, "k": choice["k"], "speedup": choice["median"], "speedup_ci95": choice["ci95"],
            "judged_prompts": choice["judged_prompts"], "k_selection": choice["selection"],
            "acceptance_length": row["acceptance"]["acceptance_length"],
            "per_position_acceptance": row["acceptance"]["per_position_acceptance"],
            # rounds that drafted (< 1 where the draft stopped early, --draft-confidence): the acceptance is theirs
            "drafted_fraction": row["acceptance"].get("drafted_fraction"),
            "identical_output_rate": row["identical_output_rate"],
            "outputs": outputs if judged else None,
            "tokens_per_second": row["tokens_per_second"]["median"],
            "predicted_speedup": be.get("measured", {}).get(str(choice["k"]), {}).get("predicted"),
            "held_back_by": be.get("held_back_by"), "recommended_k": be.get("best_k"),
            "vs_hf": {r["name"]: row["tokens_per_second"]["median"] / r["tokens_per_second"]["median"] for r in hf}}


def gate(candidate: dict[str, Any] | None, previous: dict[str, Any] | None, section: GateSection) -> dict[str, Any]:
    """The deploy verdict on :func:`summarize_drafter` summaries: passed, and every reason."""
    if candidate is None:
        return {"passed": False, "speedup": None, "acceptance_length": None,
                "reasons": ["the draft was not measured (bench produced no row for it)"]}
    reasons: list[str] = []
    s, ci, al = candidate["speedup"], candidate.get("speedup_ci95"), candidate["acceptance_length"]
    outputs = candidate.get("outputs")
    if outputs and outputs["mismatch"]:
        reasons.append(f"greedy outputs leave plain decoding on {outputs['mismatch']} prompt(s) where no rounding "
                       "explains it (a mismatch: a bug, see the bench report)")
    if section.strict:
        diverged = (outputs["tie"] + outputs["mismatch"] if outputs else
                    0 if candidate.get("identical_output_rate") in (None, 1.0) else 1)
        if diverged:
            reasons.append(f"gate.strict: greedy outputs differ from plain decoding on {diverged} prompt(s) "
                           "(ties included)")
    if s < section.min_speedup:
        pct = round(100 * (1 - s))
        slower = f" (it makes decoding {pct}% slower)" if pct > 0 else ""
        reasons.append(f"measured speedup {s:.2f}x is below the gate's {section.min_speedup:.2f}x{slower}")
    judged = candidate.get("judged_prompts") or 0
    if judged < MIN_JUDGED_PROMPTS:
        reasons.append(f"too few prompts to judge a speedup: {judged} judged, at least {MIN_JUDGED_PROMPTS} needed "
                       "(k is chosen on every other prompt when several are measured: bench more prompts, or one k)")
    elif ci is None or ci[0] <= 1.0:
        lo, hi = ci or (float("nan"), float("nan"))
        reasons.append(f"the 95% interval of the speedup [{lo:.2f}, {hi:.2f}] (over {candidate['judged_prompts']} "
                       "prompts) does not exclude 1.0: not shown faster than plain decoding")
    if section.not_worse_than_previous and previous is not None and previous["speedup"] > s:
        reasons.append(f"the previous draft is faster on this verifier ({previous['speedup']:.2f}x vs {s:.2f}x)")
    passed = not reasons
    if passed:
        ties = f", {outputs['tie']} numerical tie(s)" if outputs and outputs["tie"] else ""
        reasons.append(f"measured speedup {s:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}] >= {section.min_speedup:.2f}x at "
                       f"k={candidate['k']} ({candidate.get('k_selection', '')}), greedy outputs equal to plain "
                       f"decoding{ties}")
    return {"passed": passed, "speedup": s, "speedup_ci95": ci, "acceptance_length": al, "k": candidate["k"],
            "outputs": outputs, "reasons": reasons}
