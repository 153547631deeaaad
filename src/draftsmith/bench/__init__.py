"""Benchmark: measured speedup, acceptance, break-even analysis, and a readable report.

What it measures, per row (plain decoding, each drafter at each k, and the HF
``generate`` / prompt-lookup reference rows), on the same prompts, interleaved
per prompt so machine drift hits every row alike:

* tokens/s per prompt (median over repeats), summarised over prompts;
* speedup = the *paired* per-prompt ratio tokens/s(row) / tokens/s(plain), its
  median and a seeded percentile-bootstrap 95% interval;
* acceptance (vLLM's definitions): length 1 + accepted/drafts, rate
  accepted/drafted, per-position accepted-at-i/drafts;
* identical-output rate against plain decoding (must be 100% at temperature 0);
* peak memory (RSS, and CUDA when present).

Modules: :mod:`~draftsmith.bench.run` (config and entry point),
:mod:`~draftsmith.bench.measure` (rows, timing, step costs),
:mod:`~draftsmith.bench.costmodel` (break-even prediction),
:mod:`~draftsmith.bench.stats` (paired statistics),
:mod:`~draftsmith.bench.report` (report.json, report.md, plots).
"""

from draftsmith.bench.run import BenchConfig, BenchSettings, benchmark, run_bench

__all__ = ["BenchConfig", "BenchSettings", "benchmark", "run_bench"]
