"""One schema: every section of the pipeline is the stage's own config class, and every bad
value of every field is refused by `build_config` before any step runs (no model is loaded)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from draftsmith.bench.run import BenchConfig, BenchSettings
from draftsmith.config import _unwrap
from draftsmith.errors import DraftsmithError
from draftsmith.gate import GateSection
from draftsmith.pipeline.config import PipelineConfig, build_config
from draftsmith.train.loop import TrainConfig, TrainSettings

SECTIONS = {f.name: typing.get_type_hints(PipelineConfig)[f.name] for f in dataclasses.fields(PipelineConfig)
            if dataclasses.is_dataclass(typing.get_type_hints(PipelineConfig)[f.name])}
# fields where 0 is a meaningful value (no skipping, greedy, no decay, no warm-up, ...)
ZERO_OK = {"skip_conversations", "temperature", "weight_decay", "warmup_ratio", "val_fraction", "seed",
           "min_lr_ratio"}
# string fields and what they must hold
BAD_STRINGS = {"dataset": "no-such-dataset", "dtype": "float7", "precision": "fp7"}


def test_sections_are_the_stage_configs():
    assert SECTIONS["train"] is TrainSettings and issubclass(TrainConfig, TrainSettings)
    assert SECTIONS["bench"] is BenchSettings and issubclass(BenchConfig, BenchSettings)
    assert SECTIONS["gate"] is GateSection
    # the CLI's `data` command is the data section plus where to write
    from draftsmith.cli import DataConfig

    assert issubclass(DataConfig, SECTIONS["data"])


def _bad_values(name: str, tp) -> list:
    inner, optional = _unwrap(tp)
    if inner is bool:
        return ["maybe", 3]
    if inner in (int, float):
        return (["x", [1], -1] + ([] if name in ZERO_OK else [0]))
    if typing.get_origin(inner) is list:
        return [[], ["x"], [-1]] if typing.get_args(inner)[0] is int else []
    if inner is str:
        return [BAD_STRINGS[name]] if name in BAD_STRINGS else [[1, 2]] if not optional else []
    if typing.get_origin(inner) is typing.Literal:
        return ["no-such-choice"]
    return []


CASES = [(section, f.name, bad) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
         for bad in _bad_values(f.name, typing.get_type_hints(cls)[f.name])]


@pytest.mark.parametrize("section,name,bad", CASES, ids=[f"{s}.{n}={b!r}" for s, n, b in CASES])
def test_every_bad_value_is_refused_naming_its_key(section, name, bad):
    with pytest.raises(DraftsmithError, match=rf"{section}\.{name}"):
        build_config(None, {"preset": "tiny", section: {name: bad}})


def test_unknown_keys_and_sections_are_refused():
    for section in SECTIONS:
        with pytest.raises(DraftsmithError, match=rf"unknown config key\(s\) {section}\.nope"):
            build_config(None, {section: {"nope": 1}})
    with pytest.raises(DraftsmithError, match="unknown config key"):
        build_config(None, {"trian": {}})


def test_the_cases_cover_every_section_and_numeric_field():
    covered = {(s, n) for s, n, _ in CASES}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            inner, _ = _unwrap(typing.get_type_hints(cls)[f.name])
            if inner in (int, float, bool):
                assert (section, f.name) in covered, (section, f.name)


@pytest.mark.parametrize("key,bad", [("dtype", "float7"), ("device", "gpu-please"), ("num_draft_tokens", 0),
                                     ("num_draft_tokens", "x"), ("preset", "huge")])
def test_top_level_bad_values_are_refused(key, bad):
    with pytest.raises(DraftsmithError, match=key.replace("_", "[_-]")):
        build_config(None, {key: bad})


def test_train_epochs_negative_is_refused_before_any_step():
    """The case a user hit: `train: {epochs: -1}` used to regenerate for minutes before failing."""
    with pytest.raises(DraftsmithError, match="train.epochs"):
        build_config(None, {"train": {"epochs": -1}})


def test_int8_rows_on_a_gpu_run_are_refused_when_the_config_is_read(monkeypatch):
    """bench.draft_precision / bench.quantize int8 run on the CPU only: a pipeline whose device is a GPU says so
    before its data and training (the bench refused them at its start); a CPU run takes them."""
    import torch

    from draftsmith.errors import DraftsmithError
    from draftsmith.pipeline.config import build_config

    for over in ({"draft_precision": ["as-loaded", "int8"]}, {"quantize": ["int8"]}):
        assert build_config(None, {"device": "cpu", "bench": over}).device == "cpu"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(DraftsmithError, match="int8 runs on the CPU"):
            build_config(None, {"device": "cuda", "bench": over})
        assert build_config(None, {"device": "cuda"}).device == "cuda"  # nothing CPU-only asked: taken
        monkeypatch.undo()
