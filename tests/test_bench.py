"""Tests of the benchmark: arithmetic with known answers, and tiny end-to-end runs."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from draftsmith.bench import BenchConfig, benchmark
from draftsmith.bench import costmodel, measure, report as bench_report
from draftsmith.bench.costmodel import (CostModel, DrafterProfile, best_k, break_even_alpha, expected_tokens,
                                        limiting_term, predict, predicted_speedup)
from draftsmith.bench.measure import Row, timed_run
from draftsmith.bench.stats import bootstrap_ci, paired_ratios, pooled_ratio, summarize
from draftsmith.decoding.proposers import DraftModelProposer, NgramProposer, Proposal, Proposer
from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # exact token budgets: never stop early
    model.generation_config.pad_token_id = 0
    return model


def _prompts(n: int, length: int = 12) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    # a repeated half gives the n-gram drafter something to find
    return [(f"p{i}", torch.randint(3, 128, (length // 2,), generator=g).tolist() * 2) for i in range(n)]


def _cfg(tmp_path: Path, **kw) -> BenchConfig:
    base = dict(verifier="tiny", out=tmp_path, drafter=["ngram"], num_prompts=2, max_new_tokens=10,
                num_draft_tokens=[2], warmup_tokens=4, bootstrap=200, progress=False)
    base.update(kw)
    return BenchConfig(**base)


# ----------------------------------------------------------------------------- acceptance
def test_perfect_drafter_reports_acceptance_length_k_plus_1(tiny):
    """The verifier drafting for itself is always accepted: every round emits k + 1 tokens."""
    k, m = 3, 4
    row = Row("self", "drafter", tiny, drafter="self", k=k, proposer=DraftModelProposer(tiny))
    results = [timed_run(row, torch.tensor(ids), 1 + m * (k + 1), 0.0, seed=0) for _, ids in _prompts(2)]
    acc = bench_report.pooled_acceptance(results, k)
    assert acc["acceptance_length"] == k + 1
    assert acc["acceptance_rate"] == 1.0
    assert acc["per_position_acceptance"] == [1.0] * k
    assert acc["tokens_per_round"] == k + 1
    assert acc["length_counts"] == [0, 0, 0, 2 * m]
    assert acc["drafted_fraction"] == 1.0


# ----------------------------------------------------------------------------- break-even
def test_expected_tokens_closed_form():
    # alpha = 0.6, k = 4: E = (1 - 0.6^5) / (1 - 0.6) = (1 - 0.07776) / 0.4 = 2.3056
    assert expected_tokens(4, alpha=0.6) == pytest.approx(2.3056, abs=1e-12)
    assert expected_tokens(4, alpha=1.0) == 5.0
    assert expected_tokens(4, alpha=0.0) == 1.0
    # per-position form: E = 1 + 0.8 + 0.6 + 0.3 = 2.7; truncated at k = 2: 2.4
    assert expected_tokens(3, per_position=[0.8, 0.6, 0.3]) == pytest.approx(2.7)
    assert expected_tokens(2, per_position=[0.8, 0.6, 0.3]) == pytest.approx(2.4)
    # beyond the measured positions the last ratio (0.3 / 0.6 = 0.5) continues: + 0.15 + 0.075
    assert expected_tokens(5, per_position=[0.8, 0.6, 0.3]) == pytest.approx(2.925)
    # per-position P(first i accepted) = alpha^i reproduces the alpha form
    assert expected_tokens(4, per_position=[0.6 ** i for i in range(1, 5)]) == pytest.approx(2.3056)
    with pytest.raises(ValueError):
        expected_tokens(4)


def test_predicted_speedup_closed_form():
    # S = E T(1) / (T_verify(5) + 4 T_draft) = 2.3056 * 40 ms / (50 ms + 4 * 4 ms) = 92.224 / 66 = 1.397333...
    e = expected_tokens(4, alpha=0.6)
    assert predicted_speedup(e, 4, t1=0.040, t_verify=0.050, t_draft=0.004) == pytest.approx(1.3973333333, rel=1e-9)
    # a free draft and a free verify make S = E
    assert predicted_speedup(e, 4, 1.0, 1.0, 0.0) == pytest.approx(2.3056)


def test_predict_full_drafts_equals_closed_form_and_factors_multiply():
    k = 4
    costs = CostModel({1: 0.040, 5: 0.050}, draft_fixed=0.0, draft_per_token=0.004)
    profile = DrafterProfile(k, [0.6 ** i for i in range(1, k + 1)], [0, 0, 0, 0, 100])
    p = predict(profile, costs, k)
    assert p.speedup == pytest.approx(1.3973333333, rel=1e-9)
    assert p.tokens_per_round == pytest.approx(2.3056)
    assert p.seconds_per_round == pytest.approx(0.066)
    assert (k + 1) * p.acceptance * p.verify * p.draft == pytest.approx(p.speedup)
    assert p.acceptance == pytest.approx(2.3056 / 5)
    assert p.verify == pytest.approx(0.040 / 0.050)
    assert p.draft == pytest.approx(0.050 / 0.066)
    assert limiting_term(p) == "acceptance"
    assert not p.extrapolated and predict(profile, costs, 6).extrapolated


def test_predict_partial_drafts_like_ngram():
    # Half the rounds find no match (0 tokens), half propose k = 2 tokens with P(first i) = 0.5, 0.25.
    # T_verify(n) = 1 + 0.1 (n - 1) s; a propose call costs 0.01 s whatever it finds.
    costs = CostModel({1: 1.0, 2: 1.1, 3: 1.2}, draft_fixed=0.01, draft_per_token=0.0)
    profile = DrafterProfile(2, [0.5, 0.25], [50, 0, 50])
    p = predict(profile, costs, 2)
    # tokens/round = 1 + 0.5 (0.5 + 0.25) = 1.375; s/round = 0.5*1.0 + 0.5*1.2 + 0.01 = 1.11
    assert p.tokens_per_round == pytest.approx(1.375)
    assert p.seconds_per_round == pytest.approx(1.11)
    assert p.speedup == pytest.approx(1.375 / 1.11)
    # at k = 1 the drafts are cut to 1 token: 1 + 0.5 * 0.5 = 1.25 tokens, 0.5*1.0 + 0.5*1.1 + 0.01 = 1.06 s
    assert predict(profile, costs, 1).speedup == pytest.approx(1.25 / 1.06)


def test_break_even_alpha_and_best_k():
    # T(1) = 1, T_verify(3) = 1.2, T_draft = 0.1, k = 2: need E = 1.4 = 1 + a + a^2 -> a = (sqrt(2.6) - 1) / 2
    assert break_even_alpha(2, 1.0, 1.2, 0.1) == pytest.approx((math.sqrt(2.6) - 1) / 2, abs=1e-9)
    assert break_even_alpha(2, 1.0, 2.5, 0.5) is None  # needs 3.5 > k + 1 tokens per forward
    assert break_even_alpha(2, 1.0, 0.8, 0.0) == 0.0   # verifying 3 tokens is cheaper than 1
    costs = CostModel({n: 1.0 + 0.05 * (n - 1) for n in range(1, 10)}, draft_per_token=0.02)
    profile = DrafterProfile(8, [0.7 ** i for i in range(1, 9)], [0] * 8 + [10])
    preds = [predict(profile, costs, k) for k in range(1, 9)]
    closed = [expected_tokens(k, alpha=0.7) / (1 + 0.05 * k + 0.02 * k) for k in range(1, 9)]
    assert [p.speedup for p in preds] == pytest.approx(closed)
    assert best_k(preds).k == int(np.argmax(closed)) + 1


# ----------------------------------------------------------------------------- statistics
def test_paired_ratio_and_bootstrap_known_answers():
    plain_s = [1.0, 4.0, 0.5, 9.0, 2.5]
    assert paired_ratios([2 / s for s in plain_s], [1 / s for s in plain_s]) == [2.0] * 5
    assert bootstrap_ci([2.0] * 7) == (2.0, 2.0)
    assert bootstrap_ci([3.5]) == (3.5, 3.5)
    # the median of a resample of {1, 2} is 1, 1.5 or 2 w.p. 1/4, 1/2, 1/4: its 2.5/97.5 percentiles are 1 and 2
    assert bootstrap_ci([1.0, 2.0], seed=3) == (1.0, 2.0)
    # the 95% interval of a mean of n normal draws is close to mean +- 1.96 sd / sqrt(n)
    x = np.random.default_rng(0).normal(10.0, 2.0, 400)
    lo, hi = bootstrap_ci(x, statistic=np.mean, n_resamples=4000)
    half = 1.96 * x.std(ddof=1) / math.sqrt(x.size)
    assert lo == pytest.approx(x.mean() - half, abs=0.05) and hi == pytest.approx(x.mean() + half, abs=0.05)
    assert bootstrap_ci(x, seed=5) == bootstrap_ci(x, seed=5)  # seeded: reproducible
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])
    assert summarize([1, 2, 3, 4, 5]) == {"median": 3.0, "p25": 2.0, "p75": 4.0, "min": 1.0, "max": 5.0, "n": 5}


def test_pooled_ratio_weighs_prompts_by_time():
    """Total throughput over the prompts: known answers, and the median of per-prompt ratios as its control."""
    plain = [(100, 4.0), (100, 4.0), (100, 4.0)]
    assert pooled_ratio([(100, 2.0)] * 3, plain) == pytest.approx(2.0)
    # different token counts per row (a quantized verifier's replies) pool as throughputs: 330/6 over 300/12
    assert pooled_ratio([(110, 2.0)] * 3, plain) == pytest.approx(2.2)
    # two prompts 1.25x faster, one (a long, slow reply) 0.5x: the median says 1.25x, the total time 0.8x
    plain = [(100, 1.0), (100, 1.0), (100, 8.0)]
    drafted = [(100, 0.8), (100, 0.8), (100, 16.0)]
    assert float(np.median(paired_ratios([t / s for t, s in drafted], [t / s for t, s in plain]))) == pytest.approx(1.25)
    assert pooled_ratio(drafted, plain) == pytest.approx(10.0 / 17.6)
    with pytest.raises(ValueError):
        pooled_ratio([(1, 1.0)], [])


def test_unpaired_ratio_is_a_negative_control():
    """Prompts differ 20x in speed; the drafter is exactly 2x on each. Pairing sees it; shuffling does not."""
    rng = np.random.default_rng(0)
    plain_tps = np.exp(rng.uniform(0, 3, 30))
    spec_tps = 2 * plain_tps
    paired = paired_ratios(spec_tps, plain_tps)
    assert bootstrap_ci(paired) == pytest.approx((2.0, 2.0))
    shuffled = paired_ratios(rng.permutation(spec_tps), plain_tps)
    lo, hi = bootstrap_ci(shuffled)
    assert hi - lo > 1.0
    assert max(abs(r - 2.0) for r in shuffled) > 2.0


# ----------------------------------------------------------------------------- end to end (tiny)
class _WrongDrafter(Proposer):
    """Drafts tokens the verifier almost never picks; raises KeyboardInterrupt at call ``stop_at``."""

    def __init__(self, stop_at: int | None = None, stop: type[KeyboardInterrupt] = KeyboardInterrupt) -> None:
        self.calls, self.stop_at, self.stop = 0, stop_at, stop

    def propose(self, ctx, k, sampling, generator):
        self.calls += 1
        if self.stop_at is not None and self.calls >= self.stop_at:
            raise self.stop
        return Proposal((ctx.tokens[-1] + 1 + torch.arange(k)) % 128)


@pytest.mark.parametrize("layout", ["onednn", "cpp"])
def test_tiny_run_with_switched_linears_is_lossless_and_puts_the_modules_back(tiny, tmp_path, layout):
    """--weight-layout onednn / cpp: every row still reproduces plain decoding (both multiply through
    the same kernel), the report says so, and the verifier's Linear modules are plain again after."""
    from draftsmith.models import cpu_linear

    if layout == "cpp" and not cpu_linear.available():
        pytest.skip("no C++ toolchain to build the kernel")
    cfg = _cfg(tmp_path, num_draft_tokens=[2, 3], weight_layout=layout)
    report = benchmark(tiny, _prompts(2), {"ngram": NgramProposer(), "perfect": DraftModelProposer(tiny)}, cfg,
                       tmp_path, {"verifier": "tiny", "dataset": "synthetic"})
    assert report["provenance"]["weight_layout"] == layout
    for r in report["rows"]:
        assert r["identical_output_rate"] == 1.0, r["name"]
    assert all(type(m) is torch.nn.Linear for m in tiny.modules() if isinstance(m, torch.nn.Linear))


