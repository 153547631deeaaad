"""Budgets in minutes: measure this machine, then size the run to fit.

A user thinks "what is the best draft I can get in 20 minutes here?", not "how many
conversations". :func:`calibrate` times each step of the real pipeline on a handful
of real inputs (the first seconds of the run): a regeneration batch at two reply
lengths (prefill and per-token cost), the capture forward of those replies, a few
training steps on the captured hidden states, and one plain decode for the bench.
:func:`make_plan` turns those rates into a data size, a training length and a bench
size whose predicted total fits the budget, and says what each step should take.

The plan is written to ``OUT/plan.json`` with the budget, the machine (CPU model,
threads, device) and the configuration it was made for; a rerun with the same
budget on the same machine reuses it instead of measuring again, so its steps come
out of the step cache. After regeneration, :func:`top_up` times capture, training and a
decode again (the cheaper of each pair of prices counts) and spends what the replies left
over on more prompts; :func:`fit_training` then gives training the time left as
``target_minutes`` (it times its own steps to fill it) and ``max_minutes`` (it stops with a
checkpoint there, and the report says so). An interrupted budgeted run resumed with the
same command is the same run: the decisions it has still to make (the top-up, training's
fit) count the time its cached steps took when they ran (``StepCache.earlier_seconds``),
so the whole run, not each attempt, fits the budget.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from draftsmith.engines import OURS
from draftsmith.errors import DraftsmithError
from draftsmith.gate import MIN_JUDGED_PROMPTS
from draftsmith.utils import complete_lines

#: shares of what is left after fixed costs: the bench's target share of the budget,
#: and the smallest useful run (prompts measured; conversations trained on)
BENCH_SHARE = 0.2
MIN_BENCH_PROMPTS = 6  # one k measured: the gate judges on all of them (gate.MIN_JUDGED_PROMPTS)
MAX_BENCH_PROMPTS = 80
MIN_CONVERSATIONS = 16
KEPT_SAMPLE = 256  # prompts tokenized to measure the share regeneration keeps
#: predicted minutes are multiplied by this before they are compared with the budget (a
#: plan that fits exactly on a quiet machine overruns on a busy one)
SAFETY = 1.1
#: a top-up regeneration may take this much longer than its price before it stops starting chunks
TOPUP_SLACK = 0.25
#: one-off compile time the bench reserves with ``bench.compile``: the verifier's graphs (the one-token
#: step and both verify candidates, each verify length timed once) and each draft's. Measured for
#: SmolLM2-135M and one draft at two precisions: 233 s on the SPR and 299 s on the EPYC with one verify
#: candidate, 326.5 s on the EPYC with two (BENCHMARKS.md 9q, 9n, 9s), where 90 + 2 x 30 s were reserved;
#: with the steps' host code in C++ (``runner.CPU_WRAPPER``), one int8 draft: 355-366 s on the SPR
#: against 233-235 s under the Python wrapper, side by side (BENCHMARKS.md 15). Since inductor's GEMM
#: template texts are parsed once per process (decoding/kernel_templates.py), one draft at two
#: precisions, k = 1 and 2: 179.3 s on the EPYC against 274.2 s without, its kernels built before
#: (a first compile builds them: ~+70 s; BENCHMARKS.md 15d). Since the plain rows and the step table
#: run the drafts' aux-output graphs (``runner.shared_aux_outputs``): 84.0 / 99.4 s against 165.5 /
#: 168.5 s without, and 197.3 s on an empty inductor cache (every C++ kernel built; BENCHMARKS.md 15e).
#: The SPR under its C++ wrapper is not re-measured since 15's 355-366 s; the reserve (300 s for one
#: draft at two precisions) covers the EPYC's first compile with 50% to spare
COMPILE_VERIFIER_SECONDS = 180.0
COMPILE_DRAFT_SECONDS = 60.0
#: reply lengths of the regeneration calibration (tokens): fixed cost and cost per decode step
SHORT_REPLY, LONG_REPLY = 2, 18
#: training steps the calibration times, and how many of them are warm-up (not counted)
TRAIN_STEPS, TRAIN_WARMUP_STEPS = 8, 3


@dataclass
class Rates:
    """What one unit of each step costs on this machine, in seconds (measured by :func:`calibrate`).

    Attributes:
        regen_batch_fixed: a regeneration batch's cost independent of the reply length
            (prefill of ``batch_size`` prompts, setup).
        regen_batch_per_token: each further decode step of a batch.
        batch_size: the batch those two were measured at.
        reply_tokens: mean reply length to expect (tokens), from the calibration replies.
        prompt_tokens: mean prompt length (tokens).
        capture_per_token: capture forward, per position a batch runs (prompt + reply, padding
            included; a run's batches, sorted by length over many conversations, pad little).
        train_per_position: one packed training position through the draft (forward + backward).
        decode_per_token: one plain decode step of the verifier at the bench's dtype.
        load_seconds: model loads and other fixed costs of a run (calibration included).
        kept_fraction: share of the prompts regeneration keeps (it drops those longer than
            ``data.max_prompt_tokens``), measured on ``KEPT_SAMPLE`` tokenized prompts.
    """

    regen_batch_fixed: float
    regen_batch_per_token: float
    batch_size: int
    reply_tokens: float
    prompt_tokens: float
    capture_per_token: float
    train_per_position: float
    decode_per_token: float
    load_seconds: float = 0.0
    kept_fraction: float = 1.0


@dataclass
class Plan:
    """Sizes that fit the budget, and what each step is predicted to take (seconds)."""

    budget_minutes: float
    num_conversations: int
    epochs: float
    bench_prompts: int
    train_max_minutes: float
    predicted_seconds: dict[str, float] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def predicted_total(self) -> float:
        return sum(self.predicted_seconds.values())

    def describe(self) -> str:
        s = self.predicted_seconds
        return (f"plan for {self.budget_minutes:g} min on this machine: regenerate {self.num_conversations} "
                f"prompts ~ {_mins(s['regenerate'])}, capture ~ {_mins(s['capture'])}, train {self.epochs:g} "
                f"epoch(s) ~ {_mins(s['train'])} (stops at {self.train_max_minutes:.1f} min), bench "
                f"{self.bench_prompts} prompts ~ {_mins(s['bench'])}; fixed costs ~ {_mins(s['fixed'])}; "
                f"total ~ {_mins(self.predicted_total)}")


def _mins(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def stop_rules(bench: Any) -> list[str]:
    """The bench's ``--draft-confidence`` settings as it runs them (``off`` joins them where a serving
    engine is measured: :class:`~draftsmith.bench.run.BenchConfig`)."""
    rules = list(bench.draft_confidence)
    if any(e != OURS for e in getattr(bench, "engines", [OURS])) and "off" not in rules:
        rules.append("off")
    return rules


def bench_row_count(bench: Any, drafts: int) -> int:
    """Rows our engine decodes in the pipeline's bench: plain, each draft at each precision, stop rule
    and k, HF generate and prompt lookup, and per quantization its plain row and each draft row again."""
    draft_rows = (drafts * len(bench.draft_precision) * len(stop_rules(bench))
                  * (1 if bench.choose_k else len(bench.num_draft_tokens)))
    return 1 + draft_rows + 2 * bench.hf_reference + len(bench.quantize) * (1 + draft_rows)


def bench_seconds(rates: Rates, prompts: int, max_new_tokens: int, rows: int, repeats: int) -> float:
    """A bench run: every row decodes every prompt (plus one warm-up per row and the bare step table;
    the in-situ calibration is :func:`calibration_seconds`)."""
    per_run = (rates.prompt_tokens * rates.capture_per_token + max_new_tokens * rates.decode_per_token)
    probes = 120 * rates.decode_per_token  # the bare table: 11 timings of each of 9 lengths, ~120 steps' worth
    return rows * per_run * (prompts * repeats + 1) + probes


def calibration_seconds(rates: Rates, bench: Any, drafts: int) -> float:
    """The bench's in-situ price calibration (:func:`draftsmith.bench.measure.measure_costs`): its
    passes decode up to ``CALIBRATION_TOKENS`` tokens plainly and with each draft at each precision,
    stop rule and k, priced at the plain decode's rate (a draft's tokens come no dearer)."""
    from draftsmith.bench.measure import CALIBRATION_PASSES, CALIBRATION_TOKENS

    runs = 1 + drafts * len(bench.draft_precision) * len(stop_rules(bench)) * len(set([1, *bench.num_draft_tokens]))
    tokens = min(bench.max_new_tokens, CALIBRATION_TOKENS)
    return CALIBRATION_PASSES * runs * (rates.prompt_tokens * rates.capture_per_token
                                        + tokens * rates.decode_per_token)


def pilot_seconds(rates: Rates, bench: Any, drafts: int) -> float:
    """``bench.choose_k``'s pilot decode: each draft at each precision and stop rule decodes ``bench.pilot_prompts``
    prompts once (0 without ``choose_k``)."""
    if not bench.choose_k:
        return 0.0
    runs = bench.pilot_prompts * drafts * len(bench.draft_precision) * len(stop_rules(bench))
    return bench_seconds(rates, runs, bench.max_new_tokens, 1, 1) - bench_seconds(rates, 0, bench.max_new_tokens, 1, 1)


def layout_probe_seconds(rates: Rates, bench: Any, on_cpu: bool = True) -> float:
    """``bench.weight_layout`` auto's probe (:func:`draftsmith.bench.measure.choose_weight_layout`):
    per candidate layout (up to three on a CPU: as loaded, oneDNN, the few-row kernel) and pass, the
    cost context's prefill and (warm-up + repeats) verify steps of each n in {1, k + 1}, each priced
    at a one-token step plus 10% per extra token.
    0 for a fixed layout, for compiled steps and off the CPU (only the loaded layout applies there)."""
    if bench.weight_layout != "auto" or getattr(bench, "compile", False) or not on_cpu:
        return 0.0
    from draftsmith.bench.measure import LAYOUT_PASSES, LAYOUT_REPEATS

    runs = 3 * LAYOUT_PASSES
    ns = sorted({1, *(k + 1 for k in bench.num_draft_tokens)})
    steps = (1 + LAYOUT_REPEATS) * sum(1 + 0.1 * (n - 1) for n in ns)
    prefill = (rates.prompt_tokens + bench.max_new_tokens // 2) * rates.capture_per_token
    return runs * (prefill + steps * rates.decode_per_token)


def make_plan(budget_minutes: float, rates: Rates, *, max_new_tokens: int, epochs: float, pack_tokens: int,
              bench_max_new_tokens: int, bench_rows: int, repeats: int = 1,
              machine: dict[str, Any] | None = None, min_prompts: int = MIN_BENCH_PROMPTS,
              bench_compile_seconds: float = 0.0, bench_pilot_seconds: float = 0.0,
              max_prompts: int = MAX_BENCH_PROMPTS) -> Plan:
    """Size the run so that its predicted time (times :data:`SAFETY`) fits ``budget_minutes``.

    The bench gets up to :data:`BENCH_SHARE` of the budget (at least ``min_prompts``
    prompts; the gate judges on half of them when several k are measured); data and training share the rest at the asked ``epochs``, so the number of
    conversations is what remains divided by one conversation's regeneration, capture and
    training cost. ``bench_compile_seconds`` is reserved for compiling the bench's steps once,
    ``bench_pilot_seconds`` for what the bench runs before timing (``bench.choose_k``'s pilot decode,
    :func:`pilot_seconds`, the weight-layout probe, :func:`layout_probe_seconds`, and the price
    calibration, :func:`calibration_seconds`); the
    bench gets at most ``max_prompts`` prompts.

    Raises:
        DraftsmithError: the budget cannot hold the smallest useful run; the message
            says how many minutes this machine needs for it.
    """
    if not math.isfinite(budget_minutes) or budget_minutes <= 0:
        raise DraftsmithError(f"--budget must be a positive number of minutes, got {budget_minutes}")
    budget = budget_minutes * 60 / SAFETY
    reply = min(rates.reply_tokens, max_new_tokens)
    kept = min(max(rates.kept_fraction, 0.05), 1.0)
    # per prompt asked for: only the kept share is regenerated, captured and trained on
    per_conv = {"regenerate": kept * (rates.regen_batch_fixed + reply * rates.regen_batch_per_token)
                / rates.batch_size,
                "capture": kept * (rates.prompt_tokens + reply) * rates.capture_per_token,
                "train": kept * epochs * (rates.prompt_tokens + reply) * rates.train_per_position}
    one_bench_prompt = bench_seconds(rates, 1, bench_max_new_tokens, bench_rows, repeats) - \
        bench_seconds(rates, 0, bench_max_new_tokens, bench_rows, repeats)
    bench_fixed = (bench_seconds(rates, 0, bench_max_new_tokens, bench_rows, repeats) + bench_compile_seconds
                   + bench_pilot_seconds)
    fixed = rates.load_seconds
    # a regeneration batch is paid whole even when it is not full
    min_batch = rates.regen_batch_fixed + reply * rates.regen_batch_per_token
    minimum = (fixed + bench_fixed + min_prompts * one_bench_prompt + min_batch
               + MIN_CONVERSATIONS / kept * (per_conv["capture"] + per_conv["train"]))
    if budget < minimum:
        raise DraftsmithError(f"--budget {budget_minutes:g} is too small for the smallest useful run on this "
                              f"machine ({MIN_CONVERSATIONS} conversations, {min_prompts} bench prompts): "
                              f"it needs at least {math.ceil(minimum * SAFETY / 60)} minutes here")
    prompts = int((BENCH_SHARE * budget - bench_fixed) // one_bench_prompt)
    prompts = max(min_prompts, min(max_prompts, prompts))
    bench = bench_fixed + prompts * one_bench_prompt
    left = budget - fixed - bench
    n = int(left // sum(per_conv.values()))
    least = math.ceil(MIN_CONVERSATIONS / kept)
    if n < least:  # the bench share left too little: shrink the bench to its minimum
        prompts = min_prompts
        bench = bench_fixed + prompts * one_bench_prompt
        n = max(least, int((budget - fixed - bench) // sum(per_conv.values())))
    m = n * kept  # conversations regenerated
    if m >= rates.batch_size:  # whole batches: a part-filled one costs as much as a full one
        m -= m % rates.batch_size
        n = math.ceil(m / kept - 1e-9)
    batches = math.ceil(m / rates.batch_size)
    tokens = rates.prompt_tokens + reply
    predicted = {"fixed": fixed, "regenerate": batches * min_batch, "capture": m * tokens * rates.capture_per_token,
                 "train": m * epochs * tokens * rates.train_per_position, "bench": bench}
    # what rounding to whole batches left over goes to training (at most twice the asked epochs)
    spare = budget - sum(predicted.values())
    extra = min(max(spare, 0.0) / (m * tokens * rates.train_per_position), epochs)
    epochs = epochs + extra
    predicted["train"] = m * epochs * tokens * rates.train_per_position
    # training may run over its prediction by a third before it is stopped (steps vary less than data)
    train_max = max(predicted["train"] * 4 / 3, 30.0) / 60
    return Plan(budget_minutes, n, round(epochs, 3), prompts, train_max, predicted, asdict(rates), dict(machine or {}))


def machine_key() -> dict[str, Any]:
    """What a plan's rates depend on: the CPU model, AMX in use, torch's thread count, the CUDA device."""
    import re

    import torch

    cpu = None
    try:
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        cpu = m.group(1).strip() if m else None
    except OSError:
        pass
    from draftsmith.utils import cpu_fast_bf16, cpu_has_amx

    return {"cpu": cpu, "amx": cpu_has_amx(), "bf16": cpu_fast_bf16(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def load_plan(path: Path, key: dict[str, Any]) -> Plan | None:
    """The plan stored at ``path`` when it was made for ``key`` (budget, machine, configuration)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if raw.get("key") != json.loads(json.dumps(key, sort_keys=True, default=str)):
        return None
    return Plan(**raw["plan"])


