"""Budgets: the plan's arithmetic with synthetic rates (a fake machine), bad budgets, reuse of a
stored plan, the training cut, and the extrapolation line."""

from __future__ import annotations

import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.pipeline import budget as B
from draftsmith.pipeline.config import build_config

# a slow CPU: a 64-prompt regeneration batch costs 20 s + 0.5 s per token, capture 2 ms per token,
# training 1 ms per position, a decode step 40 ms
SLOW = B.Rates(regen_batch_fixed=20.0, regen_batch_per_token=0.5, batch_size=64, reply_tokens=256,
               prompt_tokens=120, capture_per_token=0.002, train_per_position=0.001, decode_per_token=0.04,
               load_seconds=60.0)
FAST = B.Rates(regen_batch_fixed=4.0, regen_batch_per_token=0.1, batch_size=64, reply_tokens=256,
               prompt_tokens=120, capture_per_token=0.0004, train_per_position=0.0002, decode_per_token=0.01,
               load_seconds=20.0)
KW = dict(max_new_tokens=256, epochs=3.0, pack_tokens=1024, bench_max_new_tokens=128, bench_rows=2)


@pytest.mark.parametrize("rates", [SLOW, FAST], ids=["slow", "fast"])
@pytest.mark.parametrize("minutes", [10, 20, 40])
def test_plan_fits_the_budget(rates, minutes):
    plan = B.make_plan(minutes, rates, **KW)
    assert plan.predicted_total * B.SAFETY <= minutes * 60 * 1.001
    assert plan.predicted_total * B.SAFETY >= 0.85 * minutes * 60  # and uses it
    assert plan.num_conversations >= B.MIN_CONVERSATIONS and plan.bench_prompts >= B.MIN_BENCH_PROMPTS
    assert set(plan.predicted_seconds) == {"fixed", "regenerate", "capture", "train", "bench"}
    assert "plan for" in plan.describe() and f"{plan.num_conversations} prompts" in plan.describe()