def test_int8_eagle3_draft_in_the_cpp_layout_runs_the_int8_kernel_and_stays_lossless(tiny, tmp_path, monkeypatch):
    """--draft-precision int8 --weight-layout cpp: the int8 draft's step layers multiply through the
    kernel's int8 form during the bench (counted), every row reproduces plain decoding, and the
    draft's layers are ATen's int8 layers again after."""
    from draft_factory import random_draft
    from draftsmith.decoding.proposers import Eagle3Proposer
    from draftsmith.models import cpu_linear
    from draftsmith.models.quantize import Int8WeightLinear
    from draftsmith.models.verifier import CppInt8WeightLinear

    if not cpu_linear.available():
        pytest.fail("the few-row kernel does not build here")
    calls: list[tuple[torch.nn.Module, torch.Size]] = []
    forward = CppInt8WeightLinear.forward
    monkeypatch.setattr(CppInt8WeightLinear, "forward",
                        lambda self, x: calls.append((self, x.shape)) or forward(self, x))
    prop = Eagle3Proposer(random_draft(tiny, vd=64, aux_layer_ids=[0, 1, 1]))
    cfg = _cfg(tmp_path, num_draft_tokens=[2], weight_layout="cpp", draft_precision=["int8"],
               draft_confidence=["off"])
    report = benchmark(tiny, _prompts(2), {"eagle3:d": prop}, cfg, tmp_path, {"verifier": "tiny", "dataset": "synthetic"})
    assert report["provenance"]["weight_layout"] == "cpp" and report["provenance"]["draft_precision"] == ["int8"]
    assert [r["identical_output_rate"] for r in report["rows"]] == [1.0] * len(report["rows"])
    layers = {id(m): m for m, _ in calls}
    assert len(layers) == 8  # the int8 draft's step layers: q, k, v, o, gate, up, down, lm_head
    assert sum(shape[:-1].numel() <= cpu_linear.MAX_ROWS for _, shape in calls) > 8 * 4  # steps, not only prefills
    assert all(type(m) is Int8WeightLinear for m in layers.values())  # put back after the bench


def test_pick_layout_keeps_the_fastest_plain_step_and_breaks_ties_by_verify_cost():
    """--weight-layout auto: plain decoding (T(1)) is never made slower to flatter a draft; within the
    tie band the cheaper verify steps win; exact ties keep the loaded layout."""
    pick = measure.pick_layout
    # oneDNN faster everywhere (the EPYC's case): chosen
    assert pick({"out-in": {1: 58.0, 2: 99.0, 4: 88.0}, "onednn": {1: 52.0, 2: 60.0, 4: 64.0}}, [1, 3]) == "onednn"
    # the loaded layout's one-token step 5% faster: it stays, however cheap oneDNN's verify steps are
    # (the negative control: a choice by verify cost alone would take oneDNN)
    t = {"out-in": {1: 50.0, 2: 52.0, 4: 80.0}, "onednn": {1: 52.5, 2: 54.0, 4: 56.0}}
    assert pick(t, [1, 3]) == "out-in"
    assert min(t, key=lambda lay: t[lay][2] + t[lay][4]) == "onednn"
    # within the 3% band: the verify steps decide, and only those of the k asked
    t = {"out-in": {1: 50.0, 2: 80.0, 4: 52.0}, "onednn": {1: 51.0, 2: 56.0, 4: 60.0}}
    assert pick(t, [1]) == "onednn" and pick(t, [3]) == "out-in"
    assert pick(t, [1], tie=0.0) == "out-in"
    # the same times: as loaded (first)
    assert pick({"out-in": {1: 1.0, 2: 1.0}, "onednn": {1: 1.0, 2: 1.0}}, [1]) == "out-in"


def test_onednn_is_offered_only_for_the_dtypes_it_multiplies_here(monkeypatch):
    """An AVX2-only CPU's oneDNN refuses bfloat16 ("could not create a primitive descriptor", BENCHMARKS.md
    15q): auto does not offer it there, and asking for it says why instead of failing in the first step."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models import verifier

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    bf = torch.nn.Sequential(torch.nn.Linear(16, 16)).to(torch.bfloat16)
    if verifier.onednn_supports(torch.bfloat16):  # this CPU multiplies it: both paths open
        assert "onednn" in measure.layout_candidates(bf)
        with verifier.linears_onednn(bf) as n:
            assert n == 1 and bf(torch.ones(1, 16, dtype=torch.bfloat16)).shape == (1, 16)
    assert verifier.onednn_supports(torch.float32)
    calls = []

    def refuse_bf16(*args):  # how the op answers on an AVX2-only CPU
        calls.append(args[0].dtype)
        if args[0].dtype == torch.bfloat16:
            raise RuntimeError("could not create a primitive descriptor for the inner product forward")
        return torch.nn.functional.linear(args[0], args[1], args[2])

    verifier.onednn_supports.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", refuse_bf16)
    try:
        assert "onednn" not in measure.layout_candidates(bf)
        assert "onednn" in measure.layout_candidates(torch.nn.Sequential(torch.nn.Linear(16, 16)))
        with pytest.raises(DraftsmithError, match="oneDNN cannot multiply torch.bfloat16"):
            with verifier.linears_onednn(bf):
                pass
        assert calls == [torch.bfloat16, torch.float32]  # one probe per dtype, cached
    finally:
        verifier.onednn_supports.cache_clear()


def test_choose_weight_layout_times_each_candidate_inside_its_layout(tiny, monkeypatch):
    """The probe times the verifier inside each layout, alternating, and picks by those times; the
    modules are as loaded after. A fake step clock makes oneDNN cheaper, then dearer (the control)."""
    from draftsmith.models import cpu_linear
    from draftsmith.models.verifier import CppLinear, OneDNNLinear

    assert measure.layout_candidates(tiny) == ["out-in", "onednn"] + (["cpp"] if cpu_linear.available() else [])
    meta = torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta"))
    assert measure.layout_candidates(meta) == ["out-in"]
    assert measure.layout_candidates(tiny, compiled=True) == ["out-in"]  # frozen and packed as loaded
    assert measure.choose_weight_layout(meta, [1, 2, 3], [1], 8)["layout"] == "out-in"
    for onednn_cost, expected in ((0.5, "onednn"), (2.0, "out-in")):
        seen = []

        def fake(model, context, ns, repeats=9, warmup=2, **kw):
            kinds = {type(m) for m in model.modules()}
            lay = "onednn" if OneDNNLinear in kinds else "cpp" if CppLinear in kinds else "out-in"
            seen.append((lay, len(context), list(ns)))
            scale = {"onednn": onednn_cost, "cpp": 1.5}.get(lay, 1.0)
            return {n: scale * (1.0 + 0.1 * n) for n in ns}

        monkeypatch.setattr(measure, "measure_verify_costs", fake)
        choice = measure.choose_weight_layout(tiny, [5, 6, 7, 8], [1, 3], max_new_tokens=10, passes=2)
        assert choice["layout"] == expected
        lays = measure.layout_candidates(tiny)
        assert [s[0] for s in seen] == lays + lays[1:] + lays[:1]  # alternating passes
        assert all(ns == [1, 2, 4] and n == 4 + 5 for _, n, ns in seen)  # k + 1 for k in ks; mid-reply context
        assert choice["t_seconds"]["onednn"][2] == pytest.approx(onednn_cost * 1.2)
        assert all(type(m) is torch.nn.Linear for m in tiny.modules() if isinstance(m, torch.nn.Linear))


def test_tiny_run_with_auto_layout_reports_its_choice_and_is_lossless(tiny, tmp_path):
    """--weight-layout auto (the default) times both layouts, measures every row in the one it picked,
    and says so in report.json and report.md; every row still reproduces plain decoding."""
    cfg = _cfg(tmp_path, num_draft_tokens=[2])
    assert cfg.weight_layout == "auto"
    report = benchmark(tiny, _prompts(2), {"ngram": NgramProposer(), "perfect": DraftModelProposer(tiny)}, cfg,
                       tmp_path, {"verifier": "tiny", "dataset": "synthetic"})
    choice = report["weight_layout_choice"]
    assert report["provenance"]["weight_layout"] == choice["layout"] in ("out-in", "onednn", "cpp")
    assert report["provenance"]["weight_layout_asked"] == "auto"
    assert set(choice["t_seconds"]) == set(measure.layout_candidates(tiny))
    assert all(set(t) == {"1", "3"} and min(t.values()) > 0 for t in choice["t_seconds"].values())
    t = {lay: {int(n): s for n, s in v.items()} for lay, v in choice["t_seconds"].items()}
    assert choice["layout"] == measure.pick_layout(t, [2])
    for r in report["rows"]:
        assert r["identical_output_rate"] == 1.0, r["name"]
    assert f"Weight layout: **{choice['layout']}**" in (tmp_path / "report.md").read_text()
    assert all(type(m) is torch.nn.Linear for m in tiny.modules() if isinstance(m, torch.nn.Linear))


def test_tiny_run_writes_report_plots_and_short_markdown(tiny, tmp_path):
    cfg = _cfg(tmp_path, num_draft_tokens=[2, 3], weight_layout="in-out")
    drafters = {"ngram": NgramProposer(), "perfect": DraftModelProposer(tiny), "wrong": _WrongDrafter()}
    report = benchmark(tiny, _prompts(2), drafters, cfg, tmp_path, {"verifier": "tiny", "dataset": "synthetic"})
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["partial"] is False and on_disk["rows"] == json.loads(json.dumps(report["rows"]))
    names = [r["name"] for r in report["rows"]]
    assert names[0] == "plain (ours)" and "HF generate" in names and "HF prompt lookup k=3" in names
    assert len(names) == 1 + 3 * 2 + 2
    # outputs are judged against plain decoding by the same implementation: HF's prompt lookup against
    # HF generate (the same forward), everything else against ours; speedups all over ours
    refs = {r["name"]: r["reference"] for r in report["rows"]}
    assert refs["HF prompt lookup k=3"] == "HF generate" and refs["HF generate"] == "plain (ours)"
    assert refs["ngram k=2"] == "plain (ours)"
    for r in report["rows"]:
        assert r["identical_output_rate"] == 1.0, r["name"]  # greedy: every row reproduces plain decoding
        if r["kind"] != "plain":  # ... and the tie-aware verdict says so
            assert r["outputs"] == {"identical": 2, "tie": 0, "mismatch": 0, "divergences": []}, r["name"]
        assert r["tokens_per_second"]["n"] == 2 and r["speedup"]["n"] == 2
        assert r["peak_rss_bytes"] > 0
    for k in (2, 3):  # 10 tokens = 1 + 3 * (2 + 1) = 1 + 2 * (3 + 1) + 1 (a last round without drafts)
        perfect = next(r for r in report["rows"] if r["name"] == f"perfect k={k}")
        assert perfect["acceptance"]["acceptance_length"] == k + 1
    wrong = report["break_even"]["wrong"]
    assert {"best_k", "predicted", "measured", "held_back_by", "factors"} <= set(wrong)
    assert wrong["measured"].keys() == {"2", "3"}
    assert report["costs"]["t1_seconds"] > 0 and len(report["costs"]["t_verify_seconds"]) == 9
    # the predictions' prices: T(1) from the plain loop's steps (three calibration decodes of 10 tokens,
    # 9 steps each), each drafter's verify forwards from its own decodes at k = 2 and 3 (and 1)
    assert report["costs"]["plain_loop_steps"] == 27 and report["costs"]["t1_plain_loop_seconds"] > 0
    for name in ("perfect", "wrong"):
        be = report["break_even"][name]
        assert be["t_verify_seconds"]["1"] == report["costs"]["t1_plain_loop_seconds"] or \
            be["t_verify_seconds"]["1"] <= be["t_verify_seconds"]["2"]  # (pooled only where T(2) < T(1))
        assert {"2", "3", "4"} <= set(be["verify_in_situ_samples"]), be["verify_in_situ_samples"]
        assert len(be["t_verify_seconds"]) == 9
        assert all(m["priced_by_rows"] > 0 for m in be["measured"].values())  # CPU rows time their steps
        assert all(m["rows_prices"]["t1"] > 0 and m["calibration_prices"]["t_verify"] > 0 for m in be["measured"].values())
        f = be["factors"]  # measured over predicted, pooled throughput on both sides
        k = str(be["measured_k"])
        assert f["engine overhead (measured/predicted)"] == pytest.approx(
            be["measured"][k]["pooled"] / be["measured"][k]["predicted"])
        assert f["engine overhead at the rows' prices"] == pytest.approx(
            be["measured"][k]["pooled"] / be["measured"][k]["priced_by_rows"])
    for r in report["rows"]:  # total throughput over the prompts, beside the median of per-prompt ratios
        s = r["speedup"]
        base = next(x for x in report["rows"] if x["name"] == "plain (ours)")
        tok = {p["prompt"]: p["new_tokens"] for p in base["per_prompt"]}
        assert s["pooled"] == pytest.approx(
            sum(p["new_tokens"] for p in r["per_prompt"]) / sum(statistics.median(p["seconds"]) for p in r["per_prompt"])
            / (sum(tok.values()) / sum(statistics.median(p["seconds"]) for p in base["per_prompt"])))
    # measured with the weights held [in, out] (every row still lossless, above), put back as loaded
    assert report["provenance"]["weight_layout"] == "in-out"
    assert all(p.is_contiguous() for p in tiny.parameters())
    md = (tmp_path / "report.md").read_text()
    assert len(md.splitlines()) <= 40 and "| plain (ours) |" in md and "held back by" in md
    for plot in bench_report.PLOTS:
        assert (tmp_path / plot).stat().st_size > 10_000, plot
    # the verdicts a person must not miss
    wrong = report["break_even"]["wrong"]
    wrong.update(measured_speedup=0.8, below_break_even=True, meets_target=False)
    wrong["measured"][str(wrong["measured_k"])]["ci95"] = [0.75, 0.85]
    mismatch = {"prompt": "p0", "kind": "mismatch", "position": 3, "reference_token": 5, "candidate_token": 9,
                "margin": 4.0, "gap": 4.0, "margin_float32": 4.0, "tolerance": 1e-5, "reason": "token 3: far below"}
    tie = {**mismatch, "prompt": "p1", "kind": "tie", "margin": 0.125, "gap": 0.125, "margin_float32": 0.05,
           "tolerance": 0.5, "reason": ""}
    report["rows"][1]["outputs"] = {"identical": 0, "tie": 1, "mismatch": 1, "divergences": [mismatch, tie]}
    report["rows"][2]["outputs"] = {"identical": 1, "tie": 1, "mismatch": 0, "divergences": [tie]}
    md = bench_report.render_markdown(report)
    assert "this draft makes decoding slower by 20% (0.80x at k=" in md
    # an interval that holds 1.0 is reported as no measurable effect, not as "slower by 1%"
    wrong.update(measured_speedup=0.99)
    wrong["measured"][str(wrong["measured_k"])]["ci95"] = [0.95, 1.03]
    assert "wrong**: no measurable effect (0.99x [0.95-1.03] at k=" in bench_report.render_markdown(report)
    # ... and says how to narrow it: more prompts on the same --out (not for an interval clear of 1.0 and the
    # target, above, nor for a partial report)
    assert "its interval holds plain decoding (1.00x): a larger `--num-prompts`" in bench_report.render_markdown(report)
    line_of_wrong = lambda md: next(x for x in md.splitlines() if x.startswith("- **wrong**"))  # noqa: E731
    assert "a larger `--num-prompts`" not in line_of_wrong(md)  # [0.75-0.85]
    assert "a larger `--num-prompts`" not in line_of_wrong(bench_report.render_markdown({**report, "partial": True,
                                                                                         "note": "interrupted"}))
    # a calibration that saw another machine speed than the rows did is named; a close one is not
    m = wrong["measured"][str(wrong["measured_k"])]
    def wrong_line() -> str:
        return next(li for li in bench_report.render_markdown(report).splitlines() if li.startswith("- **wrong**"))

    m.update(predicted=0.90, priced_by_rows=1.00, pooled=1.01)
    assert "(1.00x with the step prices the timed rows paid) for 1.01x measured over all prompts pooled" in wrong_line()
    assert "prices and the timed rows' differ by 10%" in wrong_line() and "the machine's speed changed" in wrong_line()
    kk = wrong["measured_k"] + 1
    m.update(calibration_prices={"t1": 0.020, "t_verify": 0.026, "propose": 0.001},
             rows_prices={"t1": 0.020, "t_verify": 0.024, "propose": 0.001})
    assert (f"(T(1) 20.0 ms in the calibration, 20.0 ms in the rows; T_verify({kk}) / T(1): 1.30 in the "
            "calibration, 1.20 in the rows): the machine's") in wrong_line()
    m.update(rows_prices={"t1": 0.027, "t_verify": 0.027, "propose": 0.001})  # the host slowed: T(1) names it
    assert "(T(1) 20.0 ms in the calibration, 27.0 ms in the rows; " in wrong_line()
    m.update(predicted=0.98)
    assert "(1.00x with the step prices" in wrong_line() and "the machine's speed changed" not in wrong_line()
    assert "MISMATCH: ngram k=2 leaves plain (ours) on 1 prompt(s)" in md and "a bug" in md
    assert "| ngram k=2 |" in md and " | 0 / 1 / 1 | " in md
    assert "ngram k=3 parts from plain (ours) at a numerical tie on 1 prompt(s) (largest margin 0.125" in md
    assert "MISMATCH: ngram k=3" not in md
    assert len(md.splitlines()) <= 40


class _OracleDrafter(Proposer):
    """Proposes plain decoding's own continuation, looked up (no model call): always accepted, ~free."""

    def __init__(self, model, prompts, n: int) -> None:
        from draftsmith import generate

        self.cont = {tuple(ids): generate(model, ids, max_new_tokens=n + 8).token_ids for _, ids in prompts}

    def propose(self, ctx, k, sampling, generator):
        toks = ctx.tokens.tolist()
        for p, c in self.cont.items():
            if tuple(toks[:len(p)]) == p and len(toks) > len(p):
                done = len(toks) - len(p)  # c[done - 1] is the pending token
                return Proposal(torch.tensor(c[done:done + k], dtype=torch.long))
        return Proposal(torch.empty(0, dtype=torch.long))