def save_plan(path: Path, key: dict[str, Any], plan: Plan) -> None:
    from draftsmith.utils import atomic_write_json

    atomic_write_json(Path(path), {"key": json.loads(json.dumps(key, sort_keys=True, default=str)),
                                   "plan": asdict(plan), "created": time.strftime("%Y-%m-%d %H:%M:%S")})


def regeneration_costs(timed_batch: Callable[[int], float]) -> tuple[float, float, float]:
    """A regeneration batch's fixed cost (prefill), its cost per decode step, and the short batch's time.

    ``timed_batch(n)`` regenerates one batch with replies of ``n`` tokens and returns its
    seconds. Each length runs twice (short, long, short, long) and the faster time counts:
    the first call of a length also pays one-time warm-up (bfloat16 kernels are made per new
    shape, and every decode step is a new cache length). Counting the first short call once
    made a 10-token batch look no dearer than a 2-token one (a fresh-clone demo planned ~0 s
    per step and regenerated 2.1x over its plan); counting the first long call priced a step
    at 0.61 s against 0.17 s steady, and a 40-minute run regenerated in 6 minutes what it had
    planned 20 for, then ended at 24 minutes.
    """
    short = timed_batch(SHORT_REPLY)
    long_ = timed_batch(LONG_REPLY)
    short = min(short, timed_batch(SHORT_REPLY))
    long_ = min(long_, timed_batch(LONG_REPLY))
    per_token = max((long_ - short) / (LONG_REPLY - SHORT_REPLY), 1e-6)
    return max(short - SHORT_REPLY * per_token, 0.0), per_token, short


