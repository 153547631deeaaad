"""The bench report: one JSON with every number, a one-screen Markdown summary, plots."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from draftsmith.bench.costmodel import (MIN_IN_SITU, DrafterProfile, best_k, break_even_alpha, in_situ_prices,
                                        limiting_term, predict, trimmed_mean)
from draftsmith.bench.measure import (BenchState, RunResult, baseline_index, environment, load_average,
                                      pool_steps, reference_index)
from draftsmith.bench.stats import bootstrap_ci, paired_ratios, pooled_ratio, summarize
from draftsmith.bench.verdict import TIE_ULPS, count_kinds
from draftsmith.config import to_dict
from draftsmith.engines import OURS

if TYPE_CHECKING:
    from draftsmith.bench.run import BenchConfig

PLOTS = ("acceptance.png", "speedup_vs_k.png", "tokens_per_second.png")


def pooled_acceptance(results: list[RunResult], k: int) -> dict[str, Any]:
    """vLLM-style acceptance pooled over runs, plus the draft-length distribution at k."""
    drafts = draft_tokens = 0
    accepted_at = [0] * k
    new_tokens = forwards = 0
    lengths = [0] * (k + 1)
    accepted_total = 0
    for res in results:
        s = res.stats or {}
        d = s.get("drafts", 0)
        drafts += d
        draft_tokens += s.get("draft_tokens", 0)
        for i, p in enumerate(s.get("per_position_acceptance", [])[:k]):
            accepted_at[i] += round(p * d)
        # an engine may report the total only (llama.cpp: no per-position counters)
        accepted_total += s.get("accepted_tokens", round(sum(s.get("per_position_acceptance", [])[:k]) * d))
        new_tokens += s.get("new_tokens", 0)
        forwards += s.get("verifier_forwards", 0)
        for req, got, _ in res.draft_calls:
            if req == k:
                lengths[min(got, k)] += 1
    accepted = accepted_total
    rounds = forwards - len(results)  # the prefill forward emits the first token, not a round
    calls = sum(lengths)
    return {
        "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
        "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "per_position_acceptance": ([a / drafts if drafts else 0.0 for a in accepted_at]
                                    if any(s and s.get("per_position_acceptance") for s in (r.stats for r in results))
                                    else []),
        "tokens_per_round": (new_tokens - len(results)) / rounds if forwards and rounds > 0 else None,
        "drafted_fraction": (calls - lengths[0]) / calls if calls else None,
        "mean_draft_length": (sum(i * c for i, c in enumerate(lengths)) / (calls - lengths[0])
                              if calls - lengths[0] > 0 else 0.0),
        "length_counts": lengths,
    }


def _row_report(state: BenchState, r: int, cfg: BenchConfig) -> dict[str, Any] | None:
    row = state.rows[r]
    done = sorted(p for (rr, p) in state.results if rr == r)
    if not done:
        return None
    b0 = baseline_index(state.rows, r)  # speedups: over full-precision plain decoding
    ref = reference_index(state.rows, r)  # outputs: plain decoding of the same (maybe quantized) verifier
    tps = {p: statistics.median(x.tokens_per_second for x in state.results[(r, p)]) for p in done}
    base = {p: statistics.median(x.tokens_per_second for x in state.results[(b0, p)])
            for p in done if (b0, p) in state.results}
    paired = [p for p in done if p in base]
    runs = [x for p in done for x in state.results[(r, p)]]
    ratios = paired_ratios([tps[p] for p in paired], [base[p] for p in paired])
    def work(i: int, rate: dict[int, float]) -> list[tuple[int, float]]:  # (tokens, seconds at the median rate)
        return [(n, n / rate[p]) for p in paired for n in (len(state.results[(i, p)][0].token_ids),)]

    out: dict[str, Any] = {
        "name": row.name, "kind": row.kind, "drafter": row.drafter, "k": row.k, "engine": row.engine,
        "quant": row.quant, "reference": state.rows[ref].name,
        "tokens_per_second": summarize(list(tps.values())),
        "speedup": {"median": float(np.median(ratios)) if ratios else None,
                    "ci95": list(bootstrap_ci(ratios, n_resamples=cfg.bootstrap, seed=cfg.seed)) if ratios else None,
                    "n": len(ratios), "per_prompt": ratios, "prompts": [state.prompts[p][0] for p in paired],
                    # total throughput over the same prompts: what the cost model's prediction is compared with
                    "pooled": pooled_ratio(work(r, tps), work(b0, base)) if paired else None},
        "identical_output_rate": None, "identical_prompts": None, "outputs": None,
        "peak_rss_bytes": max((x.peak_rss for x in runs if x.peak_rss is not None), default=None),
        "peak_cuda_bytes": max((x.peak_cuda for x in runs if x.peak_cuda is not None), default=None),
        # one-off compile time (--compile): its warm-up run's and any in timed runs (kept out of their timings)
        "compile_seconds": state.warmup_compile_seconds.get(r, 0.0)
        + sum(float((x.stats or {}).get("compile_seconds", 0.0)) for x in runs),
        "engine_path": sorted({str(x.stats["engine"]) for x in runs if x.stats and "engine" in x.stats}),
        # compiled CPU steps: which candidate verified each length, and their timings (runner._CompiledStep._choose)
        "verify_tiers": next((x.stats["verify_tiers"] for x in reversed(runs)
                              if x.stats and x.stats.get("verify_tiers")), {}),
        # a resumed compiled bench: each process times its GEMM paths anew, and may pick others
        "verify_tier_choices": sorted({tuple(sorted((str(m), c.get("tier")) for m, c in x.stats["verify_tiers"].items()))
                                       for x in runs if x.stats and x.stats.get("verify_tiers")}),
        "per_prompt": [{"prompt": state.prompts[p][0], "prompt_tokens": len(state.prompts[p][1]),
                        "new_tokens": len(state.results[(r, p)][0].token_ids),
                        "seconds": [x.seconds for x in state.results[(r, p)]]} for p in done],
    }
    judged = [p for p in done if (ref, p) in state.results]
    if cfg.temperature == 0 and judged:
        same = [p for p in judged if state.results[(r, p)][0].token_ids == state.results[(ref, p)][0].token_ids]
        out["identical_output_rate"] = len(same) / len(judged)
        out["identical_prompts"] = f"{len(same)}/{len(judged)}"
        verdicts = {p: state.verdicts[(r, p)] for p in judged if (r, p) in state.verdicts}
        if verdicts:
            out["outputs"] = {**count_kinds(list(verdicts.values())),
                              "divergences": [{"prompt": state.prompts[p][0], **v.to_dict()}
                                              for p, v in verdicts.items() if v.kind != "identical"]}
    if row.kind == "drafter":
        out["acceptance"] = pooled_acceptance(runs, row.k)
        # the stop rule its rounds drafted under (--draft-confidence); serving engines draft every token
        out["draft_confidence"] = ((state.draft_confidence.get(row.drafter) or {}).get("setting", "off")
                                   if row.engine == OURS else "off")
    if row.quant is not None:
        out["quality"] = _quality(state, r, b0, done)
    return out


def _quality(state: BenchState, r: int, b0: int, done: list[int]) -> dict[str, Any] | None:
    """What a quantized verifier changes against full-precision plain decoding (row ``b0``)."""
    prompts = [p for p in done if (r, p) in state.quality and (b0, p) in state.quality]
    if not prompts:
        return None
    own = [state.quality[(r, p)]["mean_logprob"] for p in prompts]
    ref = [state.quality[(b0, p)]["mean_logprob"] for p in prompts]
    pairs = [(a, b) for a, b in zip(own, ref) if a is not None and b is not None]
    out: dict[str, Any] = {
        "vs": state.rows[b0].name, "prompts": len(prompts),
        # per-prompt means, averaged with equal weight per prompt, on the same prompts for both
        "mean_logprob": statistics.fmean(a for a, _ in pairs) if pairs else None,
        "reference_mean_logprob": statistics.fmean(b for _, b in pairs) if pairs else None,
    }
    if "identical" in state.quality[(r, prompts[0])]:
        firsts = [state.quality[(r, p)]["first_divergence"] for p in prompts]
        diverged = [i for i in firsts if i is not None]
        out.update({
            "identical_prompts": f"{len(prompts) - len(diverged)}/{len(prompts)}",
            "identical_rate": (len(prompts) - len(diverged)) / len(prompts),
            "first_divergence": {"median": statistics.median(diverged) if diverged else None,
                                 "min": min(diverged, default=None), "per_prompt": firsts},
        })
    return out


def _break_even(state: BenchState, rows: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    """Per drafter: predicted speedup for every k, best k, predicted vs measured, the verdict."""
    if state.costs is None:
        return {}
    out: dict[str, Any] = {}
    # the cost model is our engine's, on the full-precision verifier
    ours = [r for r in rows if r.get("engine", OURS) == OURS and r.get("quant") is None]
    for name in dict.fromkeys(r["drafter"] for r in ours if r["kind"] == "drafter"):
        mine = sorted((r for r in ours if r["drafter"] == name), key=lambda r: r["k"])
        basis = mine[-1]  # the longest drafts see the most positions
        acc = basis["acceptance"]
        profile = DrafterProfile(basis["k"], acc["per_position_acceptance"], acc["length_counts"])
        costs = state.drafter_costs(name)
        preds = [predict(profile, costs, k) for k in range(1, max(max(cfg.num_draft_tokens), 8) + 1)]
        best = best_k([p for p in preds if not p.extrapolated] or preds)
        measured = {r["k"]: r for r in mine if r["speedup"]["median"] is not None}
        from_rows = _priced_by_rows(state, name, profile, costs)
        main = max(measured.values(), key=lambda r: r["speedup"]["median"]) if measured else None
        entry: dict[str, Any] = {
            "basis_k": basis["k"], "draft_fixed_seconds": costs.draft_fixed,
            "draft_per_token_seconds": costs.draft_per_token,
            "draft_per_call_seconds": {str(k): v for k, v in state.draft_per_call.get(name, {}).items()},
            # what its rounds pay (in situ where measured, the bare table otherwise): the predictions' prices
            "t_verify_seconds": {str(n): t for n, t in costs.t_verify.items()},
            "verify_in_situ_samples": {str(n): len(v) for n, v in sorted(state.verify_steps.get(name, {}).items())},
            "predicted": [dataclasses.asdict(p) for p in preds],
            "best_k": best.k, "best_k_predicted_speedup": best.speedup,
            "measured": {str(k): {"speedup": r["speedup"]["median"], "ci95": r["speedup"]["ci95"],
                                  "pooled": r["speedup"].get("pooled"),
                                  "predicted": preds[k - 1].speedup if k <= len(preds) else None,
                                  "priced_by_rows": from_rows.get(k, {}).get("speedup"),
                                  # those prices, beside the calibration's for the same round
                                  "rows_prices": {n: v for n, v in from_rows[k].items() if n != "speedup"}
                                  if k in from_rows else None,
                                  "calibration_prices": {"t1": costs.t1, "t_verify": costs.verify(k + 1),
                                                         "propose": costs.draft(k)}}
                         for k, r in measured.items()},
        }
        if main is not None:
            k = main["k"]
            pred = preds[k - 1]
            s = main["speedup"]["median"]
            # the model predicts pooled throughput (pooled acceptance, mean prices): compare like with like
            pooled = main["speedup"].get("pooled") or s
            by_rows = from_rows.get(k, {}).get("speedup")
            entry.update({
                "measured_k": k, "measured_speedup": s,
                "factors": {"ideal": k + 1, "acceptance": pred.acceptance, "verify cost": pred.verify,
                            "draft cost": pred.draft, "engine overhead (measured/predicted)": pooled / pred.speedup,
                            # the same with the prices the timed rows paid: what is left is work between steps
                            "engine overhead at the rows' prices": pooled / by_rows if by_rows else None},
                "held_back_by": limiting_term(pred),
                "meets_target": s >= cfg.target_speedup,
                "below_break_even": s < 1.0,
                "break_even_alpha": break_even_alpha(k, costs.t1, costs.verify(k + 1),
                                                     costs.draft(k) / k),
                "measured_alpha": main["acceptance"]["acceptance_rate"],
            })
        out[name] = entry
    return out


#: The report says the host drifted when the calibrated prediction and the one priced with the
#: timed rows' own steps differ by more than this fraction
DRIFT_NOTE = 0.05


def _priced_by_rows(state: BenchState, name: str, profile: DrafterProfile, costs: Any) -> dict[int, dict[str, Any]]:
    """Drafter ``name``'s speedup at each timed k, predicted as the calibrated one is but with the
    step prices the timed rows themselves paid (CPU rows time their steps): the plain row's
    one-token steps, this row's verify forwards and propose calls, pooled over its prompts.
    Per k: ``{"speedup", "t1", "t_verify", "propose"}`` (seconds; ``t_verify`` of k + 1 tokens).

    Beside the calibrated prediction it separates the two reasons a measurement can miss one:
    a host whose speed drifted between the calibration and the rows (the calibrated one misses,
    this one does not), and work the engine does between its steps (both miss).
    """
    def timed(i: int) -> tuple[list[RunResult], dict[int, list[float]]]:  # row i's runs, its steps by length
        runs = _runs_of(state, i)
        steps: dict[int, list[float]] = {}
        for x in runs:
            pool_steps(steps, (x.stats or {}).get("step_seconds") or {})
        return runs, steps

    plain = _plain_index(state)
    if plain is None:
        return {}
    t1 = timed(plain)[1].get(1, [])
    out: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(state.rows):
        if row.drafter != name or row.quant is not None or row.kind != "drafter" or not row.k:
            continue
        runs, verify = timed(i)
        calls = [s for x in runs for req, _, s in x.draft_calls[1:] if req == row.k and s > 0]
        if not t1 or not verify or not calls:
            continue
        priced = dataclasses.replace(costs, t_verify=in_situ_prices(costs.t_verify, t1, verify),
                                     draft_fixed=trimmed_mean(calls), draft_per_token=0.0)  # what a call paid
        # a round that proposed nothing paid this row's own one-token step (it returns the aux states)
        own_t1 = trimmed_mean(verify[1]) if len(verify.get(1, [])) >= MIN_IN_SITU else None
        out[row.k] = {"speedup": predict(profile, priced, row.k, empty_round=own_t1).speedup, "t1": priced.t1,
                      "t_verify": priced.verify(row.k + 1), "propose": priced.draft(row.k),
                      "t1_own_steps": own_t1, "own_steps": {str(n): len(v) for n, v in sorted(verify.items())},
                      "unpriced_per_round": unpriced_per_round(runs)}
    return out


def unpriced_per_round(runs: list[RunResult]) -> float | None:
    """Mean seconds per round (verifier forward after the prefill) that no timed step or propose call
    holds: the decode loop's own work between steps (accept decision, cache rollback, bookkeeping).
    None where the runs did not time their steps."""
    spent = rounds = 0.0
    for x in runs:
        s = x.stats or {}
        steps = s.get("step_seconds")
        if not steps or "seconds" not in s:
            return None
        loop = s["seconds"] - s.get("prefill_seconds", 0.0)
        spent += loop - sum(map(sum, steps.values())) - sum(c for _, _, c in x.draft_calls)
        rounds += sum(map(len, steps.values()))
    return spent / rounds if rounds else None


def _plain_index(state: BenchState) -> int | None:
    """Our full-precision plain row (the T(1) every prediction divides by)."""
    return next((i for i, r in enumerate(state.rows) if r.kind == "plain" and r.quant is None), None)


def _runs_of(state: BenchState, i: int) -> list[RunResult]:
    return [x for (r, _), xs in state.results.items() if r == i for x in xs]


def _plain_unpriced(state: BenchState) -> float | None:
    runs = _runs_of(state, _plain_index(state))
    return unpriced_per_round(runs) if runs else None


def build_report(state: BenchState, cfg: BenchConfig, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """All numbers of the run as one JSON-ready dict."""
    rows = [r for r in (_row_report(state, i, cfg) for i in range(len(state.rows))) if r is not None]
    c = state.costs
    measured_prompts = {p for (_, p) in state.results}
    return {
        "partial": state.partial, "note": state.note,
        "provenance": dict(provenance or {}),
        "config": to_dict(cfg),
        "environment": environment(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.started)),
        "seconds": state.measuring_seconds(),  # a resumed bench: every attempt's, not the time between them
        "resumed": [{**a, "resumed": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a["resumed"]))}
                    for a in state.attempts],
        "load_average": {"start": state.load_at_start, "end": load_average()},
        "prompts": {"requested": len(state.prompts), "measured": len(measured_prompts),
                    "runs": sum(len(v) for v in state.results.values()),
                    "prompt_tokens": summarize([len(ids) for _, ids in state.prompts])},
        "rows": rows,
        "costs": None if c is None else {
            # the bare table: each length timed alone after context_tokens cached
            "context_tokens": c.context_tokens, "t1_seconds": c.t1,
            "t_verify_seconds": {str(n): t for n, t in c.t_verify.items()},
            # the plain loop's one-token steps, the T(1) every prediction divides by
            "t1_plain_loop_seconds": trimmed_mean(state.plain_steps) if state.plain_steps else None,
            "plain_loop_steps": len(state.plain_steps),
            # the timed plain row's work between its steps, per step (the drafters' is in break_even)
            "plain_unpriced_per_step_seconds": _plain_unpriced(state),
            "compile_seconds": state.costs_compile_seconds},
        "break_even": _break_even(state, rows, cfg),
        "k_choice": state.k_choice,
        "draft_confidence": state.draft_confidence,
        "weight_layout_choice": layout_choice_json(state.layout_choice),
        "engine_agreement": engine_agreement(rows),
        "which_to_choose": which_to_choose(rows, cfg.temperature),
    }


def layout_choice_json(choice: dict[str, Any] | None) -> dict[str, Any] | None:
    """``--weight-layout auto``'s evidence, JSON-ready (step counts as string keys)."""
    if choice is None:
        return None
    return {**choice, "t_seconds": {lay: {str(n): s for n, s in t.items()} for lay, t in choice["t_seconds"].items()}}