def test_choose_k_times_the_predicted_best_k_only(tiny, tmp_path):
    """--choose-k: a pilot decode on prompts that are neither timed nor judged picks one k per
    drafter, the cost model's best: a free drafter that is always right gains with every
    drafted token (the largest k), one that is never right only pays for them (the smallest)."""
    ks = [1, 2, 4]
    prompts = _prompts(4)
    timed, pilot = prompts[:2], prompts[2:]
    drafters = {"oracle": _OracleDrafter(tiny, prompts, 10), "wrong": _WrongDrafter()}
    cfg = _cfg(tmp_path, num_draft_tokens=ks, choose_k=True, hf_reference=False)
    report = benchmark(tiny, timed, drafters, cfg, tmp_path, {}, pilot=pilot)
    choice = report["k_choice"]
    assert choice["oracle"]["k"] == 4 and choice["wrong"]["k"] == 1
    for name, c in choice.items():  # the choice is the prediction's argmax, over every candidate k
        pred = {int(k): s for k, s in c["predicted_speedup"].items()}
        assert sorted(pred) == ks and c["k"] == max(pred, key=pred.get), name
        assert c["pilot_k"] == 4 and c["pilot_prompts"] == ["p2", "p3"]
    # (the last round of a 10-token reply drafts fewer than 4)
    assert choice["oracle"]["per_position_acceptance"][:3] == [1.0] * 3 and choice["oracle"]["acceptance_length"] > 4
    assert choice["wrong"]["acceptance_length"] == 1.0
    assert [r["name"] for r in report["rows"]] == ["plain (ours)", "oracle k=4", "wrong k=1"]
    assert {p for r in report["rows"] for p in r["speedup"]["prompts"] or []} <= {"p0", "p1"}  # pilot not timed
    from draftsmith.gate import summarize_drafter

    summary = summarize_drafter(report, "oracle")
    assert summary["k"] == 4 and "pilot decode on 2 prompt(s) that are not judged" in summary["k_selection"]
    assert "k = 4 chosen before timing" in (tmp_path / "report.md").read_text()
    # negative control: without --choose-k every k is timed and nothing was chosen
    off = benchmark(tiny, timed, drafters, _cfg(tmp_path / "off", num_draft_tokens=ks, hf_reference=False),
                    tmp_path / "off", {}, pilot=pilot)
    assert off["k_choice"] == {} and len(off["rows"]) == 1 + 2 * len(ks)
    with pytest.raises(DraftsmithError, match="no pilot prompts"):
        benchmark(tiny, timed, drafters, cfg, tmp_path / "none", {})


def test_bench_prompts_keeps_the_pilot_apart(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(6)))
    judged, pilot = measure.bench_prompts(str(f), _CharTokenizer(), 3, pilot=2)
    assert [p for p, _ in judged] == ["q0", "q1", "q2"] and [p for p, _ in pilot] == ["q4", "q5"]
    assert measure.bench_prompts(str(f), _CharTokenizer(), 3)[1] == []  # no pilot unless asked
    assert measure.bench_prompts(str(f), _CharTokenizer(), 6, pilot=2)[1] == []  # none left: the bench refuses


def test_ctrl_c_leaves_a_partial_report(tiny, tmp_path):
    # Before the timed loop: calibration at k = 1 and 3 (three passes; 8 rounds each, 10 tokens, never
    # accepted, every third a plain step that does not call the drafter: 6 calls) and the warm-up (8
    # calls) make 44 calls; so call 50 falls in the first timed drafter run, after the plain run of prompt 0.
    cfg = _cfg(tmp_path, num_draft_tokens=[3], num_prompts=3, warmup_tokens=10, hf_reference=False)
    with pytest.raises(KeyboardInterrupt):
        benchmark(tiny, _prompts(3), {"wrong": _WrongDrafter(stop_at=50)}, cfg, tmp_path, {})
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["partial"] is True and "interrupted" in report["note"]
    assert [r["name"] for r in report["rows"]] == ["plain (ours)"]
    assert report["prompts"]["runs"] == 1 and report["prompts"]["requested"] == 3
    assert "PARTIAL" in (tmp_path / "report.md").read_text()
    assert "Plots:" in (tmp_path / "report.md").read_text()
    assert f"{report['prompts']['measured']} of 3 prompts x " in (tmp_path / "report.md").read_text()


