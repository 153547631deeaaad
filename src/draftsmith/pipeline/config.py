"""Pipeline configuration: one YAML file (or flags) -> typed, validated sections.

Every section is a dataclass; unknown keys and wrong types are rejected with the
key's dotted name before any expensive step starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from draftsmith.config import from_dict, load_yaml, opt
from draftsmith.errors import DraftsmithError
from draftsmith.utils import check_device_name, check_dtype_name, check_out_path, resolve_device
from draftsmith.bench.run import BenchSettings as BenchSection
from draftsmith.gate import GateSection
from draftsmith.train.loop import TrainSettings as TrainSection


#: the `small` preset (`make demo`) is a budget in minutes, sized on the machine it runs on
SMALL_BUDGET = 20.0


def check_training_source(dataset: str, key: str) -> None:
    """A training prompt source: ``self``, a registry name that is not held out, or an existing path."""
    from draftsmith.data.sources import DATASETS

    if dataset == "self" or Path(dataset).expanduser().exists():
        return
    if dataset not in DATASETS:
        raise DraftsmithError(f"{key}: {dataset!r} is neither a known dataset ({', '.join(sorted(DATASETS))}, self) "
                              "nor an existing file or directory")
    if DATASETS[dataset].held_out:
        raise DraftsmithError(f"{key}: {dataset!r} is a held-out evaluation set; train on another source")


@dataclass
class DataSection:
    """Prompts and the verifier's regenerated responses."""

    dataset: str = opt("sharegpt", "training prompts: sharegpt, a JSONL file, a datasets directory, or self "
                                   "(the verifier writes them itself from its chat template's user turn)")
    num_conversations: int = opt(256, "conversations to regenerate (the first N of the train split, after "
                                      "--skip-conversations)")
    skip_conversations: int = opt(0, "skip the train split's first N conversations, e.g. those an earlier run "
                                     "regenerated: fresh replies to train on next to it (`draftsmith train --data "
                                     "OLD/shards NEW/shards`); with --dataset self, the first N attempts (the "
                                     "prompts step prints the N that makes all attempts new)")
    max_new_tokens: int = opt(256, "longest regenerated response")
    temperature: float = opt(0.0, "regeneration temperature (0: the verifier's greedy outputs, for a draft "
                                  "served at greedy)")
    batch_size: int = opt(16, "regeneration batch size (rows decoded together; a row whose reply ends takes "
                              "the next prompt; 16 was the fastest of "
                              "8-32 in float32 without AMX, and 32 is 1.16x faster in bfloat16 with AMX, "
                              "BENCHMARKS.md section 9d)")
    max_prompt_tokens: int = opt(512, "longer prompts are dropped")
    max_length: int = opt(1024, "capture truncates samples to this many tokens")
    capture_batch_size: int = opt(8, "capture forward batch size")
    trim_loops: bool = opt(True, "capture cuts a reply 32 tokens after it falls into a repetition loop")
    samples_per_shard: int = opt(64, "conversations per capture shard (an interrupted capture resumes "
                                     "after the last complete shard)")
    dtype: str = opt("auto", "verifier dtype while regenerating and capturing: auto = bfloat16 on CUDA and on "
                             "CPUs with AMX or AVX-512 BF16 (there 1.6-1.75x float32's speed), else float32")
    seed: int = opt(0, "split and sampling seed")
    endpoint: str | None = opt(None, "regenerate through this OpenAI-compatible server (vLLM, llama-server, SGLang; "
                                     "http://HOST:PORT) instead of in process, --batch-size requests in flight; it "
                                     "must serve the verifier (two greedy probes are scored by the verifier before "
                                     "any reply is kept); hidden states are still captured in process. The URL is "
                                     "not part of the cache key: a restarted server resumes the same run")

    def setting(self, name: str) -> str:
        """How a setting is named in messages: its YAML key here (``draftsmith data`` names the flag)."""
        return f"data.{name}"

    def __post_init__(self) -> None:
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise DraftsmithError(f"{self.setting('endpoint')} must be an http:// or https:// URL, got {self.endpoint!r}")
        for name in ("num_conversations", "max_new_tokens", "batch_size", "max_prompt_tokens", "max_length",
                     "capture_batch_size", "samples_per_shard"):
            if getattr(self, name) < 1:
                raise DraftsmithError(f"{self.setting(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("skip_conversations", "temperature", "seed"):
            if getattr(self, name) < 0:
                raise DraftsmithError(f"{self.setting(name)} must be >= 0, got {getattr(self, name)}")
        check_dtype_name(self.dtype, self.setting("dtype"))
        check_training_source(self.dataset, self.setting("dataset"))


@dataclass
class PipelineConfig:
    """Everything a pipeline run needs; the YAML file mirrors this structure."""

    verifier: str = opt("smollm2-135m", "verifier: HF dir, .gguf file or alias")
    out: str = opt("runs/demo", "output directory")
    preset: Literal["small", "full", "tiny"] = opt("small", "preset the sections start from (small: a "
                                                              f"{SMALL_BUDGET:g}-minute budget)")
    budget: float | None = opt(None, "minutes the whole run may take on this machine: its first seconds measure "
                                     "each step here, then the data size, training and bench are sized to fit "
                                     "(the plan is printed and kept in OUT/plan.json)")
    num_draft_tokens: int | None = opt(None, "k written into the exported draft (default: the best measured k)")
    verifier_name: str | None = opt(None, "verifier name written for vLLM (default: --verifier)")
    previous_draft: str | None = opt(None, "draft to beat (default: OUT/draft when it exists)")
    dtype: str = opt("auto", "verifier dtype")
    device: str = opt("auto", "device")
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    bench: BenchSection = field(default_factory=BenchSection)
    gate: GateSection = field(default_factory=GateSection)

    def __post_init__(self) -> None:
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise DraftsmithError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        check_dtype_name(self.dtype, "dtype")
        check_device_name(self.device, "device")
        if self.gate.engine not in self.bench.engines:
            raise DraftsmithError(f"gate.engine: {self.gate.engine!r} decides, but bench.engines "
                                  f"{self.bench.engines} does not measure it")
        if self.budget is not None and not (math.isfinite(self.budget) and self.budget > 0):
            raise DraftsmithError(f"budget must be a positive number of minutes, got {self.budget}")
        cpu_only = [f"bench.{k}: int8" for k, v in (("draft_precision", self.bench.draft_precision),
                                                     ("quantize", self.bench.quantize)) if "int8" in v]
        if cpu_only and resolve_device(self.device).type != "cpu":
            # said now, not after the data and the training: the bench would refuse them on a GPU
            raise DraftsmithError(f"{', '.join(cpu_only)} runs on the CPU (ATen's int8 kernels) and this run's "
                                  "device is a GPU: drop it (the draft runs in the verifier's dtype there), or "
                                  "use bench.quantize: [int4] for a quantized verifier")


# Budgets measured on this project's 2-core CPU machine (see BENCHMARKS.md).
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"data": {"num_conversations": 24, "max_new_tokens": 48, "batch_size": 8, "max_length": 256},
             "train": {"epochs": 2, "draft_vocab_size": 2048, "pack_tokens": 256, "eval_every": 10},
             "bench": {"num_prompts": 2, "max_new_tokens": 32, "num_draft_tokens": [3], "hf_reference": False}},
    # small: `make demo`'s budget, sized to finish in 25 minutes on 2 cores even when the shared
    # host runs 2x slow (measured: 28.6 min with 4 epochs, k in {3, 5} and HF reference rows on
    # such a day, bench 47% of it). The section defaults (regeneration batch 16: 64 was 1.3x
    # slower in bfloat16 and 1.8x in float32, long prompts pad whole batches), 3 epochs (6
    # overfit: train acc 0.5-0.7 vs validation 0.3), and a bench of 8 prompts at k = 3 against
    # our plain loop (the break-even analysis predicts the other k; `draftsmith bench` adds the
    # HF reference rows). The bench times one k, the one the cost model predicts best from a
    # pilot decode and this machine's step costs (`choose_k`): a weak draft on a float32 CPU
    # verifier loses at k = 3 (its 4-token verify step costs ~1.5 one-token steps, BENCHMARKS.md
    # section 13) and may win at k = 1.
    "small": {"train": {"epochs": 3.0, "draft_vocab_size": 8192, "eval_every": 50},
              "bench": {"num_prompts": 8, "num_draft_tokens": [1, 2, 3], "choose_k": True, "hf_reference": False}},
    # full: the best budget measured here. Its draft, 2 epochs over the uncut replies and then
    # 3 more over the loop-cut ones (~3450 steps, ~2.7 h on 2 cores), was still improving on
    # MT-Bench (1.47 -> 1.52 -> 1.78, BENCHMARKS.md section 3), so the preset asks 6 epochs over
    # the cut replies (~3000 steps); that exact schedule has not been run end to end here. Its
    # bench chooses k among 1-5 on MT-Bench's last 2 prompts and times it on the other 78 (all
    # of them judged, rather than half when the gate chooses among timed k).
    "full": {"data": {"num_conversations": 3000, "max_new_tokens": 320, "max_prompt_tokens": 384,
                      "max_length": 768},
             "train": {"epochs": 6, "ttt_steps": 5, "draft_vocab_size": 8192, "pack_tokens": 1024,
                       "eval_every": 200},
             "bench": {"num_prompts": 78, "num_draft_tokens": [1, 2, 3, 4, 5], "choose_k": True}},
}

_SECTIONS = {"data": DataSection, "train": TrainSection, "bench": BenchSection, "gate": GateSection}


def build_config(yaml_path: str | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Preset defaults <- YAML file <- command-line overrides, validated."""
    raw: dict[str, Any] = load_yaml(yaml_path) if yaml_path else {}
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    preset = raw.get("preset", "small")
    if preset not in PRESETS:
        raise DraftsmithError(f"preset: unknown {preset!r}; choose one of {sorted(PRESETS)}")
    merged: dict[str, Any] = {k: v for k, v in raw.items() if k not in _SECTIONS}
    for name in _SECTIONS:
        section = raw.get(name) or {}
        if not isinstance(section, dict):
            raise DraftsmithError(f"{name}: expected a mapping, got {type(section).__name__}")
        merged[name] = {**PRESETS[preset].get(name, {}), **section}
    if preset == "small" and "budget" not in raw:
        merged["budget"] = SMALL_BUDGET
    cfg = from_dict(PipelineConfig, merged)
    check_out_path(cfg.out, "dir", flag="out:")  # before any expensive step
    return cfg