def verify_words(rows: list[dict[str, Any]]) -> str | None:
    """One line on the compiled verify steps' GEMM path per length, as timed on this machine (the
    rows' choices merged: one model's steps are shared by its rows)."""
    seen: dict[int, dict[str, Any]] = {}
    for r in rows:
        for m, c in (r.get("verify_tiers") or {}).items():
            seen.setdefault(int(m), c)
    timed = {m: c for m, c in seen.items() if len(c.get("ms", {})) > 1}
    if not timed:
        return None
    parts = [f"{m} tokens: {c['tier']} (" + ", ".join(f"{n} {v:.1f} ms" for n, v in c["ms"].items()) + ")"
             for m, c in sorted(timed.items())]
    return "Compiled verify steps, the faster GEMM path per length as timed here: " + "; ".join(parts) + "."


def layout_words(choice: dict[str, Any] | None) -> str | None:
    """One line on the weight layout ``--weight-layout auto`` chose, and on what evidence."""
    if not choice:
        return None
    t, lay = choice["t_seconds"], choice["layout"]
    if not t:
        return f"Weight layout: {lay} (`--weight-layout auto`: the only one that applies on this device)."
    ns = sorted({int(n) for v in t.values() for n in v} - {1})
    parts = []
    for name, v in t.items():
        verify = (f", verify steps of {' / '.join(map(str, ns))} tokens "
                  + " / ".join(f"{v[str(n)] / v['1']:.2f}x" for n in ns) + " T(1)") if ns else ""
        parts.append(f"{name}: T(1) {_fmt_ms(v['1'])}{verify}")
    return (f"Weight layout: **{lay}**, chosen by `--weight-layout auto` from the verifier's steps timed in each "
            f"(at {choice.get('context_tokens', '?')} cached tokens; fastest one-token step within "
            f"{choice['tie']:.0%}, then the cheapest verify steps): " + "; ".join(parts) + ".")