def test_sigterm_in_the_calibration_leaves_a_partial_report_that_says_so(tiny, tmp_path):
    """SIGTERM (raised as errors.Terminated) before any timed row: the partial report says SIGTERM, links
    no plots (none are drawn without rows), and the exception names the report written."""
    from draftsmith.errors import Terminated

    cfg = _cfg(tmp_path, num_draft_tokens=[3], num_prompts=3, warmup_tokens=10, hf_reference=False)
    with pytest.raises(Terminated) as e:
        benchmark(tiny, _prompts(3), {"wrong": _WrongDrafter(stop_at=2, stop=Terminated)}, cfg, tmp_path, {})
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["partial"] is True and report["note"] == "interrupted (SIGTERM)" and report["rows"] == []
    md = (tmp_path / "report.md").read_text()
    assert "interrupted (SIGTERM)" in md and "Plots:" not in md and not list(tmp_path.glob("*.png"))
    assert e.value.partial_report == tmp_path / "report.md"


def _stop_timed_runs_at(monkeypatch, n: int) -> list[int]:
    """``measure.timed_run`` raising KeyboardInterrupt on its ``n``-th call (counted in the list returned)."""
    calls: list[int] = []
    run = measure.timed_run

    def wrapper(*a, **kw):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return run(*a, **kw)

    monkeypatch.setattr(measure, "timed_run", wrapper)
    return calls


def test_an_interrupted_bench_resumes_where_it_stopped(tiny, tmp_path, monkeypatch):
    """Ctrl-C in the third unit (prompt 2 of repeat 1, one row done): the same bench again keeps the step
    costs and the two units every row had timed (their seconds as they were), times the third in full and
    the rest, and ends with the report of a whole bench, the checkpoint removed."""
    from draftsmith.bench import resume

    cfg = _cfg(tmp_path, num_draft_tokens=[2, 3], num_prompts=3, repeats=2, hf_reference=False)
    props = lambda: {"ngram": NgramProposer(), "perfect": DraftModelProposer(tiny)}  # noqa: E731
    rows = 1 + 2 * 2
    _stop_timed_runs_at(monkeypatch, 2 * rows + 2)
    with pytest.raises(KeyboardInterrupt):
        benchmark(tiny, _prompts(3), props(), cfg, tmp_path, {"fingerprint": "f"})
    partial = json.loads((tmp_path / "report.json").read_text())
    units = (tmp_path / resume.UNITS_FILE).read_text().splitlines()
    assert partial["partial"] and len(units) == 2 and partial["prompts"]["runs"] == 2 * rows + 1
    with open(tmp_path / resume.UNITS_FILE, "a") as f:  # kill -9 mid-append: a torn last line
        f.write('{"unit": 2, "prompt": 2, "runs": [[0, {"token_')

    def no_costs(*a, **kw):
        raise AssertionError("a resumed bench measures its step costs again")

    monkeypatch.setattr("draftsmith.bench.run.measure_costs", no_costs)
    calls = _stop_timed_runs_at(monkeypatch, -1)
    report = benchmark(tiny, _prompts(3), props(), cfg, tmp_path, {"fingerprint": "f"})
    assert len(calls) == (2 * 3 - 2) * rows  # units 3..6, each by every row; nothing timed twice
    assert not report["partial"] and report["prompts"]["runs"] == 2 * 3 * rows
    assert report["resumed"][0]["units_done"] == 2 and "Resumed at" in (tmp_path / "report.md").read_text()
    assert report["costs"]["t_verify_seconds"] == partial["costs"]["t_verify_seconds"]
    for before, after in zip(partial["rows"], report["rows"]):
        assert before["name"] == after["name"]
        first = {e["prompt"]: e["seconds"] for e in before["per_prompt"]}
        now = {e["prompt"]: e["seconds"] for e in after["per_prompt"]}
        assert now["p0"][:1] == first["p0"] and now["p1"][:1] == first["p1"]  # repeat 1's first two units, kept
        assert len(now["p0"]) == len(now["p1"]) == len(now["p2"]) == 2  # and the rest timed once each
        assert now["p2"][0] not in first.get("p2", [])  # the unit half done when stopped: timed again in full
        assert after["identical_output_rate"] == 1.0
    assert json.loads((tmp_path / resume.STATE_FILE).read_text())["complete"]  # kept for a bench of more prompts
    assert len((tmp_path / resume.UNITS_FILE).read_text().splitlines()) == 2 * 3
    assert not resume.interrupted(tmp_path)
    # complete: the same bench again measures afresh (and so does --no-resume; negative controls of the kept units)
    calls = _stop_timed_runs_at(monkeypatch, -1)
    monkeypatch.undo()
    report = benchmark(tiny, _prompts(3), props(), cfg, tmp_path, {"fingerprint": "f"})
    assert "resumed" in report and report["resumed"] == []
    assert len(calls) == 0  # (undone above: the counter stays empty, the bench timed all units itself)


def test_kept_units_are_the_saved_ones_that_start_the_new_order():
    """Unit u is prompt u % P of repeat u // P: a saved 3 prompts x 2 repeats keeps its first repeat for 4
    prompts, all six for 3 x 3, the first two prompts for 2 prompts, and nothing out of order."""
    from draftsmith.bench.resume import kept_units

    units = [{"prompt": u % 3} for u in range(6)]
    assert kept_units(units, 3, 4, 2) == 3
    assert kept_units(units, 3, 3, 3) == 6
    assert kept_units(units, 3, 3, 1) == 3
    assert kept_units(units, 3, 2, 2) == 2
    assert kept_units(units[:2], 3, 5, 1) == 2  # an interrupted bench of more prompts
    assert kept_units([{"prompt": 1}], 3, 4, 1) == 0  # negative control: a unit out of order
    assert kept_units([], 0, 4, 1) == 0


def test_a_finished_bench_is_extended_by_more_prompts_or_repeats_timing_only_those(tiny, tmp_path, monkeypatch,
                                                                                   capsys):
    """A finished bench of 2 prompts, then 3 prompts: only the third is timed, the first two's seconds come
    from the first bench; then 2 repeats: only the second repeat is timed; then 2 prompts x 2 repeats keeps
    the first repeat of the first two. Negative controls: other first prompts, and the same finished bench
    again, time every unit."""
    from draftsmith.bench import resume

    props = lambda: {"ngram": NgramProposer()}  # noqa: E731
    cfg = lambda **kw: _cfg(tmp_path, hf_reference=False, **kw)  # noqa: E731
    rows = 2
    first = benchmark(tiny, _prompts(2), props(), cfg(num_prompts=2), tmp_path, {"fingerprint": "f"})
    monkeypatch.setattr("draftsmith.bench.run.measure_costs", lambda *a, **kw: pytest.fail("costs measured again"))
    capsys.readouterr()

    calls = _stop_timed_runs_at(monkeypatch, -1)
    report = benchmark(tiny, _prompts(3), props(), cfg(num_prompts=3), tmp_path, {"fingerprint": "f"})
    assert len(calls) == 1 * rows and report["prompts"]["runs"] == 3 * rows and not report["partial"]
    assert report["resumed"][-1]["resized"] == {"prompts": [2, 3], "repeats": [1, 1], "units_saved": 2,
                                                "complete": True}
    assert "extending the bench" in capsys.readouterr().err
    assert "Extended at" in (tmp_path / "report.md").read_text()
    for before, after in zip(first["rows"], report["rows"]):
        was = {e["prompt"]: e["seconds"] for e in before["per_prompt"]}
        now = {e["prompt"]: e["seconds"] for e in after["per_prompt"]}
        assert now["p0"] == was["p0"] and now["p1"] == was["p1"] and "p2" in now and "p2" not in was
    assert report["costs"]["t_verify_seconds"] == first["costs"]["t_verify_seconds"]

    calls = _stop_timed_runs_at(monkeypatch, -1)
    report = benchmark(tiny, _prompts(3), props(), cfg(num_prompts=3, repeats=2), tmp_path,
                       {"fingerprint": "f"})
    assert len(calls) == 3 * rows and report["prompts"]["runs"] == 6 * rows
    calls = _stop_timed_runs_at(monkeypatch, -1)
    report = benchmark(tiny, _prompts(2), props(), cfg(num_prompts=2, repeats=2), tmp_path,
                       {"fingerprint": "f"})
    assert len(calls) == 2 * rows and report["prompts"]["runs"] == 4 * rows  # p0, p1 of repeat 0 kept
    assert len((tmp_path / resume.UNITS_FILE).read_text().splitlines()) == 4  # the file holds this bench's only

    monkeypatch.undo()
    for prompts, words in ((_prompts(2), None), (_prompts(4)[1:3], "its prompts are not the first of these")):
        calls = _stop_timed_runs_at(monkeypatch, -1)
        capsys.readouterr()
        report = benchmark(tiny, prompts, props(), cfg(num_prompts=2, repeats=2), tmp_path,
                           {"fingerprint": "f"})
        assert len(calls) == 4 * rows and report["resumed"] == []
        err = capsys.readouterr().err
        assert ((words in err) if words else "starting afresh" not in err), err


