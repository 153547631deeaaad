"""Interop with the real speculators 0.9.0 package, run in its own venv (``make setup-speculators``).

One subprocess does all of speculators' work (its import takes seconds):
drafts draftsmith exported are loaded with speculators' own loader and run, and
drafts speculators built and saved are read back by draftsmith. Both directions
compare the draft logits of TTT steps 0..2 on the same ids and aux hidden states
(float32, within 1e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_factory import DRAFT_VOCAB, LAYERS, random_draft, save_verifier, tiny_verifier, ttt_inputs
from draftsmith.drafters import load_draft
from draftsmith.export import save_draft
from draftsmith.models.speculators import read_draft

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1]
SPEC_PYTHON = ROOT / os.environ.get("DRAFTSMITH_SPECULATORS_PYTHON", ".venv-speculators/bin/python")  # relative: to ROOT
STEPS = 3
ATOL = 1e-4

# draftsmith -> speculators: our default, speculators' training-CLI defaults, per-aux fc norms, a Qwen3 layer
EXPORTS = {
    "default": dict(vd=DRAFT_VOCAB, flags={}),
    "speculators_cli": dict(vd=DRAFT_VOCAB, flags={"norm_before_fc": True, "norm_output": True}),
    "fc_norm_raw_residual": dict(vd=DRAFT_VOCAB, flags={"fc_norm": True, "norm_before_residual": False}),
    "qwen3_full_vocab": dict(vd=None, flags={"qk_norm": True}),
}
# speculators -> draftsmith
BUILDS = {
    "default": dict(arch="llama", vd=DRAFT_VOCAB, flags={"norm_before_residual": True}),
    "speculators_cli": dict(arch="llama", vd=DRAFT_VOCAB,
                            flags={"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}),
    "qwen3": dict(arch="qwen3", vd=DRAFT_VOCAB, flags={"norm_before_residual": False, "fc_norm": True}),
}


def _speculators_python() -> Path:
    if SPEC_PYTHON.is_file():
        return SPEC_PYTHON
    reason = (f"speculators venv not found at {SPEC_PYTHON}: run `make setup-speculators` "
              "(make test builds it)")
    if os.environ.get("DRAFTSMITH_INTEROP_OPTIONAL") == "1":
        pytest.skip(reason + "; skipped because DRAFTSMITH_INTEROP_OPTIONAL=1")
    pytest.fail(reason + "; set DRAFTSMITH_INTEROP_OPTIONAL=1 to skip instead", pytrace=False)


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    """Export our drafts, let speculators load them and build its own, all in one subprocess."""
    python = _speculators_python()
    tmp = tmp_path_factory.mktemp("interop")
    verifier = tiny_verifier()
    vdir = save_verifier(verifier, tmp / "verifier")
    ours = {}
    for i, (name, spec) in enumerate(EXPORTS.items()):
        draft = random_draft(verifier, vd=spec["vd"], seed=10 + i, **spec["flags"])
        ours[name] = (draft, save_draft(draft, tmp / f"ours-{name}", verifier_name=str(vdir),
                                        num_draft_tokens=STEPS))
    aux, ids, _, _ = ttt_inputs(next(iter(ours.values()))[0].config, L=13)
    save_file({"aux": aux.contiguous(), "ids": ids.contiguous()}, str(tmp / "inputs.safetensors"))
    job = {
        "inputs": str(tmp / "inputs.safetensors"),
        "load": [{"name": n, "draft_dir": str(d), "steps": STEPS, "out": str(tmp / f"logits-ours-{n}.safetensors")}
                 for n, (_, d) in ours.items()],
        "build": [{"name": n, "arch": b["arch"], "verifier_dir": str(vdir), "draft_vocab_size": b["vd"] or 128,
                   "flags": b["flags"], "seed": 20 + i, "steps": STEPS, "out_dir": str(tmp / f"theirs-{n}"),
                   "aux_layer_ids": [2, LAYERS // 2, LAYERS - 3],
                   "out": str(tmp / f"logits-theirs-{n}.safetensors")}
                  for i, (n, b) in enumerate(BUILDS.items())],
    }
    (tmp / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(python), str(Path(__file__).with_name("speculators_side.py")), str(tmp / "job.json"),
                           str(tmp / "result.json")], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        pytest.fail(f"speculators side failed ({proc.returncode}):\n{proc.stderr[-4000:]}", pytrace=False)
    result = json.loads((tmp / "result.json").read_text())
    return {"tmp": tmp, "verifier": verifier, "vdir": vdir, "ours": ours, "aux": aux, "ids": ids, "result": result}


def _our_logits(draft, aux, ids):
    L = ids.shape[1]
    pos = torch.arange(1, L + 1)[None]  # speculators' default position ids
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        return [x[0] for x in draft.float().forward_ttt(aux, ids, pos, mask, STEPS)]


def _assert_steps_close(ours, theirs_file):
    theirs = load_file(str(theirs_file))
    assert len(theirs) == STEPS
    for j in range(STEPS):
        torch.testing.assert_close(ours[j], theirs[f"step{j}"], atol=ATOL, rtol=0, msg=lambda m: f"step {j}: {m}")


def test_speculators_versions(interop):
    assert interop["result"]["speculators"] == "0.9.0"


@pytest.mark.parametrize("name", list(EXPORTS))
def test_our_export_loads_in_speculators_with_equal_logits(interop, name):
    draft, out = interop["ours"][name]
    r = interop["result"]["load"][name]
    cfg = draft.config
    assert r["generic_class"] == r["config_class"] == "Eagle3SpeculatorConfig"
    assert r["model_class"] == "Eagle3DraftModel" and r["attn"] == "eager" and r["weights_dtype"] == "torch.float32"
    assert r["layer_config_class"] == ("Qwen3Config" if cfg.qk_norm else "LlamaConfig")
    assert r["not_in_model"] == [] and r["changed"] == [] and r["nan"] == []
    assert set(r["not_in_file"]) <= {"verifier_lm_head.weight", "verifier_norm.weight"}
    assert r["draft_vocab_size"] == cfg.draft_vocab_size and r["aux_layer_ids"] == cfg.aux_layer_ids
    assert {f: r[f] for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == {
        f: getattr(cfg, f) for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    assert r["speculative_tokens"] == STEPS and r["verifier"] == str(interop["vdir"].resolve())
    assert r["verifier_architectures"] == ["LlamaForCausalLM"]
    assert r["rope_theta"] == cfg.rope_parameters["rope_theta"]
    _assert_steps_close(_our_logits(draft, interop["aux"], interop["ids"]),
                        interop["tmp"] / f"logits-ours-{name}.safetensors")


@pytest.mark.parametrize("name", list(BUILDS))
def test_speculators_draft_reads_in_draftsmith_with_equal_logits(interop, name):
    tmp = interop["tmp"]
    spec = BUILDS[name]
    d = read_draft(tmp / f"theirs-{name}")
    assert d.config.qk_norm == (spec["arch"] == "qwen3")
    for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert getattr(d.config, f) == spec["flags"].get(f, False), f
    assert d.config.draft_vocab_size == spec["vd"] and int(d.t2d.sum()) == spec["vd"]
    _assert_steps_close(_our_logits(d, interop["aux"], interop["ids"]), tmp / f"logits-theirs-{name}.safetensors")
    # and it drafts for the verifier through the regular loader
    proposer = load_draft(tmp / f"theirs-{name}", interop["verifier"])
    assert proposer.draft.config.aux_layer_ids == [2, LAYERS // 2, LAYERS - 3]


def test_speculators_draft_reexports_and_loads_back_in_speculators(interop, tmp_path):
    """Their checkpoint -> our export -> their loader: the same logits as their original."""
    tmp = interop["tmp"]
    d = read_draft(tmp / "theirs-speculators_cli")
    out = save_draft(d, tmp_path / "reexported")
    job = {"inputs": str(tmp / "inputs.safetensors"),
           "load": [{"name": "re", "draft_dir": str(out), "steps": STEPS, "out": str(tmp_path / "re.safetensors")}]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([str(_speculators_python()), str(Path(__file__).with_name("speculators_side.py")),
                           str(tmp_path / "job.json"), str(tmp_path / "r.json")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a = load_file(str(tmp / "logits-theirs-speculators_cli.safetensors"))
    b = load_file(str(tmp_path / "re.safetensors"))
    for j in range(STEPS):
        torch.testing.assert_close(a[f"step{j}"], b[f"step{j}"], atol=ATOL, rtol=0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