def _lossless(row: dict[str, Any], temperature: float) -> str:
    """Whether a row's outputs are its reference's (plain decoding of the same verifier), in words."""
    o = row.get("outputs")
    if temperature > 0:
        return "yes (sampling: exact by construction)"
    if o:
        if o["mismatch"]:
            return f"NO: {o['mismatch']} mismatch(es), a bug"
        n = o["identical"] + o["tie"]
        return f"yes ({o['identical']}/{n} identical" + (f", {o['tie']} numerical tie(s))" if o["tie"] else ")")
    return "not checked" if row["identical_output_rate"] is None else f"{row['identical_prompts']} identical"


def _quality_words(q: dict[str, Any] | None) -> str:
    if not q:
        return "-"
    parts = []
    if q.get("identical_prompts") is not None:
        fd = q["first_divergence"]
        parts.append(f"{q['identical_prompts']} outputs identical" + (
            f", first divergence at token {fd['median']:g} (median; earliest {fd['min']})"
            if fd["median"] is not None else ""))
    if q["mean_logprob"] is not None:
        parts.append(f"mean log-prob/token under full precision {q['mean_logprob']:.3f} (its own outputs: "
                     f"{q['reference_mean_logprob']:.3f})")
    return "; ".join(parts) or "-"


def which_to_choose(rows: list[dict[str, Any]], temperature: float) -> list[dict[str, Any]]:
    """The options side by side when quantized rows were measured (else []): full-precision plain,
    each drafter at its best k, each quantization plainly and with each drafter at its best k.

    Speedups are all over full-precision plain decoding; "lossless" is against full precision.
    """
    ours = [r for r in rows if r.get("engine", OURS) == OURS]
    if not any(r.get("quant") for r in ours):
        return []

    def best(group: list[dict[str, Any]]) -> list[dict[str, Any]]:
        by: dict[str, dict[str, Any]] = {}
        for r in group:
            cur = by.get(r["drafter"])
            if r["speedup"]["median"] is not None and (cur is None or r["speedup"]["median"] > cur["speedup"]["median"]):
                by[r["drafter"]] = r
        return list(by.values())

    out = []
    plain = next(r for r in ours if r["kind"] == "plain")
    out.append({"option": "plain", "row": plain["name"], "speedup": 1.0, "lossless": "yes (the reference)",
                "quality": "none"})
    for r in best([r for r in ours if r["kind"] == "drafter" and r.get("quant") is None]):
        lossless = _lossless(r, temperature)
        out.append({"option": "draft", "row": r["name"], "speedup": r["speedup"]["median"], "lossless": lossless,
                    "quality": "none" if lossless.startswith("yes") else "see the verdicts above"})
    for quant in dict.fromkeys(r["quant"] for r in ours if r.get("quant")):
        q = next((r for r in ours if r["kind"] == "quantized" and r["quant"] == quant), None)
        if q is None:  # a partial report without this quantization's plain row
            continue
        ident = (q.get("quality") or {}).get("identical_prompts")
        out.append({"option": "quantized", "row": q["name"], "speedup": q["speedup"]["median"],
                    "lossless": f"no ({ident} identical)" if ident else "no", "quality": _quality_words(q.get("quality"))})
        for r in best([r for r in ours if r["kind"] == "drafter" and r.get("quant") == quant]):
            ident = (r.get("quality") or {}).get("identical_prompts")
            out.append({"option": "quantized + draft", "row": r["name"], "speedup": r["speedup"]["median"],
                        "lossless": (f"no ({ident} identical)" if ident else "no")
                                    + f"; vs {q['name']}: {_lossless(r, temperature)}",
                        "quality": _quality_words(r.get("quality"))})
    return out