def test_an_error_mid_bench_leaves_a_partial_report_and_the_same_bench_resumes(tiny, tmp_path, monkeypatch):
    """A row that fails (a serving engine that died, memory) after a prompt all rows timed: the error
    propagates, the partial report says what stopped it, and the same bench afterwards times only what
    was left (negative control: an error before any timed run writes no report)."""
    from draftsmith.bench import resume

    cfg = _cfg(tmp_path, num_draft_tokens=[2], num_prompts=2, hf_reference=False)
    run = measure.timed_run
    calls: list[int] = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the server went away")
        return run(*a, **kw)

    monkeypatch.setattr(measure, "timed_run", failing)
    with pytest.raises(RuntimeError, match="went away") as e:
        benchmark(tiny, _prompts(2), {"ngram": NgramProposer()}, cfg, tmp_path, {"fingerprint": "f"})
    assert e.value.partial_report == tmp_path / "report.md"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["partial"] and report["note"] == "stopped by an error (RuntimeError: the server went away)"
    assert "stopped by an error" in (tmp_path / "report.md").read_text()
    calls.clear()
    monkeypatch.setattr(measure, "timed_run", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    report = benchmark(tiny, _prompts(2), {"ngram": NgramProposer()}, cfg, tmp_path, {"fingerprint": "f"})
    assert len(calls) == 2 and not report["partial"] and not resume.interrupted(tmp_path)

    other = tmp_path / "early"
    monkeypatch.setattr("draftsmith.bench.run.measure_costs", lambda *a, **kw: (_ for _ in ()).throw(
        RuntimeError("before timing")))
    with pytest.raises(RuntimeError) as e:
        benchmark(tiny, _prompts(2), {"ngram": NgramProposer()}, _cfg(other, num_draft_tokens=[2], num_prompts=2,
                                                                      hf_reference=False), other, {})
    assert not hasattr(e.value, "partial_report") and not (other / "report.json").exists()


def test_serving_engines_of_another_version_keep_the_costs_but_time_every_unit_again(tiny, tmp_path, monkeypatch,
                                                                                     capsys):
    """The engines' versions are known only once they run: a resumed bench whose engines differ from the
    saved ones keeps the step costs (our engine's) and times every unit again."""
    from draftsmith.bench import resume

    cfg = _cfg(tmp_path, num_draft_tokens=[2], num_prompts=2, hf_reference=False)
    _stop_timed_runs_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        benchmark(tiny, _prompts(2), {"ngram": NgramProposer()}, cfg, tmp_path, {"fingerprint": "f"})
    header = json.loads((tmp_path / resume.STATE_FILE).read_text())
    header["engines"] = {"vllm plain": {"version": "0.31.0", "program": "python"}}
    (tmp_path / resume.STATE_FILE).write_text(json.dumps(header))
    monkeypatch.setattr("draftsmith.bench.run.measure_costs", lambda *a, **kw: pytest.fail("costs measured again"))
    calls = _stop_timed_runs_at(monkeypatch, -1)
    report = benchmark(tiny, _prompts(2), {"ngram": NgramProposer()}, cfg, tmp_path, {"fingerprint": "f"})
    assert len(calls) == 2 * 2 and report["resumed"][0]["units_done"] == 0
    assert "every prompt is timed again" in capsys.readouterr().err


def test_a_checkpoint_that_cannot_be_written_is_warned_about_and_the_bench_goes_on(tiny, tmp_path, caplog):
    from draftsmith.bench import resume

    (tmp_path / resume.UNITS_FILE).mkdir()  # appending to it fails (as a full disk would)
    cfg = _cfg(tmp_path, num_draft_tokens=[2], num_prompts=3, hf_reference=False)
    report = benchmark(tiny, _prompts(3), {"ngram": NgramProposer()}, cfg, tmp_path, {"fingerprint": "f"})
    assert not report["partial"] and report["prompts"]["runs"] == 2 * 3
    warned = [r for r in caplog.records if "cannot write the checkpoint" in r.getMessage()]
    assert len(warned) == 1  # once, not per unit


def test_a_bench_of_other_settings_is_not_resumed_and_says_what_differs(tiny, tmp_path, monkeypatch, capsys):
    """Negative controls: another --max-new-tokens, another verifier fingerprint, --no-resume: the saved units
    are not used (every unit is timed again), and the first two say what differs."""
    cfg = _cfg(tmp_path, num_draft_tokens=[2], num_prompts=2, hf_reference=False)
    _stop_timed_runs_at(monkeypatch, 3)  # unit 1 (prompt 0) done by both rows
    with pytest.raises(KeyboardInterrupt):
        benchmark(tiny, _prompts(2), {"ngram": NgramProposer()}, cfg, tmp_path, {"fingerprint": "f"})
    for change, provenance, words in (({"max_new_tokens": 9}, {"fingerprint": "f"}, "settings.max_new_tokens"),
                                      ({}, {"fingerprint": "g"}, "verifier"),
                                      ({"resume": False}, {"fingerprint": "f"}, None)):
        calls = _stop_timed_runs_at(monkeypatch, 3)  # interrupted again, so the checkpoint stays for the next case
        capsys.readouterr()
        with pytest.raises(KeyboardInterrupt):
            benchmark(tiny, _prompts(2), {"ngram": NgramProposer()}, _cfg(tmp_path, **{**dict(
                num_draft_tokens=[2], num_prompts=2, hf_reference=False), **change}), tmp_path, provenance)
        assert len(calls) == 3  # started at unit 0: a resumed one would have reached unit 1's rows first
        err = capsys.readouterr().err
        assert (words in err and "starting afresh" in err) if words else "starting afresh" not in err
        json.loads((tmp_path / "bench-state.json").read_text())  # rewritten by this bench


def test_a_resumed_bench_keeps_its_layout_k_choice_and_confidence_thresholds(tiny, tmp_path, monkeypatch):
    """--weight-layout auto, --choose-k and --draft-confidence auto: none is measured again on resume (the
    layout probe, the pilot and the calibration would each change them on a noisy host), the EAGLE-3 draft
    decodes under the thresholds chosen before, and the outputs stay plain decoding's."""
    from draft_factory import random_draft
    from draftsmith.decoding.proposers import Eagle3Proposer

    draft = random_draft(tiny, vd=64, aux_layer_ids=[0, 1, 1])
    cfg = _cfg(tmp_path, num_draft_tokens=[1, 2], num_prompts=2, hf_reference=False, choose_k=True, pilot_prompts=1,
               weight_layout="auto")
    _stop_timed_runs_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        benchmark(tiny, _prompts(3), {"eagle3:d": Eagle3Proposer(draft)}, cfg, tmp_path, {"fingerprint": "f"},
                  pilot=_prompts(3)[2:])
    partial = json.loads((tmp_path / "report.json").read_text())
    for name in ("measure_costs", "choose_ks", "choose_weight_layout"):
        monkeypatch.setattr(f"draftsmith.bench.run.{name}", lambda *a, **kw: pytest.fail("measured again"))
    _stop_timed_runs_at(monkeypatch, -1)
    prop = Eagle3Proposer(draft)
    report = benchmark(tiny, _prompts(3), {"eagle3:d": prop}, cfg, tmp_path, {"fingerprint": "f"},
                       pilot=_prompts(3)[2:])
    assert report["weight_layout_choice"] == partial["weight_layout_choice"]
    assert report["provenance"]["weight_layout"] == partial["provenance"]["weight_layout"]
    assert report["k_choice"] == partial["k_choice"] and report["draft_confidence"] == partial["draft_confidence"]
    assert list(prop.min_confidence) == pytest.approx(partial["draft_confidence"]["eagle3:d"]["thresholds"])
    assert [r["identical_output_rate"] for r in report["rows"]] == [1.0, 1.0]


def test_a_draft_retrained_in_place_is_not_resumed_with_the_old_ones_timings():
    """The checkpoint names the drafts by their weights: one weight changed changes the digest; the same
    weights (another object, as a resumed bench loads them) keep it."""
    from draftsmith.bench.resume import module_digest

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    b.load_state_dict(a.state_dict())
    assert module_digest(a) == module_digest(b)
    with torch.no_grad():
        b[0].weight[3, 5] += 1e-6
    assert module_digest(a) != module_digest(b)


def test_the_checkpoint_gives_back_what_it_was_given(tiny):
    """Every field a resumed bench reads comes back equal, with its integer keys and tuples (JSON has neither)."""
    from draftsmith.bench import resume

    state = measure.BenchState([Row("plain (ours)", "plain", tiny)], _prompts(1))
    state.costs = CostModel({1: 0.01, 2: 0.012}, draft_fixed=1e-4, draft_per_token=2e-4, context_tokens=40)
    state.plain_steps = [0.01, 0.011]
    state.verify_steps = {"d": {1: [0.01], 3: [0.013, 0.014]}}
    state.draft_per_call = {"d": {1: 0.001, 2: 0.0015}}
    state.draft_fit = {"d": (0.0005, 0.0005)}
    state.k_choice = {"d": {"k": 2, "predicted_speedup": {"1": 1.1, "2": 1.2}}}
    state.draft_confidence = {"d": {"setting": "auto", "thresholds": [0.1, 0.2]}}
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with_checkpoint = resume.Checkpoint(Path(d), {"x": 1})
        with_checkpoint.layout = "cpp"
        with_checkpoint.layout_choice = {"layout": "cpp", "t_seconds": {"cpp": {1: 0.1}}}
        with_checkpoint.start(state, 0)
        for repeat in range(2):
            state.results.setdefault((0, 0), []).append(measure.RunResult(
                [5, 6], 0.5 + repeat, {"step_seconds": {1: [0.01]}, "engine": "lean"}, [(2, 1, 0.001)], 123, None))
            with_checkpoint.add_unit(state, repeat + 1)
        saved = resume.Checkpoint(Path(d), {"x": 1}).load()
        assert saved["units_done"] == 2
        assert resume.Checkpoint(Path(d), {"x": 2}).load(say=False) is None  # another bench's: removed
        assert not list(Path(d).iterdir())
    back = measure.BenchState([Row("plain (ours)", "plain", tiny)], _prompts(1))
    resume.restore_costs(back, saved)
    assert resume.restore_results(back, saved) == 2
    for name in ("costs", "plain_steps", "verify_steps", "draft_per_call", "draft_fit", "k_choice",
                 "draft_confidence", "results", "started"):
        assert getattr(back, name) == getattr(state, name), name
    assert resume.layout_of(saved) == ("cpp", with_checkpoint.layout_choice)
    with pytest.raises(ValueError, match="rows differ"):
        resume.restore_results(measure.BenchState([Row("other", "plain", tiny)], _prompts(1)), saved)


# ----------------------------------------------------------------------------- config, CLI, prompts
def test_config_validation_names_the_flag(tmp_path):
    with pytest.raises(DraftsmithError, match="--drafter or --draft"):
        BenchConfig(verifier="x", out=tmp_path)
    with pytest.raises(DraftsmithError, match="--num-draft-tokens"):
        _cfg(tmp_path, num_draft_tokens=[0, 3])
    with pytest.raises(DraftsmithError, match="--dataset"):
        _cfg(tmp_path, dataset=str(tmp_path / "missing.jsonl"))
    with pytest.raises(DraftsmithError, match="--draft"):
        _cfg(tmp_path, draft=[str(tmp_path / "nope")])
    assert _cfg(tmp_path, num_draft_tokens=[5, 2, 5]).num_draft_tokens == [2, 5]
    with pytest.raises(DraftsmithError, match="--weight-layout"):
        _cfg(tmp_path, weight_layout="columns")


def test_cli_repeatable_drafter_and_k_list(tmp_path):
    from draftsmith.cli import build_parser
    from draftsmith.config import from_args

    ns = build_parser().parse_args(["bench", "--verifier", "v", "--out", str(tmp_path), "--drafter", "ngram",
                                    "--drafter", "ngram:2", "model:x", "--num-draft-tokens", "2", "4"])
    cfg = from_args(ns._command.config, ns)
    assert isinstance(cfg, BenchConfig)
    assert cfg.drafter == ["ngram", "ngram:2", "model:x"] and cfg.num_draft_tokens == [2, 4]
    assert cfg.resume is True  # an interrupted bench continues unless told not to
    ns = build_parser().parse_args(["bench", "--verifier", "v", "--out", str(tmp_path), "--drafter", "ngram",
                                    "--no-resume"])
    assert from_args(ns._command.config, ns).resume is False
    from draftsmith.cli import EXIT_ERROR, main

    assert main(["bench", "--verifier", "v", "--out", str(tmp_path)]) == EXIT_ERROR  # no drafter: one-line error


class _CharTokenizer:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % 128 for c in text]}


def test_eval_prompt_loaders(tmp_path):
    mt = measure.load_eval_prompts("mt-bench", _CharTokenizer(), None)
    assert len(mt) == 80 and mt[0][0] == "81" and mt[0][1][:4] == [ord(c) for c in "Comp"]
    he = measure.load_eval_prompts("humaneval", _CharTokenizer(), 3)
    assert [pid for pid, _ in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ab"}\n\n{"id": "q", "messages": [{"role": "user", "content": "cd"}, '
                 '{"role": "assistant", "content": "x"}]}\n{"turns": ["ef", "gh"]}\n')
    assert measure.load_eval_prompts(str(f), _CharTokenizer(), None) == [
        ("p.jsonl:1", [97, 98]), ("q", [99, 100]), ("p.jsonl:4", [101, 102])]
    f.write_text('{"answer": 1}\n')
    with pytest.raises(DraftsmithError, match="line 1"):
        measure.load_eval_prompts(str(f), _CharTokenizer(), None)


@pytest.mark.slow
def test_bench_cli_on_smollm2(tmp_path):
    """The CLI on the packaged verifier; --threads holds for the bench only, not for the process after it."""
    from draftsmith.cli import main

    own = torch.get_num_threads()
    threads = max(own, 2)  # a count that --threads 1 visibly changes
    torch.set_num_threads(threads)
    try:
        rc = main(["bench", "--verifier", "smollm2-135m", "--drafter", "ngram", "--num-prompts", "1",
                   "--max-new-tokens", "8", "--num-draft-tokens", "3", "--warmup-tokens", "4",
                   "--no-hf-reference", "--no-progress", "--threads", "1", "--out", str(tmp_path)])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(own)
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["provenance"]["fingerprint"] and report["rows"][1]["identical_output_rate"] == 1.0
    # the default, auto: every CPU layout timed, the rows measured in the one picked
    assert report["provenance"]["weight_layout_asked"] == "auto"
    assert report["provenance"]["weight_layout"] == report["weight_layout_choice"]["layout"]
    assert set(report["weight_layout_choice"]["t_seconds"]) == {"out-in", "onednn", "cpp"}
    # the bench ran on one thread (the report says so) and left the process on its own count
    assert report["environment"]["torch_threads"] == 1 and after == threads