def kept_prompts(lengths: list[int], limit: int | None) -> tuple[float, float]:
    """The share of prompts regeneration keeps (those of at most ``limit`` tokens) and their mean length.

    Raises:
        DraftsmithError: no prompt fits (nothing could be regenerated).
    """
    kept = [n for n in lengths if limit is None or n <= limit]
    if not kept:
        raise DraftsmithError(f"none of the {len(lengths)} sampled prompts fits in {limit} tokens; "
                              "raise data.max_prompt_tokens or lower data.max_new_tokens")
    return len(kept) / len(lengths), sum(kept) / len(kept)


def decode_price(v: Any, bench: Any) -> float:
    """Seconds per plain decode step of the verifier at the bench's dtype (24 steps after a warm-up),
    in the weight layout the bench will decode in: the one asked, or with ``auto`` (eager steps) the
    cheapest of the layouts its probe times (it keeps a one-token step within 3% of the fastest;
    as loaded, a plan priced the EPYC's bench at MKL's step, ~1.9x the few-row kernel's one it ran:
    BENCHMARKS.md 15g)."""
    from draftsmith.bench.measure import layout_candidates
    from draftsmith.data.sources import eval_set
    from draftsmith.decoding.engine import generate
    from draftsmith.models.verifier import weight_layout

    (_, prompt), = eval_set(bench.dataset, v.tokenizer, limit=1)
    asked = getattr(bench, "weight_layout", "out-in")
    if getattr(bench, "compile", False):
        layouts = ["out-in"]
    else:
        layouts = layout_candidates(v.model) if asked == "auto" else [asked]
    prices = []
    for layout in layouts:
        with weight_layout(v.model, layout):
            generate(v.model, prompt, max_new_tokens=4)  # warm-up
            t0 = time.perf_counter()
            out = generate(v.model, prompt, max_new_tokens=24, eos_token_id=[])
            seconds = time.perf_counter() - t0
        prices.append((seconds - out.stats["prefill_seconds"]) / max(len(out.token_ids) - 1, 1))
    return min(prices)