def engine_agreement(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per drafter and k, our engine's acceptance next to each serving engine's own counters.

    ``ratio`` is the serving engine's acceptance length over ours (1.0: they agree); the
    target is within 10%. Per position where the engine reports it (vLLM does, llama.cpp not).

    Ours is the row of the same draft and k that drafted under the same rule: a serving engine
    drafts every token, so where our row of that label stops early (``--draft-confidence auto``)
    its ``LABEL~off`` row is the one compared (the bench adds it when a serving engine is measured).
    """
    def rule(x: dict[str, Any]) -> str:
        return x.get("draft_confidence") or "off"

    out = []
    for r in rows:
        if r.get("engine", OURS) == OURS or r["kind"] != "drafter" or not r.get("acceptance"):
            continue
        same = [x for x in rows if x.get("engine", OURS) == OURS and x["k"] == r["k"] and x.get("acceptance")
                and x["drafter"] is not None and x["drafter"].split("~")[0] == r["drafter"] and rule(x) == rule(r)]
        mine = next((x for x in same if x["drafter"] == r["drafter"]), same[0] if same else None)
        if mine is None:
            continue
        a, b = mine["acceptance"], r["acceptance"]
        out.append({"engine": r["engine"], "drafter": r["drafter"], "k": r["k"], "ours_row": mine["name"],
                    "acceptance_length": {"ours": a["acceptance_length"], "engine": b["acceptance_length"]},
                    "ratio": b["acceptance_length"] / a["acceptance_length"],
                    "per_position": {"ours": a["per_position_acceptance"], "engine": b["per_position_acceptance"]}})
    return out


def _fmt_bytes(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _fmt_outputs(row: dict[str, Any]) -> str:
    if row["kind"] == "plain":
        return "ref"
    if row["kind"] == "quantized":  # the reference of its drafter rows; its change is in "Which to choose"
        ident = (row.get("quality") or {}).get("identical_prompts")
        return "ref" + (f" ({ident} as full precision)" if ident else "")
    o = row.get("outputs")
    if o:
        return f"{o['identical']} / {o['tie']} / {o['mismatch']}"
    return "n/a" if row["identical_output_rate"] is None else f"{row['identical_prompts']} identical"


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def render_markdown(report: dict[str, Any]) -> str:
    """A table and a few lines a person reads in 10 seconds (well under one screen)."""
    cfg, prov, env = report["config"], report["provenance"], report["environment"]
    temp = "greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']}"
    isa = f", {env['cpu_isa']}" if env.get("cpu_isa") else ""
    device = env.get("cuda") or f"{env.get('cpu_model') or env.get('processor')}{isa} ({env.get('torch_threads')} threads)"
    lines = [f"# draftsmith bench: {prov.get('verifier', '?')} on {prov.get('dataset', cfg['dataset'])}", "",
             f"{report['prompts']['measured']}"
             + (f" of {report['prompts']['requested']}" if report["prompts"]["measured"] < report["prompts"]["requested"]
                else "") + f" prompts x {cfg['max_new_tokens']} new tokens, {temp}, "
             f"{cfg['repeats']} repeat(s); {device}, {prov.get('dtype', '?')}"
             + (", compiled steps (compile time kept out)" if prov.get("compile") else "")
             + f"; verifier {prov.get('fingerprint', '?')}"]
    load, cpus = report["load_average"]["start"], env.get("cpu_count") or 1
    if load is not None and load > 0.25 * cpus:
        lines += ["", f"Note: the machine was busy at the start (load {load:.1f} on {cpus} CPUs); "
                      "timings may be noisy."]
    n_prompts = report["prompts"]["requested"]
    for a in report.get("resumed") or []:
        resized = a.get("resized")
        kept = (f"{n_prompts} prompts" if cfg["repeats"] == 1 else
                f"{n_prompts * cfg['repeats']} prompt passes ({n_prompts} prompts x {cfg['repeats']} repeats)")
        lines += ["", (f"Resumed at {a['resumed']} after an interruption" if resized is None else
                       f"Extended at {a['resumed']} from a{' finished' if resized['complete'] else 'n interrupted'}"
                       f" bench of {resized['prompts'][0]} prompts x {resized['repeats'][0]} repeat(s)")
                  + ": the step costs"
                  + (", the weight layout" if prov.get("weight_layout_asked") == "auto" else "")
                  + (", the chosen k" if report.get("k_choice") else "")
                  + f" and every row's timings of the first {a['units_done']} of {kept} come from before it"
                  + (f" (load {a['load']:.1f} at the restart)" if a.get("load") is not None else "") + "."]
    if report["partial"]:
        lines += ["", f"**PARTIAL REPORT: {report['note']} after {report['prompts']['runs']} runs "
                      f"({report['prompts']['measured']}/{report['prompts']['requested']} prompts).**"]
    cuda = any(r["peak_cuda_bytes"] for r in report["rows"])
    lines += ["", "| row | tok/s median [IQR] | speedup [95% CI] | acc. length | acc. rate | "
                  f"outputs: identical / tie / mismatch | peak {'CUDA reserved' if cuda else 'RSS'} |",
              "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        t, s, acc = r["tokens_per_second"], r["speedup"], r.get("acceptance")
        speed = "1.00x (baseline)" if r["kind"] == "plain" else (
            f"{s['median']:.2f}x [{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}]" if s["median"] is not None else "-")
        lines.append(f"| {r['name']} | {t['median']:.1f} [{t['p25']:.1f}-{t['p75']:.1f}] | {speed} | "
                     + (f"{acc['acceptance_length']:.2f} | {acc['acceptance_rate']:.2f}" if acc else "- | -")
                     + f" | {_fmt_outputs(r)} | {_fmt_bytes(r['peak_cuda_bytes'] if cuda else r['peak_rss_bytes'])} |")
    for r in report["rows"]:
        o = r.get("outputs")
        if not o or not (o["tie"] or o["mismatch"]):
            continue
        worst = max((d for d in o["divergences"] if d["kind"] == "tie"), key=lambda d: d["margin"], default=None)
        if o["mismatch"]:
            first = next(d for d in o["divergences"] if d["kind"] == "mismatch")
            lines += ["", f"**MISMATCH: {r['name']} leaves {r['reference']} on {o['mismatch']} prompt(s) where no "
                          f"rounding explains it (first: prompt {first['prompt']}, {first['reason']}). This is a "
                          "bug in the decoding, not a numerical tie.**"]
        if worst is not None:
            why = ("HF's forward (its attention kernel, its prefill) rounds differently from ours"
                   if r["kind"] == "hf-generate" else
                   "verifying several tokens at once rounds differently from one at a time")
            lines += ["", f"Note: {r['name']} parts from {r['reference']} at a numerical tie on {o['tie']} prompt(s) "
                          f"(largest margin {worst['margin']:.3g}, float32 {worst['margin_float32']:.3g}, tolerance "
                          f"{worst['tolerance']:.3g} = {TIE_ULPS:g} ulps of {prov.get('dtype', '?')}): {why}; "
                          "identical up to ties."]
    layout = layout_words(report.get("weight_layout_choice"))
    if layout:
        lines += ["", layout]
    verify = verify_words(report["rows"])
    if verify:
        lines += ["", verify]
    varied = [r["name"] for r in report["rows"] if len(r.get("verify_tier_choices") or []) > 1]
    if varied:
        lines += ["", "Note: the compiled verify steps took other GEMM paths after the resume than before it in "
                      f"{', '.join(varied)} (each process times them anew): those rows' timings mix both."]
    costs = report["costs"]
    if costs:
        tv = costs["t_verify_seconds"]
        kk = max(cfg["num_draft_tokens"]) + 1
        t1 = costs.get("t1_plain_loop_seconds")
        lines += ["", f"## Break-even (T(1) = {_fmt_ms(t1 if t1 is not None else costs['t1_seconds'])}"
                      + (" in the plain loop" if t1 is not None else "")
                      + f"; bare steps at {costs['context_tokens']} cached tokens: T(1) = "
                      f"{_fmt_ms(costs['t1_seconds'])}, T_verify({kk}) = {_fmt_ms(tv[str(kk)])}; each drafter's "
                      "rounds priced with the verify forwards of its own decodes)", ""]
    for name, c in (report.get("k_choice") or {}).items():
        preds = ", ".join(f"{s:.2f}x at k={k}" for k, s in c["predicted_speedup"].items())
        lines.append(f"- **{name}**: k = {c['k']} chosen before timing (`--choose-k`): predicted {preds}, from a "
                     f"pilot decode at k={c['pilot_k']} on prompt(s) {', '.join(c['pilot_prompts'])} (not timed "
                     f"or judged; acceptance length {c['acceptance_length']:.2f}) and the step costs above.")
    for name, c in (report.get("draft_confidence") or {}).items():
        if c["setting"] != "off":
            lines.append(f"- **{name}** stops drafting where its cumulative confidence falls below "
                         + "/".join(f"{t:.2f}" for t in c["thresholds"]) + " (token 1/2/...; "
                         + ("`--draft-confidence auto`: what verifying one more token costs over T(1), from the "
                            "step prices above)." if c["setting"] == "auto" else f"`--draft-confidence {c['setting']}`)."))
    for name, be in report["break_even"].items():
        if "measured_speedup" not in be:
            continue
        k, s, f = be["measured_k"], be["measured_speedup"], be["factors"]
        pred = be["measured"][str(k)]["predicted"]
        lo, hi = be["measured"][str(k)].get("ci95") or (None, None)
        if lo is not None and lo <= 1.0 <= hi:  # the interval cannot tell it from plain decoding
            head = f"no measurable effect ({s:.2f}x [{lo:.2f}-{hi:.2f}] at k={k})"
        elif be["below_break_even"]:
            head = f"this draft makes decoding slower by {100 * (1 - s):.0f}% ({s:.2f}x at k={k})"
        else:
            head = f"{s:.2f}x at k={k}"
        by_rows = be["measured"][str(k)].get("priced_by_rows")
        pooled = be["measured"][str(k)].get("pooled")
        line = (f"- **{name}**: {head}, predicted {pred:.2f}x"
                + (f" ({by_rows:.2f}x with the step prices the timed rows paid)" if by_rows else "")
                + (f" for {pooled:.2f}x measured over all prompts pooled" if pooled else "")
                + f"; best predicted k = {be['best_k']} ({be['best_k_predicted_speedup']:.2f}x). ")
        if by_rows and abs(pred / by_rows - 1) > DRIFT_NOTE:
            c, r = be["measured"][str(k)].get("calibration_prices"), be["measured"][str(k)].get("rows_prices")
            ratio = (f" (T(1) {1e3 * c['t1']:.1f} ms in the calibration, {1e3 * r['t1']:.1f} ms in the rows; "
                     f"T_verify({k + 1}) / T(1): {c['t_verify'] / c['t1']:.2f} in the calibration, "
                     f"{r['t_verify'] / r['t1']:.2f} in the rows)") if c and r else ""
            line += (f"The calibration's step prices and the timed rows' differ by {100 * abs(pred / by_rows - 1):.0f}%"
                     f"{ratio}: the machine's speed changed between them, so the prediction before timing (and a k "
                     "chosen with it) rests on prices the rows did not pay. ")
        acc = next(r for r in report["rows"] if r["drafter"] == name and r["k"] == k
                   and r.get("engine", OURS) == OURS)["acceptance"]
        if acc["drafted_fraction"] is not None and acc["drafted_fraction"] < 0.999:
            line += (f"Drafted in {100 * acc['drafted_fraction']:.0f}% of rounds "
                     f"(mean length {acc['mean_draft_length']:.1f}). ")
        line += (f"Ideal {f['ideal']}x x acceptance {f['acceptance']:.2f} x verify cost {f['verify cost']:.2f} "
                 f"x draft cost {f['draft cost']:.2f}; held back by **{be['held_back_by']}**")
        if not be["meets_target"]:
            ba = be["break_even_alpha"]
            line += f"; target {cfg['target_speedup']:.2f}x missed"
            # The alpha form assumes k tokens every round; skip it for drafters that often propose fewer.
            if acc["drafted_fraction"] is None or acc["drafted_fraction"] >= 0.999:
                line += (f"; break-even needs alpha >= {ba:.2f}, measured {be['measured_alpha']:.2f}" if ba
                         else "; even perfect acceptance cannot pay for this draft cost" if ba is None else "")
        for bound, what in ((1.0, "plain decoding"), (cfg["target_speedup"], "the target")):
            if lo is not None and lo <= bound <= hi and not report["partial"]:
                line += (f"; its interval holds {what} ({bound:.2f}x): a larger `--num-prompts` with the same "
                         "`--out` times only the prompts added and keeps these")
                break
        lines.append(line + ".")
    agree = report.get("engine_agreement") or []
    if agree:
        lines += ["", "## Acceptance where it is served (the engine's own counters vs ours)", ""]
        for a in agree:
            pos = a["per_position"]["engine"]
            label = f"{a['drafter']} k={a['k']}"
            other = a.get("ours_row") not in (None, label)  # ours under another label (its off row)
            lines.append(f"- **{a['engine']}** {label}: acceptance length "
                         f"{a['acceptance_length']['engine']:.2f} vs ours {a['acceptance_length']['ours']:.2f} "
                         + (f"(our row {a['ours_row']}) " if other else "") +
                         f"({100 * (a['ratio'] - 1):+.0f}%; target within 10%)"
                         + (f"; per position {' '.join(f'{x:.2f}' for x in pos)}" if pos else ""))
    lines += ["", ("Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS) + ". " if report["rows"] else "")
              + "All numbers: report.json."]  # (no rows, no plots: write_report)
    choose = report.get("which_to_choose") or []
    if choose:
        lines += ["", "## Which to choose (speedup over full-precision plain decoding)", "",
                  "| option | row | speedup | lossless vs full precision? | quality change |", "|---|---|---|---|---|"]
        lines += [f"| {c['option']} | {c['row']} | "
                  + ("-" if c["speedup"] is None else f"{c['speedup']:.2f}x") + f" | {c['lossless']} | {c['quality']} |"
                  for c in choose]
    return "\n".join(lines) + "\n"


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Per-position acceptance, speedup vs k (predicted and measured), tokens/s per row."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    written = []
    drafters = report["break_even"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    title_tail = f"({report['provenance'].get('verifier', '')}, {report['provenance'].get('dataset', '')})"

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, name in enumerate(dict.fromkeys(r["drafter"] for r in report["rows"] if r["kind"] == "drafter")):
        row = max((r for r in report["rows"] if r["drafter"] == name), key=lambda r: r["k"])
        pos = row["acceptance"]["per_position_acceptance"]
        ax.plot(range(1, len(pos) + 1), pos, "o-", color=colors[i % len(colors)], label=f"{name} (k={row['k']})")
    ax.set(xlabel="draft position i", ylabel="acceptance at position i [fraction of drafts]",
           title=f"Per-position acceptance {title_tail}", ylim=(0, 1.05))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    written.append(out_dir / PLOTS[0])
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, be) in enumerate(drafters.items()):
        color = colors[i % len(colors)]
        pred = be["predicted"]
        inside = [p for p in pred if not p["extrapolated"]]
        outside = [p for p in pred if p["extrapolated"]]
        ax.plot([p["k"] for p in inside], [p["speedup"] for p in inside], "--", color=color,
                label=f"{name} predicted (best k={be['best_k']}: *)")
        if outside:  # beyond the measured k: acceptance continued geometrically
            tail = inside[-1:] + outside
            ax.plot([p["k"] for p in tail], [p["speedup"] for p in tail], ":", color=color)
        ax.plot([be["best_k"]], [be["best_k_predicted_speedup"]], "*", ms=12, color=color)
        m = be["measured"]
        if m:
            mk = sorted(int(k) for k in m)
            med = [m[str(k)]["speedup"] for k in mk]
            err = [[med[j] - m[str(k)]["ci95"][0] for j, k in enumerate(mk)],
                   [m[str(k)]["ci95"][1] - med[j] for j, k in enumerate(mk)]]
            ax.errorbar(mk, med, yerr=err, fmt="o", color=color, capsize=3, label=f"{name} measured (95% CI)")
    ax.axhline(1.0, color="gray", lw=1, label="break-even (plain decoding)")
    ax.set(xlabel="draft length k [tokens]  (dotted: extrapolated beyond the measured k)",
           ylabel="speedup over plain decoding [x]", title=f"Speedup vs draft length {title_tail}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    written.append(out_dir / PLOTS[1])
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 0.9 + 0.45 * max(len(rows), 1)))
    med = [r["tokens_per_second"]["median"] for r in rows]
    err = [[m - r["tokens_per_second"]["p25"] for m, r in zip(med, rows)],
           [r["tokens_per_second"]["p75"] - m for m, r in zip(med, rows)]]
    kind_color = {"plain": "gray", "drafter": colors[0], "hf-generate": colors[1], "hf-prompt-lookup": colors[1],
                  "quantized": colors[2]}
    ax.barh(range(len(rows)), med, xerr=err, capsize=3, color=[kind_color[r["kind"]] for r in rows])
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows])
    ax.invert_yaxis()
    if rows and rows[0]["kind"] == "plain":
        ax.axvline(med[0], color="gray", ls="--", lw=1)
    from matplotlib.patches import Patch

    for y, m in enumerate(med):
        ax.annotate(f"{m:.1f}", (m, y), xytext=(4, 4), textcoords="offset points", fontsize="small")
    ax.set_xlim(0, max(r["tokens_per_second"]["p75"] for r in rows) * 1.15)
    handles = [Patch(color="gray", label="plain (ours)"), Patch(color=colors[0], label="drafters (ours)"),
               Patch(color=colors[1], label="HF transformers")]
    if any(r["kind"] == "quantized" for r in rows):
        handles.append(Patch(color=colors[2], label="quantized verifier"))
    ax.legend(handles=handles, fontsize="small", ncol=len(handles),
              loc="upper center", bbox_to_anchor=(0.5, -0.22 - 0.3 / max(len(rows), 1)))
    ax.set(xlabel="throughput [tokens/s], median over prompts (whiskers: IQR)", title=f"Tokens/s {title_tail}")
    ax.grid(axis="x", alpha=0.3)
    written.append(out_dir / PLOTS[2])
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return written


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """report.json (everything), report.md (one screen) and the PNG plots under ``out_dir``."""
    from draftsmith.utils import atomic_write_bytes, atomic_write_json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "report.json", report)
    if report["rows"]:
        write_plots(report, out_dir)
    atomic_write_bytes(out_dir / "report.md", render_markdown(report).encode())