def test_trimmed_mean_drops_a_preemption_but_keeps_the_skew():
    steps = [0.030] * 19 + [0.130]  # one step preempted for 100 ms among twenty
    assert costmodel.trimmed_mean(steps) == pytest.approx(0.030)
    assert sum(steps) / len(steps) == pytest.approx(0.035)  # control: the plain mean moves 17%
    skewed = [0.030] * 14 + [0.036] * 6  # catch-up steps in 30% of rounds: a price must count them
    assert costmodel.trimmed_mean(skewed) == pytest.approx((13 * 0.030 + 5 * 0.036) / 18)
    assert np.median(skewed) == pytest.approx(0.030)  # control: the median does not
    assert costmodel.trimmed_mean([1.0, 2.0]) == 1.5  # too few to trim
    with pytest.raises(ValueError):
        costmodel.trimmed_mean([])


def test_in_situ_prices_replace_the_bare_table_where_measured():
    table = {1: 0.025, 2: 0.030, 3: 0.034, 4: 0.038, 5: 0.042}
    plain = [0.0234] * 20
    verify = {2: [0.0315] * 12, 3: [0.036] * 3, 1: [0.5] * 9}  # n = 3: too few; n = 1 in a round: not T(1)
    t = costmodel.in_situ_prices(table, plain, verify)
    assert t[1] == pytest.approx(0.0234)  # the plain loop's step, not the bare 25 ms
    assert t[2] == pytest.approx(0.0315)  # the rounds' verify, not the bare 30 ms
    scale = 0.0315 / 0.030
    assert t[3] == pytest.approx(0.034 * scale) and t[5] == pytest.approx(0.042 * scale)
    # nothing measured in situ: the bare table as it was
    assert costmodel.in_situ_prices(table, [], {}) == table
    # a plain loop dearer than the rounds' verify would price drafting below nothing: pooled, non-decreasing
    t = costmodel.in_situ_prices(table, [0.040] * 20, {2: [0.032] * 10})
    assert t[1] == t[2] == pytest.approx(0.036) and t[3] > t[2]


def test_paired_prices_cancel_a_host_drift_between_decodes():
    """costmodel.paired_prices: four calibration decodes on a host whose speed differs by decode
    (x1.3, x0.8, x1.3, x1.0), true prices T(1) 30 ms, T(2) 31.5 ms, T(3) 36 ms, a call 2 ms per drafted
    token. Scaled to a common T(1) each decode gives the true ratios; pooled as measured (the
    negative control) T(2) / T(1) reads 1.23 for 1.05, and the k = 1 call 18% too dear."""
    t1, t2, t3, call = 0.030, 0.0315, 0.036, 0.002

    def decode(k, f):
        return k, [f * call * k] * 12, {1: [f * t1] * 10, k + 1: [f * (t2 if k == 1 else t3)] * 20}

    decodes = [decode(1, 1.3), decode(2, 0.8), decode(1, 1.3), decode(2, 1.0)]
    calls, steps = costmodel.paired_prices(decodes)
    level = costmodel.trimmed_mean(steps[1])
    assert costmodel.trimmed_mean(steps[2]) / level == pytest.approx(t2 / t1)
    assert costmodel.trimmed_mean(steps[3]) / level == pytest.approx(t3 / t1)
    assert costmodel.trimmed_mean(calls[1]) / level == pytest.approx(call / t1)
    assert costmodel.trimmed_mean(calls[2]) / level == pytest.approx(2 * call / t1)
    raw_calls, raw = costmodel.paired_prices(decodes, min_samples=11)  # too few one-token steps: as measured
    assert costmodel.trimmed_mean(raw[2]) / costmodel.trimmed_mean(raw[1]) > 1.15 * t2 / t1
    assert costmodel.trimmed_mean(raw_calls[1]) / costmodel.trimmed_mean(raw[1]) > 1.15 * call / t1
    assert costmodel.paired_prices([]) == ({}, {})


class _ContractSpy(Proposer):
    """Checks the DraftContext contract on every call (the verifier states of exactly the positions
    verified since the previous call) and proposes a fixed token."""

    requires_hidden_states = True
    aux_layer_ids = (1,)

    def reset(self) -> None:
        self.last_T, self.seen = None, []

    def propose(self, ctx, k, sampling, generator):
        T, m = ctx.tokens.shape[0], ctx.hidden_states.shape[0]
        self.seen.append((T, m, self.last_T))
        self.last_T = T
        return Proposal(torch.full((k,), 5, dtype=torch.long))