def capture_and_train_prices(vd: Any, v: Any, replied: list[Any], data: Any, train: Any,
                             work: Path) -> tuple[float, float]:
    """Seconds per captured position (padding included) and per trained position, timed on ``replied``.

    The capture runs one batch first: a first forward pays one-time costs (measured: capture priced
    3.6x too dear, 188 s planned against 52 s taken, float32 without AMX), which the run's capture
    pays only once. It is priced per position the forwards ran, padding included: the 16
    calibration prompts (20 to 512 tokens) pad their batches far more than a run's hundreds sorted
    by length do; per real token, capture was priced 2.8x (AVX2 limits) to 4x (AMX) too dear
    (BENCHMARKS.md 9b). Training runs :data:`TRAIN_STEPS` steps and the median after the first
    :data:`TRAIN_WARMUP_STEPS` counts: the first steps pay one-time costs (allocator, kernel
    selection), which priced training 2x too dear in a 10-minute run.
    """
    import shutil

    from draftsmith.data.capture import capture_samples, padded_tokens, resolve_aux_layer_ids
    from draftsmith.train.loop import TrainConfig
    from draftsmith.train.loop import train as run_train

    model, tok = vd.model, vd.tokenizer
    list(capture_samples(model, tok, replied[:data.capture_batch_size], max_length=data.max_length,
                         batch_size=data.capture_batch_size))
    t0 = time.perf_counter()
    samples = list(capture_samples(model, tok, replied, max_length=data.max_length,
                                   batch_size=data.capture_batch_size))
    seconds = time.perf_counter() - t0
    captured = sum(len(s["input_ids"]) for s in samples)
    capture_per_token = seconds / max(padded_tokens([len(s["input_ids"]) for s in samples],
                                                    data.capture_batch_size), 1)
    out = Path(work) / "train"
    shutil.rmtree(out, ignore_errors=True)
    pack = min(train.pack_tokens, max(64, captured // 4))
    cfg = TrainConfig(verifier=v.spec, out=str(out), draft_vocab_size=train.draft_vocab_size, pack_tokens=pack,
                      ttt_steps=train.ttt_steps, precision=train.precision, val_fraction=0.0, eval_every=10**6,
                      checkpoint_every=10**6, max_steps=TRAIN_STEPS, epochs=100.0, device=v.device)
    run_train(cfg, samples=samples, verifier=v.model, fingerprint="calibration",
              aux_layer_ids=resolve_aux_layer_ids(model), progress=False)
    rates = [json.loads(line).get("tokens_per_s") for line in complete_lines(out / "metrics.jsonl", cut=False)
             if line.strip()]
    steady = [r for r in rates[TRAIN_WARMUP_STEPS:] if r] or [r for r in rates if r]
    return capture_per_token, 1.0 / (sorted(steady)[len(steady) // 2])


def calibrate(vd: Any, v: Any, data: Any, train: Any, bench: Any, work: Path, progress: bool = False) -> Rates:
    """Time every step on a few real inputs (the first seconds of a budgeted run).

    Args:
        vd: the verifier in the data dtype (:class:`~draftsmith.pipeline.steps.Verifier`).
        v: the verifier in the run's dtype (training reads it, the bench decodes with it).
        data: the data settings (dataset, batch sizes, lengths).
        train: the training settings (pack length, precision).
        bench: the bench settings (dataset).
        work: a scratch directory.

    Returns:
        The measured :class:`Rates`; ``load_seconds`` includes the calibration itself.
    """
    from draftsmith.data.chat import encode_chat
    from draftsmith.data.regenerate import load_regenerated, prompt_limit, regenerate
    from draftsmith.data.sources import load_prompts

    t_start = time.perf_counter()
    if getattr(bench, "weight_layout", None) in ("auto", "cpp") and not getattr(bench, "compile", False):
        from draftsmith.bench.measure import layout_candidates

        layout_candidates(v.model)  # builds the few-row kernel here once (~25 s), inside the run's first seconds
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    model, tok = vd.model, vd.tokenizer
    source = "sharegpt" if data.dataset == "self" else data.dataset  # self-written prompts: costed as ShareGPT's
    convs = load_prompts(source, split="train", limit=data.batch_size, seed=data.seed)

    def timed_batch(n_new: int) -> float:
        path = work / f"regen-{n_new}.jsonl"
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        regenerate(model, tok, convs, path, max_new_tokens=n_new, batch_size=data.batch_size,
                   max_prompt_tokens=data.max_prompt_tokens, seed=data.seed, progress=progress)
        return time.perf_counter() - t0

    fixed, per_token, short_seconds = regeneration_costs(timed_batch)
    replied = load_regenerated(work / f"regen-{LONG_REPLY}.jsonl")
    # Which prompts regeneration keeps, and their length, from a bigger sample than one batch
    # (tokenizing costs nothing next to generating): 16 calibration prompts had none over
    # 512 tokens where the run then dropped 8 of 32 (BENCHMARKS.md 9b).
    sample = load_prompts(source, split="train", limit=KEPT_SAMPLE, seed=data.seed)
    limit = prompt_limit(model, data.max_new_tokens, data.max_prompt_tokens)
    kept_fraction, prompt_tokens = kept_prompts(
        [len(encode_chat(tok, c.prompt_messages(), add_generation_prompt=True)) for c in sample], limit)

    capture_per_token, train_per_position = capture_and_train_prices(vd, v, replied, data, train, work)

    decode = decode_price(v, bench)
    # A decode step of a whole batch costs at least one sequence's step (a floor against noise).
    if per_token < decode:
        fixed, per_token = max(short_seconds - SHORT_REPLY * decode, 0.0), decode
    return Rates(regen_batch_fixed=fixed, regen_batch_per_token=per_token, batch_size=data.batch_size,
                 reply_tokens=float(data.max_new_tokens), prompt_tokens=prompt_tokens,
                 capture_per_token=capture_per_token, train_per_position=train_per_position,
                 decode_per_token=decode, load_seconds=time.perf_counter() - t_start,
                 kept_fraction=kept_fraction)


def plan_key(cfg: Any) -> dict[str, Any]:
    """What a stored plan must match to be reused: the budget, this machine, the configuration."""
    from draftsmith.config import to_dict

    conf = to_dict(cfg)
    conf.pop("out", None)
    return {"budget": cfg.budget, "machine": machine_key(), "config": conf}


def plan_for(cfg: Any, v: Any, vd: Any, out: Path, say: Any = print) -> Plan:
    """The stored plan of this budget, machine and configuration, else a new one (calibrated now)."""
    key = plan_key(cfg)
    path = Path(out) / "plan.json"
    plan = load_plan(path, key)
    if plan is not None:
        say(f"[plan] reusing {path} (same budget, machine and configuration)")
        return plan
    say(f"[plan] measuring this machine for a {cfg.budget:g}-minute budget (a regeneration batch, capture, "
        "training steps and decodes: about a minute on 2 CPU cores; then the plan, or what the budget lacks) ...")
    rates = calibrate(vd, v, cfg.data, cfg.train, cfg.bench, Path(out) / "calibration")
    drafts = 2 if cfg.previous_draft else 1
    rows = bench_row_count(cfg.bench, drafts=drafts)
    compile_s = (COMPILE_VERIFIER_SECONDS + COMPILE_DRAFT_SECONDS * drafts * len(cfg.bench.draft_precision)
                 if cfg.bench.compile else 0.0)
    plan = make_plan(cfg.budget, rates, max_new_tokens=cfg.data.max_new_tokens, epochs=cfg.train.epochs,
                     pack_tokens=cfg.train.pack_tokens, bench_max_new_tokens=cfg.bench.max_new_tokens,
                     bench_rows=rows, repeats=cfg.bench.repeats, machine=key["machine"],
                     min_prompts=(MIN_BENCH_PROMPTS if len(cfg.bench.num_draft_tokens) == 1 or cfg.bench.choose_k
                                  else 2 * MIN_JUDGED_PROMPTS),
                     bench_compile_seconds=compile_s, bench_pilot_seconds=pilot_seconds(rates, cfg.bench, drafts)
                     + layout_probe_seconds(rates, cfg.bench, on_cpu=next(v.model.parameters()).device.type == "cpu")
                     + calibration_seconds(rates, cfg.bench, drafts),
                     max_prompts=MAX_BENCH_PROMPTS - (cfg.bench.pilot_prompts if cfg.bench.choose_k else 0))
    save_plan(path, key, plan)
    return plan


def apply_plan(cfg: Any, plan: Plan) -> Any:
    """``cfg`` with the plan's data size, bench size and training time limit."""
    import dataclasses

    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, num_conversations=plan.num_conversations),
        train=dataclasses.replace(cfg.train, max_minutes=round(plan.train_max_minutes, 2)),
        bench=dataclasses.replace(cfg.bench, num_prompts=plan.bench_prompts))


def regenerated_tokens(path: Path) -> tuple[int, int]:
    """Conversations a regenerated file gives capture (empty replies are skipped) and their prompt + reply tokens.

    Lines are split at "\\n" only (:func:`~draftsmith.utils.complete_lines`): a reply may hold
    U+2028 or U+0085, which ``str.splitlines`` also splits at (a 56-minute regeneration
    once died here on one).
    """
    convs = tokens = 0
    for line in complete_lines(Path(path), cut=False):
        if line.strip():
            meta = json.loads(line)["meta"]
            if meta.get("finish_reason") != "empty":
                convs += 1
                tokens += int(meta.get("prompt_tokens", 0)) + int(meta.get("completion_tokens", 0))
    return convs, tokens


def top_up(cfg: Any, plan: Plan, regenerated: Path, regen_seconds: float | None, elapsed: float,
           out: Path, reprice: Callable[[], dict[str, float]] | None = None) -> dict[str, Any]:
    """After regeneration: how many more prompts to regenerate when it came in under its plan.

    A plan prices replies at their longest (``max_new_tokens``) and buys whole batches,
    so the data usually comes out smaller than planned: a 10-minute run without AMX
    bought 59 prompts, its replies held 36% fewer tokens than priced, training reached
    its epoch cap early and the run ended 16% under its budget (BENCHMARKS.md 9b). Here
    the replies are counted: the time the budget has left (before the bench), less
    capturing and training what is there at the planned epochs, buys more conversations
    at this run's measured regeneration cost per conversation plus their capture and
    training. Fewer than half a batch are not worth a batch's fixed costs (returns 0).

    ``reprice()`` times capture, training and a plain decode again (``capture_per_token``,
    ``train_per_position``, ``decode_per_token``: :func:`capture_and_train_prices` on the
    replies just made, :func:`decode_price`), and the cheaper of each pair of measurements
    counts: a busy machine only ever makes a measurement slower. A calibration run beside
    another program priced capture 5.6x and training 2.9x too dear, the top-up bought only 80
    prompts and the run ended at 21.7 of 40 minutes (BENCHMARKS.md 9b); one beside two CPU
    burners priced the bench 4x too dear and reserved it minutes it did not use (9g). The
    bench's time is scaled by the decode prices' ratio (``bench_seconds``, which
    :func:`fit_training` reads too). The re-pricing's time counts against the budget.

    The decision is stored in the plan file (``top_up``) before any work, so a rerun
    asks for the same prompts and hits the step cache. ``regen_seconds`` None (the
    regeneration came from the cache with no stored decision): no top-up.

    Returns:
        ``{"prompts": n, ...}``: prompts to ask for beyond the plan (0: none), and the
        figures the decision used.
    """
    from draftsmith.utils import atomic_write_json

    path = Path(out) / "plan.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    if "top_up" in raw:
        return raw["top_up"]
    convs, tokens = regenerated_tokens(regenerated)
    decision: dict[str, Any] = {"prompts": 0, "conversations": convs, "tokens": tokens}
    if regen_seconds and convs and getattr(cfg.data, "dataset", None) != "self":
        r = plan.rates
        price = {k: r[k] for k in ("capture_per_token", "train_per_position", "decode_per_token")}
        bench = plan.predicted_seconds["bench"]
        if reprice is not None:
            t0 = time.perf_counter()
            again = reprice()
            elapsed += time.perf_counter() - t0
            price = {k: min(v, again[k]) for k, v in price.items()}
            bench *= price["decode_per_token"] / r["decode_per_token"]
            decision.update(repriced={**again, "seconds": round(time.perf_counter() - t0, 1)},
                            bench_seconds=bench)
        per_token = price["capture_per_token"] + \
            (1 - cfg.train.val_fraction) * cfg.train.epochs * price["train_per_position"]
        left = plan.budget_minutes * 60 / SAFETY - elapsed - bench
        spare = left - tokens * per_token
        per_conv = regen_seconds / convs + tokens / convs * per_token
        kept = int(max(spare, 0.0) // per_conv)
        batch = int(r.get("batch_size", cfg.data.batch_size))
        kept_fraction = min(max(r.get("kept_fraction", 1.0), 0.05), 1.0)
        prompts = math.ceil(kept / kept_fraction) if kept >= batch / 2 else 0
        decision.update(prompts=prompts, seconds_left=round(left, 1), spare_seconds=round(spare, 1),
                        seconds_per_conversation=round(per_conv, 3), predicted_seconds=round(kept * per_conv, 1))
    if raw:
        raw["top_up"] = decision
        atomic_write_json(path, raw)
    return decision


def regeneration_seconds(plan: Plan, elapsed: float, step: str = "regenerate",
                         predicted: float | None = None) -> float:
    """Seconds a regeneration starting now may run.

    The plan prices regeneration from the calibration's first seconds; when the machine then slows
    (another program, a shared host drifting 2x), an unbounded regeneration overruns and every
    minute it takes comes out of training, which gets what is left (BENCHMARKS.md 9u: a 105-minute
    run on the SPR, its host busy after the calibration, regenerated at a third of the planned rate
    and was on course to leave training its 30-second floor). So the planned regeneration may run
    until the budget holds only capture's, training's and the bench's predicted time, counted as
    :func:`fit_training` counts, the budget over :data:`SAFETY` (a regeneration allowed into the
    safety margin ran 8.4 min over its price and training got 19.4 of its 25.2 planned minutes,
    9u). A top-up (``step`` ``topup_regenerate``, sized on this run's measured rate) gets its
    ``predicted`` seconds plus :data:`TOPUP_SLACK`.
    The replies finished by then are the data. Resumed runs count their earlier steps in
    ``elapsed`` (``StepCache.earlier_seconds``).
    """
    if step == "topup_regenerate" and predicted is not None:
        return predicted * (1 + TOPUP_SLACK)
    p = plan.predicted_seconds
    after = p.get("capture", 0.0) + p.get("train", 0.0) + p.get("bench", 0.0)
    return plan.budget_minutes * 60 / SAFETY - elapsed - after


def fit_training(cfg: Any, plan: Plan, tokens: int, elapsed: float, out: Path) -> Any:
    """After the data steps: give training the time the budget has left (before the bench).

    Training gets that time as ``target_minutes``: it times its own steps and sets its step
    count to fill it (:class:`~draftsmith.train.loop.TimeFit`), so a calibration that priced
    training too dear (a busy machine while it ran: BENCHMARKS.md 9b) no longer ends the run
    early. The bench's time is the top-up's re-priced one where there was a top-up decision.
    The epochs are its cap, twice the asked ones (more passes over few replies
    overfit); ``priced_epochs`` is what the calibration's price predicts. The result is stored
    in the plan file, so a rerun (whose cached steps take no time) trains with the same
    settings and hits the cache.
    """
    import dataclasses

    path = Path(out) / "plan.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    fit = raw.get("train_fit")
    if fit is None:
        positions = max(tokens * (1 - cfg.train.val_fraction), 1.0)
        bench = (raw.get("top_up") or {}).get("bench_seconds", plan.predicted_seconds["bench"])
        left = max(plan.budget_minutes * 60 / SAFETY - elapsed - bench, 30.0)
        priced = min(max(left / (positions * plan.rates["train_per_position"]), 0.25 * cfg.train.epochs),
                     2 * cfg.train.epochs)
        fit = {"epochs": 2 * cfg.train.epochs, "priced_epochs": round(priced, 3),
               "target_minutes": round(left / 60, 2), "max_minutes": round(left / 60 * 1.15, 2),
               "seconds_left": left, "tokens": tokens}
        if raw:
            raw["train_fit"] = fit
            from draftsmith.utils import atomic_write_json

            atomic_write_json(path, raw)
    return dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, epochs=fit["epochs"], max_minutes=fit["max_minutes"], target_minutes=fit.get("target_minutes")))


def extrapolate(metrics_path: Path, factors: tuple[float, ...] = (2.0, 4.0)) -> dict[str, Any] | None:
    """This run's validation acceptance against training steps, fitted as ``a + b*log(steps)`` and
    carried to ``factors`` times the steps: what a bigger budget would likely give.

    Returns None with fewer than three validations. An extrapolation, not a measurement:
    the curve flattens as data runs out (BENCHMARKS.md records a plateau near 2.25 here).
    """
    import numpy as np

    try:
        recs = [json.loads(line) for line in complete_lines(Path(metrics_path), cut=False) if line.strip()]
    except OSError:
        return None
    pts = [(r["step"], r["val_acceptance_length"]) for r in recs if "val_acceptance_length" in r and r["step"] > 0]
    if len(pts) < 3:
        return None
    x = np.log([s for s, _ in pts])
    y = np.array([a for _, a in pts])
    b, a = np.polyfit(x, y, 1)
    last = pts[-1][0]
    return {"steps": last, "acceptance_length": float(y[-1]), "slope_per_log_step": float(b),
            "at": {f"{f:g}x": float(a + b * math.log(last * f)) for f in factors}}


def bigger_budget_line(fit: dict[str, Any] | None, budget_minutes: float | None) -> str:
    """One sentence for the end of a run: what a bigger budget would likely give."""
    if fit is None:
        return "Too few validations in this run to extrapolate what a bigger budget would give."
    at = fit["at"]
    head = (f"With {budget_minutes * 2:g} / {budget_minutes * 4:g} minutes" if budget_minutes
            else "With 2x / 4x the training")
    return (f"{head}, this run's validation curve extrapolates to acceptance length {at['2x']:.2f} / "
            f"{at['4x']:.2f} (now {fit['acceptance_length']:.2f} after {fit['steps']} steps; an extrapolation "
            "of a log fit, not a measurement).")