def test_plan_by_hand():
    plan = B.make_plan(20, FAST, **KW)
    # per conversation: regenerate (4 + 256*0.1)/64, capture 376*0.0004, train 3*376*0.0002
    per_conv = (4 + 25.6) / 64 + 376 * 0.0004 + 3 * 376 * 0.0002
    bench_per_prompt = 2 * (120 * 0.0004 + 128 * 0.01)
    bench_fixed = bench_per_prompt + 120 * 0.01  # a warm-up run per row, the bare step table
    prompts = int((0.2 * 1200 / 1.1 - bench_fixed) // bench_per_prompt)
    assert plan.bench_prompts == prompts
    left = 1200 / 1.1 - 20.0 - (bench_fixed + prompts * bench_per_prompt)
    n = int(left // per_conv) // 64 * 64  # whole batches
    assert plan.num_conversations == n
    # what the rounding left over goes to more epochs
    spare = left - (n // 64) * (4 + 25.6) - n * 376 * 0.0004 - n * 3 * 376 * 0.0002
    assert plan.epochs == pytest.approx(3 + spare / (n * 376 * 0.0002), abs=1e-3)


def test_more_budget_more_data_slower_machine_less():
    assert B.make_plan(40, SLOW, **KW).num_conversations > 1.8 * B.make_plan(20, SLOW, **KW).num_conversations
    assert B.make_plan(20, FAST, **KW).num_conversations > 3 * B.make_plan(20, SLOW, **KW).num_conversations


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf")])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(DraftsmithError, match="budget"):
        B.make_plan(bad, FAST, **KW)
    with pytest.raises(DraftsmithError, match="budget"):
        build_config(None, {"budget": bad})
    with pytest.raises(DraftsmithError, match="budget"):
        build_config(None, {"budget": "soon"})


def test_too_small_a_budget_names_the_minimum():
    with pytest.raises(DraftsmithError, match=r"too small .* it needs at least (\d+) minutes here") as e:
        B.make_plan(2, SLOW, **KW)
    need = int(str(e.value).split("at least ")[1].split(" ")[0])
    B.make_plan(need, SLOW, **KW)  # the stated minimum is enough
    with pytest.raises(DraftsmithError):
        B.make_plan(need - 1, SLOW, **KW)


def test_small_preset_is_a_twenty_minute_budget():
    assert build_config(None, {}).budget == 20.0
    assert build_config(None, {"preset": "tiny"}).budget is None
    assert build_config(None, {"budget": 40}).budget == 40.0


def test_stored_plan_is_reused_only_for_the_same_key(tmp_path):
    plan = B.make_plan(20, FAST, **KW)
    key = {"budget": 20, "machine": {"cpu": "x"}, "config": {"a": 1}}
    B.save_plan(tmp_path / "plan.json", key, plan)
    again = B.load_plan(tmp_path / "plan.json", key)
    assert again is not None and again.num_conversations == plan.num_conversations
    assert B.load_plan(tmp_path / "plan.json", {**key, "budget": 40}) is None
    assert B.load_plan(tmp_path / "plan.json", {**key, "machine": {"cpu": "y"}}) is None
    assert B.load_plan(tmp_path / "missing.json", key) is None


def test_extrapolation_from_a_log_curve(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # val acceptance = 1.2 + 0.1 * ln(step): the fit recovers it and carries it to 2x and 4x the steps
    import math

    path.write_text("".join(json.dumps({"step": s, "val_acceptance_length": 1.2 + 0.1 * math.log(s)}) + "\n"
                            for s in (10, 20, 40, 80)))
    fit = B.extrapolate(path)
    assert fit["steps"] == 80 and fit["slope_per_log_step"] == pytest.approx(0.1)
    assert fit["at"]["2x"] == pytest.approx(1.2 + 0.1 * math.log(160))
    line = B.bigger_budget_line(fit, 20)
    assert "40 / 80 minutes" in line and "extrapolation" in line
    path.write_text(json.dumps({"step": 10, "val_acceptance_length": 1.3}) + "\n")
    assert B.extrapolate(path) is None and "Too few" in B.bigger_budget_line(None, 20)


def test_fit_training_uses_the_time_left_and_is_stored(tmp_path):
    import dataclasses

    cfg = build_config(None, {"out": str(tmp_path)})
    plan = B.make_plan(20, FAST, **KW)
    B.save_plan(tmp_path / "plan.json", {"k": 1}, plan)
    tokens = int(plan.num_conversations * 200)  # replies came out shorter than planned: time to spare
    fitted = B.fit_training(cfg, plan, tokens, elapsed=plan.predicted_seconds["regenerate"], out=tmp_path)
    stored = json.loads((tmp_path / "plan.json").read_text())["train_fit"]
    # training fills the time left itself (it times its own steps), capped at twice the asked epochs
    assert fitted.train.epochs == 2 * cfg.train.epochs
    assert cfg.train.epochs < stored["priced_epochs"] <= 2 * cfg.train.epochs
    left = 20 * 60 / B.SAFETY - plan.predicted_seconds["regenerate"] - plan.predicted_seconds["bench"]
    assert fitted.train.target_minutes == pytest.approx(left / 60, abs=0.01)
    assert fitted.train.max_minutes == pytest.approx(1.15 * left / 60, abs=0.01)
    # a rerun (cached steps, no time elapsed) trains exactly the same
    again = B.fit_training(cfg, plan, tokens, elapsed=0.0, out=tmp_path)
    assert again.train == fitted.train
    assert (again.train.epochs, again.train.target_minutes, again.train.max_minutes) == (
        stored["epochs"], stored["target_minutes"], stored["max_minutes"])


def test_regeneration_may_run_until_capture_training_and_the_bench_need_the_rest():
    plan = B.make_plan(20, FAST, **KW)
    p = plan.predicted_seconds
    after = p["capture"] + p["train"] + p["bench"]
    assert B.regeneration_seconds(plan, 100.0) == pytest.approx(1200 / B.SAFETY - 100 - after)
    # at the plan's own pace it is not cut (the plan fills the budget over SAFETY: all of it is regeneration's)
    assert B.regeneration_seconds(plan, p["fixed"]) >= p["regenerate"]
    assert B.regeneration_seconds(plan, p["fixed"]) <= p["regenerate"] + 0.15 * 1200  # and not much more
    # a slow start leaves it less; a resumed run's earlier steps count in elapsed
    assert B.regeneration_seconds(plan, p["fixed"] + 300) == pytest.approx(B.regeneration_seconds(plan, p["fixed"]) - 300)
    # a top-up (sized on this run's measured rate) gets its price and TOPUP_SLACK
    assert B.regeneration_seconds(plan, 900.0, "topup_regenerate", 80.0) == pytest.approx(80.0 * (1 + B.TOPUP_SLACK))


def test_regeneration_costs_discount_the_first_calls_warm_up():
    """Batches cost 10 s + 0.5 s per decode step; the first call of a run pays 3 s of warm-up
    more, and the first call of each new reply length 0.2 s per step it has not seen before."""
    from draftsmith.pipeline.budget import LONG_REPLY, SHORT_REPLY, regeneration_costs

    calls = []

    def timed(n):
        new_steps = n - max([c for c in calls] or [0])  # cache lengths not seen in an earlier call
        calls.append(n)
        return 10.0 + 0.5 * n + (3.0 if len(calls) == 1 else 0.0) + 0.2 * max(new_steps, 0)

    fixed, per_token, short = regeneration_costs(timed)
    assert calls == [SHORT_REPLY, LONG_REPLY, SHORT_REPLY, LONG_REPLY]
    assert per_token == pytest.approx(0.5) and fixed == pytest.approx(10.0)
    assert short == pytest.approx(10.0 + 0.5 * SHORT_REPLY)
    # negative control: the previous rule (the faster short run, the first long run) overprices a step
    first_long = 10.0 + 0.5 * LONG_REPLY + 0.2 * (LONG_REPLY - SHORT_REPLY)
    steady_short = 10.0 + 0.5 * SHORT_REPLY
    assert (first_long - steady_short) / (LONG_REPLY - SHORT_REPLY) > 0.5 * 1.3


def test_limiting_onednn_below_amx_turns_bf16_data_off(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes an AMX machine plan and train as a CPU without AMX does
    (float32 data step), and a plan made with AMX is not reused then."""
    import torch

    from draftsmith.pipeline.budget import machine_key
    from draftsmith.pipeline.steps import data_dtype
    from draftsmith.utils import cpu_has_amx

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu_has_amx() and data_dtype("auto", "cpu") == "bfloat16"  # control: the flag decides
    with_amx = machine_key()
    for isa in ("AVX2", "avx512_core", "AVX512_CORE_BF16"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert not cpu_has_amx() and data_dtype("auto", "cpu") == "float32"
        assert machine_key() != with_amx
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert cpu_has_amx()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not cpu_has_amx() and data_dtype("auto", "cpu") == "float32"


def test_avx512_bf16_without_amx_takes_the_bf16_data_step_and_training(monkeypatch):
    """A CPU with AVX-512 BF16 and no AMX (the AMD EPYC, Zen 4) plans, regenerates and trains in
    bfloat16 (1.6-1.75x float32 there); limiting oneDNN below BF16, or a CPU with neither, keeps
    float32 (the controls); the plan's machine key tells them apart."""
    import torch

    from draftsmith.pipeline.budget import machine_key
    from draftsmith.pipeline.steps import data_dtype
    from draftsmith.train.loop import _use_bf16
    from draftsmith.utils import cpu_fast_bf16

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu_fast_bf16() and data_dtype("auto", "cpu") == "bfloat16" and _use_bf16("auto", cpu)
    assert data_dtype("float32", "cpu") == "float32" and not _use_bf16("fp32", cpu)  # asked: kept
    bf16_key = machine_key()
    for isa in ("AVX2", "AVX512_CORE"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert not cpu_fast_bf16() and data_dtype("auto", "cpu") == "float32" and not _use_bf16("auto", cpu)
        assert machine_key() != bf16_key
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpu_fast_bf16()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)  # AVX2 / AVX-512 only
    assert not cpu_fast_bf16() and data_dtype("auto", "cpu") == "float32" and not _use_bf16("auto", cpu)


def test_prompts_regeneration_drops_are_planned_for():
    """Regeneration drops prompts over data.max_prompt_tokens (13 of 64 ShareGPT prompts at 512):
    the plan asks for that many more, so the data it trains on is what the budget pays for."""
    import dataclasses

    full = B.make_plan(20, FAST, **KW)
    half = B.make_plan(20, dataclasses.replace(FAST, kept_fraction=0.5), **KW)
    assert half.predicted_total * B.SAFETY <= 20 * 60 * 1.001
    assert half.predicted_seconds["train"] == pytest.approx(full.predicted_seconds["train"], rel=0.15)
    assert half.num_conversations == pytest.approx(2 * full.num_conversations, rel=0.1)
    assert (half.num_conversations * 0.5) % 64 == 0  # whole batches of the kept prompts


def test_kept_prompts_share_and_mean_length():
    """The kept share and mean length count only prompts within the limit; none fitting is refused."""
    assert B.kept_prompts([10, 20, 600, 30], 512) == (0.75, 20.0)
    assert B.kept_prompts([10, 600], None) == (1.0, 305.0)
    with pytest.raises(DraftsmithError, match="none of the 2 sampled prompts"):
        B.kept_prompts([600, 700], 512)


def _regenerated(path, n, prompt_tokens, reply_tokens, empty=0):
    rows = [{"id": f"c{i}", "meta": {"prompt_tokens": prompt_tokens, "completion_tokens": reply_tokens,
                                     "finish_reason": "empty" if i < empty else "stop"}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _planned(tmp_path, minutes=10, rates=SLOW, **over):
    import dataclasses

    cfg = build_config(None, {"out": str(tmp_path)})
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **over)) if over else cfg
    plan = B.make_plan(minutes, rates, **KW)
    B.save_plan(tmp_path / "plan.json", {"k": 1}, plan)
    return B.apply_plan(cfg, plan), plan


def test_top_up_buys_what_short_replies_left_over_and_is_stored(tmp_path):
    """Replies shorter than planned and regeneration on time: the spare time buys more prompts."""
    cfg, plan = _planned(tmp_path)
    m = round(plan.num_conversations * SLOW.kept_fraction)
    regen = plan.predicted_seconds["regenerate"]
    path = _regenerated(tmp_path / "r.jsonl", m, 120, 80)  # replies of 80 tokens where 256 were priced
    got = B.top_up(cfg, plan, path, regen, plan.predicted_seconds["fixed"] + regen, tmp_path)
    assert got["prompts"] >= SLOW.batch_size / 2 and got["tokens"] == m * 200
    # what it buys fits in the spare time, and it is most of it
    assert got["predicted_seconds"] <= got["spare_seconds"] < got["predicted_seconds"] + got["seconds_per_conversation"]
    # a rerun (regeneration cached: no time measured) asks for the same prompts
    assert B.top_up(cfg, plan, path, None, 0.0, tmp_path) == got
    assert json.loads((tmp_path / "plan.json").read_text())["top_up"] == got


def test_top_up_reprices_capture_and_training_and_keeps_the_cheaper(tmp_path):
    """The plan's capture and training prices came from a calibration that ran beside another
    program: replies as long as planned leave no spare time at those prices, but timed again on
    the replies just made, capture and training cost a third: the top-up buys the difference.
    Negative control: a re-timing dearer than the calibration changes nothing (the cheaper counts)."""
    cfg, plan = _planned(tmp_path)
    m = round(plan.num_conversations * SLOW.kept_fraction)
    regen = plan.predicted_seconds["regenerate"]
    full = _regenerated(tmp_path / "full.jsonl", m, 120, 256)
    elapsed = plan.predicted_seconds["fixed"] + regen
    r = plan.rates
    base = json.loads((tmp_path / "plan.json").read_text())

    def fresh():
        (tmp_path / "plan.json").write_text(json.dumps(base))

    def prices(factor, decode=1.0):
        return lambda: {"capture_per_token": factor * r["capture_per_token"],
                        "train_per_position": factor * r["train_per_position"],
                        "decode_per_token": decode * r["decode_per_token"]}

    dearer = B.top_up(cfg, plan, full, regen, elapsed, tmp_path, reprice=prices(3.0, 3.0))
    assert dearer["prompts"] == 0 and dearer["repriced"]["train_per_position"] == 3 * r["train_per_position"]
    assert dearer["bench_seconds"] == pytest.approx(plan.predicted_seconds["bench"], abs=0.1)
    fresh()
    cheaper = B.top_up(cfg, plan, full, regen, elapsed, tmp_path, reprice=prices(1 / 3))
    assert cheaper["prompts"] >= SLOW.batch_size / 2
    assert cheaper["predicted_seconds"] <= cheaper["spare_seconds"]
    # the stored decision is reused by a rerun without timing anything again
    assert B.top_up(cfg, plan, full, None, 0.0, tmp_path, reprice=lambda: 1 / 0) == cheaper
    # a decode re-priced at a quarter: the bench is given a quarter of its time, and the rest goes
    # to data now and to training after (fit_training reads the re-priced bench)
    fresh()
    bench_cheap = B.top_up(cfg, plan, full, regen, elapsed, tmp_path, reprice=prices(1.0, 0.25))
    assert bench_cheap["bench_seconds"] == pytest.approx(plan.predicted_seconds["bench"] / 4, abs=0.1)
    assert bench_cheap["spare_seconds"] > 0.7 * plan.predicted_seconds["bench"]
    fitted = B.fit_training(cfg, plan, 10_000, elapsed, tmp_path).train.target_minutes
    fresh()
    assert B.fit_training(cfg, plan, 10_000, elapsed, tmp_path).train.target_minutes == pytest.approx(
        fitted - 0.75 * plan.predicted_seconds["bench"] / 60, abs=0.02)


def test_top_up_is_zero_when_the_plan_held_or_ran_over(tmp_path):
    """Negative controls: replies as long as planned, a late regeneration, a cached one, self-written prompts."""
    cfg, plan = _planned(tmp_path)
    m = round(plan.num_conversations * SLOW.kept_fraction)
    regen = plan.predicted_seconds["regenerate"]
    full = _regenerated(tmp_path / "full.jsonl", m, 120, 256)
    short = _regenerated(tmp_path / "short.jsonl", m, 120, 80)
    elapsed = plan.predicted_seconds["fixed"] + regen
    for path, seconds, at in [(full, regen, elapsed), (short, 3 * regen, elapsed + 2 * regen), (short, None, 0.0)]:
        (tmp_path / "plan.json").write_text(json.dumps({k: v for k, v in json.loads(
            (tmp_path / "plan.json").read_text()).items() if k != "top_up"}))
        assert B.top_up(cfg, plan, path, seconds, at, tmp_path)["prompts"] == 0, (path.name, seconds)
    (tmp_path / "plan.json").unlink()
    cfg_self, plan = _planned(tmp_path, dataset="self")
    assert B.top_up(cfg_self, plan, short, regen, elapsed, tmp_path)["prompts"] == 0
    # empty replies are not captured, so they are not counted as data
    assert B.regenerated_tokens(_regenerated(tmp_path / "e.jsonl", 10, 100, 50, empty=4)) == (6, 900)


def test_regenerated_tokens_reads_replies_with_unicode_line_separators(tmp_path):
    """A reply holding U+2028 / U+0085 (written raw, ensure_ascii=False) is one record, not two lines."""
    path = _regenerated(tmp_path / "r.jsonl", 3, 10, 5)
    rec = {"id": "u", "messages": [{"role": "assistant", "content": "a\u2028b\x85c\x1cd"}],
           "meta": {"prompt_tokens": 7, "completion_tokens": 4, "finish_reason": "stop"}}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    assert len(path.read_text(encoding="utf-8").splitlines()) > 4  # what str.splitlines would have read
    assert B.regenerated_tokens(path) == (4, 3 * 15 + 11)


def test_bench_rows_count_every_precision_quantization_and_reference():
    from draftsmith.bench import BenchSettings
    from draftsmith.pipeline.budget import bench_row_count

    base = BenchSettings(num_draft_tokens=[3, 5], hf_reference=False)
    assert bench_row_count(base, drafts=1) == 1 + 2
    assert bench_row_count(base, drafts=2) == 1 + 4  # the previous draft's rows too
    two = BenchSettings(num_draft_tokens=[3, 5], hf_reference=True, draft_precision=["as-loaded", "int8"])
    assert bench_row_count(two, drafts=1) == 1 + 4 + 2
    rules = BenchSettings(num_draft_tokens=[3, 5], hf_reference=False, draft_confidence=["auto", "off", "0.3"])
    assert bench_row_count(rules, drafts=1) == 1 + 3 * 2  # each stop rule a row per k
    q = BenchSettings(num_draft_tokens=[3], hf_reference=False, quantize=["int8"])
    assert bench_row_count(q, drafts=1) == 1 + 1 + (1 + 1)
    chosen = BenchSettings(num_draft_tokens=[1, 2, 3], hf_reference=False, choose_k=True)
    assert bench_row_count(chosen, drafts=2) == 1 + 2  # one k timed per draft ...
    # ... after a pilot decode of pilot_prompts per draft and precision, one decode each
    one = B.bench_seconds(FAST, 1, chosen.max_new_tokens, 1, 1) - B.bench_seconds(FAST, 0, chosen.max_new_tokens, 1, 1)
    assert B.pilot_seconds(FAST, chosen, drafts=2) == pytest.approx(2 * 2 * one)
    assert B.pilot_seconds(FAST, base, drafts=2) == 0.0  # negative control: no choice, no pilot


def test_layout_probe_is_priced_for_auto_only():
    """--weight-layout auto's probe: 3 layouts (as loaded, oneDNN, the few-row kernel) x 2 passes, each a
    prefill of the cost context and 6 steps of each n in {1, k + 1} (n tokens at 1 + 0.1 (n - 1)
    one-token steps); a fixed layout costs nothing (the negative control)."""
    from draftsmith.bench import BenchSettings

    auto = BenchSettings(num_draft_tokens=[1, 3], max_new_tokens=128)
    assert auto.weight_layout == "auto"
    steps = 6 * (1.0 + 1.1 + 1.3)  # n = 1, 2, 4
    prefill = (FAST.prompt_tokens + 64) * FAST.capture_per_token
    assert B.layout_probe_seconds(FAST, auto) == pytest.approx(6 * (prefill + steps * FAST.decode_per_token))
    assert B.layout_probe_seconds(FAST, BenchSettings(weight_layout="out-in")) == 0.0
    assert B.layout_probe_seconds(FAST, BenchSettings(compile=True)) == 0.0  # compiled: nothing to probe
    assert B.layout_probe_seconds(FAST, auto, on_cpu=False) == 0.0  # off the CPU: the loaded layout only


def test_price_calibration_counts_every_draft_precision_and_k():
    """The bench's in-situ calibration: 3 passes, each a plain decode and one per draft, precision and k
    (k = 1 always among them), of up to 64 tokens, each with its prompt's prefill."""
    from draftsmith.bench import BenchSettings

    one = FAST.prompt_tokens * FAST.capture_per_token + 64 * FAST.decode_per_token
    two = BenchSettings(num_draft_tokens=[2, 3], max_new_tokens=128, draft_precision=["as-loaded", "int8"])
    assert B.calibration_seconds(FAST, two, drafts=1) == pytest.approx(3 * (1 + 2 * 3) * one)
    assert B.calibration_seconds(FAST, two, drafts=2) == pytest.approx(3 * (1 + 2 * 2 * 3) * one)
    rules = BenchSettings(num_draft_tokens=[2, 3], max_new_tokens=128, draft_confidence=["auto", "off"])
    assert B.calibration_seconds(FAST, rules, drafts=1) == pytest.approx(3 * (1 + 2 * 3) * one)
    short = BenchSettings(num_draft_tokens=[1], max_new_tokens=32)
    assert B.calibration_seconds(FAST, short, drafts=1) == pytest.approx(
        3 * 2 * (FAST.prompt_tokens * FAST.capture_per_token + 32 * FAST.decode_per_token))


def test_small_preset_chooses_k_and_plans_its_pilot(tmp_path):
    from draftsmith.pipeline.config import build_config

    cfg = build_config(overrides={"out": str(tmp_path / "o")})
    assert cfg.bench.choose_k and cfg.bench.num_draft_tokens == [1, 2, 3]
    full = build_config(overrides={"preset": "full", "out": str(tmp_path / "f")}).bench
    assert full.choose_k and full.num_prompts + full.pilot_prompts <= 80  # MT-Bench's 80 hold both
    plain = B.make_plan(20, FAST, **KW)
    piloted = B.make_plan(20, FAST, **KW, bench_pilot_seconds=60.0, max_prompts=6)
    assert piloted.predicted_total * B.SAFETY <= 20 * 60 * 1.001
    assert piloted.predicted_seconds["bench"] == pytest.approx(
        60.0 + B.bench_seconds(FAST, piloted.bench_prompts, KW["bench_max_new_tokens"], KW["bench_rows"], 1))
    assert piloted.bench_prompts == 6 < plain.bench_prompts  # the pilot's prompts are not the bench's


def test_plan_reserves_the_bench_compile_time():
    plain = B.make_plan(20, FAST, **KW)
    compiled = B.make_plan(20, FAST, **KW, bench_compile_seconds=150.0)
    assert compiled.predicted_total * B.SAFETY <= 20 * 60 * 1.001  # still fits
    # the bench's prediction holds the compile time beside its prompts' decoding ...
    assert compiled.predicted_seconds["bench"] == pytest.approx(
        150.0 + B.bench_seconds(FAST, compiled.bench_prompts, KW["bench_max_new_tokens"], KW["bench_rows"], 1))
    # ... paid for with fewer bench prompts or conversations (the bench keeps its share of the budget)
    assert (compiled.bench_prompts, compiled.num_conversations) < (plain.bench_prompts, plain.num_conversations)
    assert B.make_plan(20, FAST, **KW, bench_compile_seconds=0.0) == plain  # negative control: nothing reserved


def test_decode_price_is_the_cheapest_layout_the_bench_may_decode_in(monkeypatch):
    """The plan prices the bench's decode steps in the layout it will decode in: with auto (eager),
    the cheapest of the probe's candidates; a fixed layout, or compiled steps (as loaded), that one
    alone (the controls). A fake clock makes each layout's step cost differ."""
    import types

    import torch

    import draftsmith.data.sources as sources
    import draftsmith.decoding.engine as engine
    from draftsmith.bench import BenchSettings
    from draftsmith.models.verifier import CppLinear, OneDNNLinear

    lin = torch.nn.Linear(4, 4)
    v = types.SimpleNamespace(model=torch.nn.Sequential(lin), tokenizer=None)
    monkeypatch.setattr(sources, "eval_set", lambda name, tok, limit: [("p", [1, 2, 3])])
    step = {torch.nn.Linear: 0.05, OneDNNLinear: 0.04, CppLinear: 0.03}
    seen = []
    clock = [0.0]
    monkeypatch.setattr(B, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def fake_generate(model, prompt, max_new_tokens, **kw):
        seen.append(type(lin))
        clock[0] += 0.5 + step[type(lin)] * (max_new_tokens - 1)  # prefill, then the steps
        return types.SimpleNamespace(stats={"prefill_seconds": 0.5}, token_ids=list(range(max_new_tokens)))

    monkeypatch.setattr(engine, "generate", fake_generate)
    from draftsmith.bench import measure

    cands = measure.layout_candidates(v.model)
    price = B.decode_price(v, BenchSettings())  # auto
    assert price == pytest.approx(min(step[{"out-in": torch.nn.Linear, "onednn": OneDNNLinear,
                                            "cpp": CppLinear}[c]] for c in cands))
    assert len(seen) == 2 * len(cands) and type(lin) is torch.nn.Linear  # warm-up + timed each; put back
    assert B.decode_price(v, BenchSettings(weight_layout="out-in")) == pytest.approx(0.05)
    assert B.decode_price(v, BenchSettings(compile=True)) == pytest.approx(0.05)
    if "onednn" in cands:
        assert B.decode_price(v, BenchSettings(weight_layout="onednn")) == pytest.approx(0.04)