def test_plain_steps_between_rounds_keep_the_drafters_view_whole(tiny):
    """RecordingProposer(plain_every=3): every third round proposes nothing and does not ask the
    drafter, whose next call still gets the verifier states of every position since its last;
    the output stays plain decoding's; time_drafter leaves the calls after a plain step out."""
    from draftsmith.bench.measure import RecordingProposer, time_drafter
    from draftsmith.decoding.engine import generate

    prompt = _prompts(1)[0][1]
    ref = generate(tiny, prompt, max_new_tokens=24).token_ids
    spy = _ContractSpy()
    rec = RecordingProposer(spy, plain_every=3)
    out = generate(tiny, prompt, proposer=rec, max_new_tokens=24, num_draft_tokens=2, time_steps=True)
    assert out.token_ids == ref
    assert [c for i, c in enumerate(rec.calls) if (i + 1) % 3 == 0] == [(0, 0, 0.0)] * (len(rec.calls) // 3)
    assert all(req in (1, 2) for i, (req, _, _) in enumerate(rec.calls) if (i + 1) % 3)  # 1: the budget's end
    assert len(spy.seen) == len(rec.calls) - len(rec.calls) // 3 >= 6
    assert spy.seen[0][1] == spy.seen[0][0] - 1  # the first call: the prompt's states
    for T, m, last in spy.seen[1:]:
        assert m == T - last  # held states passed on: no position skipped or repeated
    assert len(out.stats["step_seconds"][1]) >= len(rec.calls) // 3  # the plain steps are timed
    with pytest.raises(ValueError):
        RecordingProposer(spy, plain_every=1)

    times, steps = time_drafter(tiny, _ContractSpy(), prompt, 2, 24, 0.0, 0, plain_every=3)
    rounds = len(steps[1]) + sum(len(v) for n, v in steps.items() if n > 1)
    # calls 1, 2, (plain), 4, 5, (plain), ...: the first and every one after a plain step left out
    assert 0 < len(times) <= rounds // 3 + 1
    times_all, _ = time_drafter(tiny, _ContractSpy(), prompt, 2, 24, 0.0, 0)  # control: without, all but the first
    assert len(times_all) > 1.5 * len(times)


def test_calibration_prices_a_drafter_against_the_plain_steps_between_its_rounds(tiny):
    """measure_costs: a drafter's T(1) is the plain steps timed in its own decodes (paired),
    the plain decodes' stays reported; every decode has those steps."""
    from draftsmith.bench.measure import BenchState, Row, measure_costs

    st = BenchState([Row("plain (ours)", "plain", tiny)], _prompts(2))
    measure_costs(st, {"spy": _ContractSpy()}, [1, 2], 20, 0.0, 0)
    own = st.verify_steps["spy"]
    assert len(own[1]) >= 3 * 2 * 3 and len(own[2]) >= 5 and len(own[3]) >= 5
    assert st.plain_steps
    costs = st.drafter_costs("spy")
    assert costs.t1 == pytest.approx(min(costmodel.trimmed_mean(own[1]), costs.verify(2)))
    assert set(st.draft_per_call["spy"]) == {1, 2}
    st.plain_steps = [1e-6] * 20  # a plain loop 1 us a step: not what the drafter is priced against
    assert st.drafter_costs("spy").t1 == pytest.approx(costs.t1)
    del own[1]  # control: with no plain steps of its own, the plain decodes' T(1) is the fallback
    assert st.drafter_costs("spy").t1 == pytest.approx(1e-6)


def test_the_rows_own_step_prices_give_a_second_prediction():
    """report._priced_by_rows: the plain row's one-token steps and the drafter row's verify forwards
    and propose calls (each run's first call left out) price its k; known answer, and a control whose
    verifies cost twice as much predicts less."""
    from draftsmith.bench.measure import BenchState, Row, RunResult

    rows = [Row("plain (ours)", "plain", None), Row("d k=1", "drafter", None, drafter="d", k=1)]

    def state(verify_s):
        st = BenchState(rows, [("p0", [1]), ("p1", [2])])
        for p in range(2):
            st.results[(0, p)] = [RunResult([0] * 9, 1.0, {"step_seconds": {1: [0.020] * 8}})]
            st.results[(1, p)] = [RunResult([0] * 9, 1.0, {"step_seconds": {2: [verify_s] * 6}},
                                            draft_calls=[(1, 1, 0.5)] + [(1, 1, 0.002)] * 5)]
        return st

    profile = DrafterProfile(1, [0.4], [0, 10])
    table = CostModel({1: 0.030, 2: 0.040, 3: 0.045})
    got = bench_report._priced_by_rows(state(0.025), "d", profile, table)
    assert got[1]["speedup"] == pytest.approx(1.4 * 0.020 / (0.025 + 0.002))  # the first call (0.5 s, a prefill) left out
    assert got[1]["t1"] == pytest.approx(0.020) and got[1]["t_verify"] == pytest.approx(0.025)
    assert got[1]["propose"] == pytest.approx(0.002)
    slower = bench_report._priced_by_rows(state(0.050), "d", profile, table)
    assert slower[1]["speedup"] == pytest.approx(1.4 * 0.020 / (0.050 + 0.002)) and slower[1]["speedup"] < got[1]["speedup"]
    assert bench_report._priced_by_rows(state(0.025), "other", profile, table) == {}


def test_rounds_that_proposed_nothing_are_priced_at_the_rows_own_one_token_step():
    """A stopping draft's empty rounds verify one token inside its own decode; the rows-priced
    prediction charges them what they paid there, not the plain loop's T(1) (which stays the price of
    a token). Known answers; the control with empty rounds as cheap as plain steps predicts more. The
    loop's work outside timed steps and calls is reported per round."""
    from draftsmith.bench.measure import BenchState, Row, RunResult

    rows = [Row("plain (ours)", "plain", None), Row("d k=1", "drafter", None, drafter="d", k=1)]

    def state(empty_s):
        st = BenchState(rows, [("p0", [1])])
        st.results[(0, 0)] = [RunResult([0] * 9, 1.0, {"step_seconds": {1: [0.020] * 8},
                                                       "seconds": 0.2, "prefill_seconds": 0.03})]
        # 12 rounds: 6 verified 2 tokens, 6 proposed nothing; 4 propose calls after the first
        st.results[(1, 0)] = [RunResult([0] * 9, 1.0, {"step_seconds": {2: [0.025] * 6, 1: [empty_s] * 6},
                                                       "seconds": 0.5, "prefill_seconds": 0.03},
                                        draft_calls=[(1, 1, 0.01)] + [(1, 1, 0.002)] * 4)]
        return st

    profile = DrafterProfile(1, [0.4], [5, 5])  # half the rounds empty; 0.4 of the drafted ones accepted
    table = CostModel({1: 0.030, 2: 0.040, 3: 0.045})
    got = bench_report._priced_by_rows(state(0.024), "d", profile, table)[1]
    assert got["t1_own_steps"] == pytest.approx(0.024) and got["own_steps"] == {"1": 6, "2": 6}
    assert got["speedup"] == pytest.approx(1.2 * 0.020 / (0.5 * 0.024 + 0.5 * 0.025 + 0.002))
    same = bench_report._priced_by_rows(state(0.020), "d", profile, table)[1]
    assert same["speedup"] == pytest.approx(1.2 * 0.020 / (0.5 * 0.020 + 0.5 * 0.025 + 0.002))
    assert same["speedup"] > got["speedup"]
    # the loop's own time: 0.47 s decoding, 0.294 s in steps, 0.018 s in calls, over 12 rounds
    assert got["unpriced_per_round"] == pytest.approx((0.47 - 0.294 - 0.018) / 12)
    assert bench_report._plain_unpriced(state(0.024)) == pytest.approx((0.17 - 0.16) / 8)
    # without step times (an engine that does not time them) nothing is claimed
    assert bench_report.unpriced_per_round([RunResult([0], 1.0, {"seconds": 1.0})]) is None
    # predict itself: the empty rounds' price defaults to T(1)
    c = CostModel({1: 0.02, 2: 0.025}, draft_fixed=0.002)
    assert costmodel.predict(profile, c, 1).speedup == pytest.approx(1.2 * 0.02 / (0.5 * 0.02 + 0.5 * 0.025 + 0.002))
    assert costmodel.predict(profile, c, 1, empty_round=0.03).speedup < costmodel.predict(profile, c, 1).speedup


def test_monotone_fit_pools_violators():
    fit = costmodel.monotone_fit({1: 0.089, 2: 0.091, 3: 0.079, 4: 0.138, 5: 0.124, 6: 0.118})
    assert list(fit) == [1, 2, 3, 4, 5, 6]
    assert fit[1] == fit[2] == fit[3] == pytest.approx((0.089 + 0.091 + 0.079) / 3)  # 0.085 < 0.089: pooled again
    assert fit[4] == pytest.approx((0.138 + 0.124 + 0.118) / 3) == fit[6]
    assert all(a <= b for a, b in zip(list(fit.values()), list(fit.values())[1:]))
    already = {1: 1.0, 2: 2.0, 4: 3.0}
    assert costmodel.monotone_fit(already) == already  # a monotone input is left alone


# ----------------------------------------------------------------------------- serving engines as rows
class _FakeServer:
    """Stands in for a serving engine's server (the real ones are tested in test_engines_*.py):
    decodes with the same tiny model; its 'draft' accepts the first of every k drafted tokens;
    ``skew`` > 0 plants an off-by-one (a wrong token after the first) to check the verdict."""

    started: list = []

    def __init__(self, engine, model, draft, k, skew=0):
        self.engine, self.model, self.draft, self.k, self.skew = engine, model, draft, k, skew
        self.running = False

    def __enter__(self):
        self.running = True
        _FakeServer.started.append(self)
        return self

    def __exit__(self, *exc):
        self.running = False

    def generate(self, prompt_ids, max_new_tokens):
        from draftsmith import generate
        from draftsmith.engines.base import EngineResult, SpecCounters

        assert self.running
        out = generate(self.model, prompt_ids, max_new_tokens=max_new_tokens).token_ids
        if self.draft is None:
            return EngineResult(out, 0.01)
        if self.skew and len(out) > 3:
            out = out[:3] + [(out[3] + 1) % 128] + out[4:]
        rounds = len(out) // 2
        per_pos = [rounds] + [0] * (self.k - 1)
        return EngineResult(out, 0.01, SpecCounters(rounds, rounds * self.k, rounds, per_pos))


def test_engine_rows_speedup_per_engine_agreement_and_gate(tiny, tmp_path, monkeypatch):
    from draftsmith.engines import open_engine  # noqa: F401  (the factory the bench calls)
    from draftsmith.gate import GateSection, gate, summarize_drafter

    _FakeServer.started = []
    skews = {"vllm": 0, "llama.cpp": 1}
    monkeypatch.setattr("draftsmith.engines.open_engine",
                        lambda engine, verifier, d=None, k=3, **kw: _FakeServer(engine, tiny, d, k, skews[engine]))
    cfg = _cfg(tmp_path, drafter=[], draft=[str(tmp_path)], engines=["draftsmith", "vllm", "llama.cpp"],
               hf_reference=False)
    perfect = DraftModelProposer(tiny)
    report = benchmark(tiny, _prompts(2), {"eagle3:d": perfect}, cfg, tmp_path, {"verifier": "tiny"},
                       draft_dirs={"eagle3:d": tmp_path})
    assert all(not s.running for s in _FakeServer.started) and len(_FakeServer.started) == 4  # all stopped
    names = [r["name"] for r in report["rows"]]
    assert names == ["plain (ours)", "eagle3:d k=2", "vllm plain", "vllm eagle3:d k=2", "llama.cpp plain",
                     "llama.cpp eagle3:d k=2"]
    vllm = report["rows"][3]
    assert vllm["engine"] == "vllm" and vllm["speedup"]["prompts"] == ["p0", "p1"]
    # speedups and verdicts are against the engine's own plain row
    from draftsmith.bench.measure import Row, baseline_index

    rows = [Row("plain (ours)", "plain", tiny), Row("x", "drafter", tiny)]
    for engine in ("vllm", "llama.cpp"):
        for kind in ("plain", "drafter"):
            rows.append(Row(f"{engine} {kind}", kind, tiny))
            rows[-1].engine = engine
    assert [baseline_index(rows, r) for r in range(len(rows))] == [0, 0, 2, 2, 4, 4]
    assert vllm["acceptance"]["acceptance_length"] == 2.0 and vllm["acceptance"]["per_position_acceptance"] == [1.0, 0.0]
    assert vllm["outputs"]["identical"] == 2
    # the planted off-by-one of the 'llama.cpp' server is a mismatch, judged against its own plain row
    assert report["rows"][5]["outputs"]["mismatch"] == 2
    agree = {a["engine"]: a for a in report["engine_agreement"]}
    assert agree["vllm"]["acceptance_length"] == {"ours": 3.0, "engine": 2.0}  # the perfect draft: k + 1 ours
    assert agree["vllm"]["ratio"] == pytest.approx(2 / 3)
    assert set(report["break_even"]) == {"eagle3:d"}  # the cost model is our engine's only
    md = (tmp_path / "report.md").read_text()
    assert "Acceptance where it is served" in md and "**vllm** eagle3:d k=2: acceptance length 2.00 vs ours 3.00" in md
    # the gate decides on the engine the user names
    s = summarize_drafter(report, "eagle3:d", "llama.cpp")
    assert s["engine"] == "llama.cpp" and s["outputs"]["mismatch"] == 2
    assert "mismatch" in gate(s, None, GateSection(engine="llama.cpp"))["reasons"][0]
    assert summarize_drafter(report, "eagle3:d", "vllm")["acceptance_length"] == 2.0


def test_served_acceptance_is_compared_with_our_row_that_drafts_under_the_same_rule(tmp_path):
    """Serving engines draft every token; where our row of that draft stops early (auto), the
    agreement is with our LABEL~off row, and the bench adds off where a serving engine is measured.
    The control: our early-stopping row alone has no counterpart, so nothing is compared."""
    from draftsmith.pipeline.budget import stop_rules

    def row(name, drafter, engine, rule, length):
        return {"name": name, "kind": "drafter", "drafter": drafter, "k": 2, "engine": engine,
                "draft_confidence": rule,
                "acceptance": {"acceptance_length": length, "per_position_acceptance": [0.5, 0.2]}}

    auto = row("d k=2", "d", "draftsmith", "auto", 1.9)
    off = row("d~off k=2", "d~off", "draftsmith", "off", 1.55)
    served = row("llama.cpp d k=2", "d", "llama.cpp", "off", 1.56)
    agree = bench_report.engine_agreement([auto, off, served])
    assert len(agree) == 1 and agree[0]["ours_row"] == "d~off k=2"
    assert agree[0]["acceptance_length"] == {"ours": 1.55, "engine": 1.56}
    assert bench_report.engine_agreement([auto, served]) == []  # different rules: not compared
    plain = dict(off, name="d k=2", drafter="d")  # a draft that never stops: its own label
    assert bench_report.engine_agreement([plain, served])[0]["ours_row"] == "d k=2"
    # the config adds off where a serving engine is measured, and the pipeline's budget counts it
    assert _cfg(tmp_path, engines=["draftsmith", "llama.cpp"]).draft_confidence == ["auto", "off"]
    assert _cfg(tmp_path, engines=["draftsmith"]).draft_confidence == ["auto"]
    assert _cfg(tmp_path, engines=["vllm"], draft_confidence=["off", "0.3"]).draft_confidence == ["off", "0.3"]
    from draftsmith.pipeline.config import build_config

    b = build_config(None, {"preset": "tiny", "gate": {"engine": "vllm"},
                            "bench": {"engines": ["draftsmith", "vllm"], "draft_confidence": ["auto"]}}).bench
    assert stop_rules(b) == ["auto", "off"]


def test_engine_settings_are_checked(tmp_path):
    with pytest.raises(DraftsmithError, match="--engines"):
        _cfg(tmp_path, engines=["tgi"])
    with pytest.raises(DraftsmithError, match="greedy"):
        _cfg(tmp_path, engines=["vllm"], temperature=0.7)
    from draftsmith.pipeline.config import build_config

    with pytest.raises(DraftsmithError, match="gate.engine"):
        build_config(None, {"preset": "tiny", "gate": {"engine": "vllm"}})
    assert build_config(None, {"preset": "tiny", "gate": {"engine": "vllm"},
                               "bench": {"engines": ["draftsmith", "vllm"]}}).gate.engine == "vllm"


_RSS_CHILD = """
import gc, re, sys
from pathlib import Path
import torch
from draftsmith.bench import measure

def rss_mb():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024

def churn():  # 300 MB in 100 KB tensors (below glibc's mmap threshold: heap pages), most then freed
    ts = [torch.ones(25_000) for _ in range(3000)]
    # every 30th is kept: the freed ones lie in holes between kept chunks, never at the heap's top,
    # so free() cannot hand them back on its own whatever state the imports left the heap in
    kept = ts[::30]
    del ts
    return kept

keep = churn()
base = rss_mb()
gc.collect()
after_gc = rss_mb()
measure.release_freed_memory()
after_trim = rss_mb()
keep = churn()
measure.reset_peak_memory(torch.device("cpu"))
peak = measure.peak_memory(torch.device("cpu"))[0] / 2**20
print(base, after_gc, after_trim, peak)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmRSS is read from Linux /proc")
def test_peak_rss_reset_releases_what_an_earlier_step_freed():
    """A bench after training in one process: the pages training freed are handed back before the
    peak is reset, so the bench's peak starts from what is in use. Negative control: a garbage
    collection alone leaves them resident (the heap keeps them). In a fresh interpreter, so the
    heap holds only what the check puts there."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RSS_CHILD], capture_output=True, text=True, check=True)
    base, after_gc, after_trim, peak = map(float, out.stdout.split())
    assert after_gc > base - 50  # the control: still resident after a collection
    assert after_trim < base - 200
    assert peak < base - 200


class _Cycle:
    """An object in a reference cycle: only the garbage collector frees it."""

    def __init__(self):
        self.me = self


def _cycle():
    import weakref

    c = _Cycle()
    return weakref.ref(c), c


def test_frozen_heap_keeps_collections_off_what_was_alive_before(monkeypatch):
    """Inside the block a collection frees cycles made inside it but walks nothing alive at its start:
    a cycle dropped there waits for the block's end (the control: the same drop outside is collected at
    once). A process that froze objects itself keeps them frozen."""
    import gc

    from draftsmith.bench.measure import frozen_heap

    before, held = _cycle()
    control, ctl = _cycle()
    del ctl
    gc.collect()
    assert control() is None  # control: a dropped cycle is collected when nothing is frozen
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        inside, obj = _cycle()
        del obj, held
        gc.collect()
        assert inside() is None  # made inside: collected inside
        assert before() is not None  # alive at the start: frozen, not walked
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None  # unfrozen at the end: collected
    # a process's own freeze is left as it is: no collection, freeze or unfreeze (spied, since a frozen
    # object that another thread frees changes the frozen count by itself; the control: the spies see the
    # three calls when nothing was frozen)
    calls: list[str] = []

    def spied():
        with monkeypatch.context() as mp:
            mp.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
            mp.setattr(gc, "freeze", lambda: calls.append("freeze"))
            mp.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
            with frozen_heap():
                pass

    spied()
    assert calls == ["collect", "freeze", "unfreeze"]
    calls.clear()
    gc.freeze()
    try:
        spied()
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


class _FreezeSpy(Row):
    """Records, on each call, how many objects are frozen out of the collector's passes."""

    def __init__(self):
        super().__init__("spy", "plain", None)
        self.frozen: list[int] = []

    def __call__(self, ids, max_new_tokens, temperature, seed):
        import gc

        self.frozen.append(gc.get_freeze_count())
        return [1] * max_new_tokens, {}, []


def test_timed_runs_collect_only_what_the_bench_made_since_its_warm_ups():
    """measure_interleaved's timed runs (each after a full collection) run inside frozen_heap, the
    warm-ups before it; the process is unfrozen afterwards (the speed: 14 s vs 52 s, BENCHMARKS 15j)."""
    import gc

    from draftsmith.bench.measure import BenchState, measure_interleaved

    row = _FreezeSpy()
    row.model = torch.nn.Linear(1, 1)
    st = BenchState([row], [("p0", [1, 2]), ("p1", [3])])
    measure_interleaved(st, 2, 0.0, 1, 0, progress=False, warmup_tokens=2)
    assert row.frozen[0] == 0 and len(row.frozen) == 3  # the warm-up, then two timed runs
    assert all(n > 0 for n in row.frozen[1:])
    assert gc.get_freeze_count() == 0 and len(st.results) == 2


# ----------------------------------------------------------------------------- --compile
class _CompilingRow(Row):
    """Sleeps ``pause`` seconds, which its stats report as compile time (as a first compiled call would)."""

    def __init__(self, pause: float, compile_reported: bool) -> None:
        super().__init__("fake", "plain", None)
        self.pause, self.compile_reported = pause, compile_reported

    def __call__(self, ids, max_new_tokens, temperature, seed):
        import time

        time.sleep(self.pause)
        return [1, 2], {"compile_seconds": self.pause if self.compile_reported else 0.0}, []


def test_timed_run_keeps_compile_time_out():
    ids = torch.tensor([1, 2, 3])
    assert timed_run(_CompilingRow(0.3, True), ids, 2, 0.0, 0).seconds < 0.1
    # negative control: the same pause, not reported as compile time, is timed
    assert timed_run(_CompilingRow(0.3, False), ids, 2, 0.0, 0).seconds >= 0.3


@pytest.mark.slow
def test_compiled_bench_rows_equal_plain_decoding_and_report_compile_time(tiny, tmp_path):
    from draft_factory import random_draft
    from draftsmith.decoding.proposers import Eagle3Proposer

    d = random_draft(tiny, vd=48, aux_layer_ids=[0, 1, 1])
    d.config.aux_layer_ids = [0, 1, 2]
    cfg = _cfg(tmp_path, num_draft_tokens=[2], compile=True, draft_precision=["as-loaded", "int8"])
    report = benchmark(tiny, _prompts(2), {"eagle3:d": Eagle3Proposer(d)}, cfg, tmp_path, {"verifier": "tiny"})
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"plain (ours)", "eagle3:d k=2", "eagle3:d@int8 k=2", "HF generate", "HF prompt lookup k=2"}
    ours = {"plain (ours)", "eagle3:d k=2", "eagle3:d@int8 k=2"}
    for name, r in rows.items():
        assert r["identical_output_rate"] == 1.0, name
        # our rows decode compiled steps; HF's rows run as users run them
        assert r["engine_path"] == (["lean+compiled"] if name in ours else []), name
        if name not in ours:
            assert r["compile_seconds"] == 0, name
    # the verifier's and each draft's graphs were compiled once, while their costs were measured,
    # and reused by every row after (a row compiles only a shape it is the first to meet)
    assert report["costs"]["compile_seconds"] > 0
    assert report["provenance"]["compile"] is True
    # the plain row and the step table ran the draft's aux-output graphs (runner.shared_aux_outputs)
    assert report["provenance"]["compile_shared_aux"] == [0, 1, 2]
    assert "compiled steps" in (tmp_path / "report.md").read_text()


# ----------------------------------------------------------------------------- --draft-confidence
def test_confidence_thresholds_are_the_marginal_price_over_t1():
    cpu = CostModel({1: 0.030, 2: 0.039, 3: 0.041, 4: 0.045}, draft_per_token=0.0015)
    assert costmodel.confidence_thresholds(cpu, 3) == pytest.approx([0.35, 0.0035 / 0.030, 0.0055 / 0.030])
    # verifying one more token nearly free (a GPU): every token is worth proposing
    gpu = CostModel({1: 0.010, 2: 0.0101, 3: 0.0102}, draft_per_token=0.0002)
    assert max(costmodel.confidence_thresholds(gpu, 2)) < 0.05
    # dearer than a token is worth: never proposed (capped at 1); beyond the table: extrapolated
    dear = CostModel({1: 0.010, 2: 0.025}, draft_per_token=0.0)
    assert costmodel.confidence_thresholds(dear, 2) == [1.0, 1.0]


def test_parse_confidence_normalises_and_names_the_flag():
    assert [measure.parse_confidence(v) for v in ("AUTO", " off", "0", "0.30", "1", 0.25)] == \
        ["auto", "off", "off", "0.3", "1", "0.25"]
    for bad in ("sure", "1.5", "-0.1", ""):
        with pytest.raises(DraftsmithError, match="--draft-confidence"):
            measure.parse_confidence(bad)
    with pytest.raises(DraftsmithError, match="--draft-confidence"):
        _cfg(Path("/tmp"), draft_confidence=[])


def test_draft_confidence_rows_side_by_side_are_lossless_and_report_their_rule(tiny, tmp_path):
    """--draft-confidence auto off 1: one row per setting on the same draft; auto's thresholds come
    from the drafter's own step prices (measured drafting every token), 1 never drafts, and every
    row reproduces plain decoding."""
    from draft_factory import random_draft
    from draftsmith.decoding.proposers import Eagle3Proposer

    d = random_draft(tiny, vd=48, aux_layer_ids=[0, 1, 1])
    d.config.aux_layer_ids = [0, 1, 2]
    prop = Eagle3Proposer(d, min_confidence=0.7)  # a rule left from elsewhere: replaced
    cfg = _cfg(tmp_path, num_draft_tokens=[2], hf_reference=False,
               draft_confidence=["auto", "off", "1.0"])
    report = benchmark(tiny, _prompts(2), {"eagle3:d": prop}, cfg, tmp_path, {"verifier": "tiny"})
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"plain (ours)", "eagle3:d k=2", "eagle3:d~off k=2", "eagle3:d~1 k=2"}
    assert all(r["identical_output_rate"] == 1.0 for r in rows.values())
    rule = report["draft_confidence"]
    assert {n: c["setting"] for n, c in rule.items()} == {"eagle3:d": "auto", "eagle3:d~off": "off", "eagle3:d~1": "1"}
    be = report["break_even"]["eagle3:d"]
    prices = CostModel({int(n): t for n, t in rule["eagle3:d"]["t_verify_seconds"].items()},
                       draft_per_token=rule["eagle3:d"]["draft_per_token_seconds"])
    assert rule["eagle3:d"]["thresholds"] == pytest.approx(costmodel.confidence_thresholds(prices, 2))
    assert rule["eagle3:d"]["draft_per_token_seconds"] == pytest.approx(be["draft_per_token_seconds"])
    assert prop.min_confidence == tuple(rule["eagle3:d"]["thresholds"])
    assert rows["eagle3:d~1 k=2"]["acceptance"]["drafted_fraction"] == 0.0  # never sure enough to draft
    assert rows["eagle3:d~off k=2"]["acceptance"]["drafted_fraction"] == 1.0
    assert "stops drafting where its cumulative confidence falls below" in (tmp_path / "report.md").read_text()


def test_predict_prices_the_draft_steps_a_stopped_call_ran():
    """A call that stopped at l < k tokens ran l + 1 draft steps: 40 rounds of 0 tokens (1 step),
    20 of 1 (2 steps), 40 of 3 = k (3 steps) -> 0.4 + 0.4 + 1.2 = 2.0 steps per round."""
    costs = CostModel({1: 1.0, 2: 1.2, 3: 1.3, 4: 1.4}, draft_fixed=0.02, draft_per_token=0.05)
    profile = DrafterProfile(3, [0.5, 0.3, 0.2], [40, 20, 0, 40])
    p = predict(profile, costs, 3)
    verify = 0.4 * 1.0 + 0.2 * 1.2 + 0.4 * 1.4
    assert p.seconds_per_round == pytest.approx(verify + 0.02 + 0.05 * 2.0)
    # negative control: always full drafts pay k steps, as draft(k) says
    full = predict(DrafterProfile(3, [0.5, 0.3, 0.2], [0, 0, 0, 100]), costs, 3)
    assert full.seconds_per_round == pytest.approx(1.4 + costs.draft(3))


class _Reads(Proposer):
    """A proposer that reads the verifier's hidden states at ``aux`` (only its declaration matters here)."""

    requires_hidden_states = True

    def __init__(self, aux):
        self.aux_layer_ids = tuple(aux)

    def propose(self, context, k):
        raise AssertionError("not run")


def test_drafts_aux_picks_the_layers_most_drafts_read():
    from draftsmith.bench.run import drafts_aux

    ngram = NgramProposer()
    assert drafts_aux({"ngram": ngram}) == ()
    assert drafts_aux({"a": _Reads((1, 2)), "ngram": ngram, "b": _Reads((0, 3)), "c": _Reads((0, 3))}) == (0, 3)
    assert drafts_aux({"a": _Reads((1, 2)), "b": _Reads((0, 3))}) == (1, 2)  # a tie: the first seen


@pytest.mark.parametrize("compile", [True, False])
def test_a_compiled_bench_runs_its_plain_steps_on_the_drafts_aux_graphs(tiny, tmp_path, monkeypatch, compile):
    """benchmark() puts the verifier under shared_aux_outputs with its drafts' aux layers while it
    measures, under --compile only (False: the control), and takes it off after."""
    from draftsmith.bench import run
    from draftsmith.decoding import runner

    seen = []  # what the report's provenance records as compile_shared_aux
    monkeypatch.setattr(run, "_benchmark", lambda model, *a: seen.append(runner.shared_aux_layers(model)) or {})
    benchmark(tiny, _prompts(2), {"ngram": NgramProposer(), "d": _Reads((0, 1))}, _cfg(tmp_path, compile=compile),
              tmp_path)
    assert seen == [(0, 1) if compile else ()]
    assert tiny not in runner._SHARED_AUX


def test_a_report_says_when_a_rows_compiled_verify_paths_changed_across_a_resume(tiny, tmp_path):
    """Each process picks its compiled GEMM path per verify length by timing them; runs of one row with
    two different picks (a resumed compiled bench) are named in the report (control: one pick, no note)."""
    def run(tier: str) -> measure.RunResult:
        return measure.RunResult([1, 2, 3], 0.1, {"verify_tiers": {"2": {"tier": tier, "ms": {}}}})

    for tiers, noted in ((["template", "template"], False), (["template", "aten"], True)):
        state = measure.BenchState([Row("plain (ours)", "plain", tiny)], _prompts(2))
        state.results = {(0, p): [run(t)] for p, t in enumerate(tiers)}
        report = bench_report.build_report(state, _cfg(tmp_path), {})
        assert len(report["rows"][0]["verify_tier_choices"]) == (2 if noted else 1)
        assert ("took other GEMM paths" in bench_report.render_markdown(report)) is noted
