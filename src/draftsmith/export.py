"""Export: a trained draft as the deployable directory vLLM serves, with its model card.

A deployable draft directory is a speculators-format draft
(:mod:`draftsmith.models.speculators`: ``config.json``, ``model.safetensors``,
``draftsmith.json``) plus

    README.md          model card with the ``vllm serve`` commands and what draftsmith measured

The GGUF that llama.cpp's ``draft-eagle3`` serves is written by
:func:`draftsmith.engines.llamacpp.export_gguf`, with llama.cpp's own converter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from draftsmith.models.eagle3 import Eagle3Draft
from draftsmith.models.speculators import (CONFIG_FILE, PROVENANCE_FILE, WEIGHTS_FILE, read_config,
                                          read_provenance, write_draft)
from draftsmith.utils import atomic_write_bytes, atomic_write_json

CARD_FILE = "README.md"


def save_draft(draft: Eagle3Draft, out_dir: str | Path, *, verifier_name: str | None = None,
               num_draft_tokens: int | None = None, fingerprint: str | None = None,
               provenance: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
               dtype: str | torch.dtype | None = None, verifier: Any = None) -> Path:
    """Write ``draft`` as a deployable draft directory: :func:`~draftsmith.models.speculators.write_draft`
    (whose arguments these are; ``metrics`` also go into the card), then the model card.

    Returns:
        the directory written.

    Raises:
        DraftsmithError: if the draft does not match the verifier it names.
    """
    out = write_draft(draft, out_dir, verifier_name=verifier_name, num_draft_tokens=num_draft_tokens,
                      fingerprint=fingerprint, provenance=provenance, metrics=metrics, dtype=dtype, verifier=verifier)
    write_model_card(out)
    return out


def write_model_card(draft_dir: str | Path, metrics: dict[str, Any] | None = None) -> Path:
    """(Re)write ``README.md`` of a draft directory from its files, recording new ``metrics`` first.

    Given ``metrics`` (a draft measured again), this stores them in ``draftsmith.json``
    and the card without touching ``config.json`` or the weights.
    """
    from safetensors import safe_open

    d = Path(draft_dir)
    read_config(d, verifier_layers=1 << 30)  # validates; the layer count only fills null aux ids
    raw = json.loads((d / CONFIG_FILE).read_text())
    prov = read_provenance(d) or {"verifier": dict(raw.get("speculators_config", {}).get("verifier") or {})}
    if metrics is not None:
        prov["metrics"] = metrics
        atomic_write_json(d / PROVENANCE_FILE, prov)
    num_params = None
    if (d / WEIGHTS_FILE).is_file():
        with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
            num_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                             if f.get_slice(k).get_dtype() not in ("I64", "BOOL"))
    atomic_write_bytes(d / CARD_FILE, model_card(raw, prov, d.resolve(), num_params).encode())
    return d / CARD_FILE


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def serve_commands(draft_dir: str | Path, verifier_name: str | None, k: int) -> list[str]:
    """The two ``vllm serve`` forms: draft only (verifier from config.json), and explicit."""
    spec = json.dumps({"model": str(draft_dir), "method": "eagle3", "num_speculative_tokens": k})
    short = f"vllm serve {draft_dir}"
    if verifier_name is None:
        short += "   # needs speculators_config.verifier.name_or_path in config.json"
    return [short, f"vllm serve {verifier_name or '<verifier>'} \\\n    --speculative-config '{spec}'"]


def model_card(config: dict[str, Any], prov: dict[str, Any], draft_dir: str | Path,
               num_params: int | None = None) -> str:
    """README.md for a draft directory: what it is for, how good it measured, how to serve it."""
    ver = prov.get("verifier") or {}
    vname = ver.get("name_or_path")
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    tl = config["transformer_layer_config"]
    lines = ["---", "tags:", "- speculative-decoding", "- eagle3", "- speculators", "- draftsmith"]
    if vname and not Path(vname).is_absolute():
        lines.append(f"base_model: {vname}")
    lines += ["---", "", f"# EAGLE-3 draft for `{vname or 'an unnamed verifier'}`", "",
              "A speculative-decoding draft in the vLLM *speculators* format "
              f"(speculators {config['speculators_version']}), made with draftsmith.", "",
              "## Verifier", "",
              f"- name or path: `{vname}`",
              f"- architectures: {', '.join(ver.get('architectures') or []) or 'unknown'}",
              f"- draftsmith fingerprint: `{ver.get('fingerprint') or 'not recorded'}`",
              f"- checked against: {ver.get('checked_against') or 'not checked (verifier not on the exporting machine)'}",
              "", "## Draft", "",
              f"- one {tl['model_type']} decoder layer, hidden size {tl['hidden_size']}, "
              f"{tl['num_attention_heads']} heads ({tl['num_key_value_heads']} KV), head dim {tl['head_dim']}",
              f"- aux hidden states of verifier layers {config['eagle_aux_hidden_state_layer_ids']}",
              f"- draft vocabulary {config['draft_vocab_size']} of {tl['vocab_size']} tokens",
              "- norms: " + ", ".join(f"{f}={str(config[f]).lower()}" for f in
                                      ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")),
              f"- speculative tokens (default k): {k}",
              f"- weights: {config['dtype']}" + (f", {num_params / 1e6:.2f}M parameters" if num_params else "")]
    training = prov.get("training")
    lines += ["", "## Training", ""]
    if isinstance(training, dict) and training:
        lines += [f"- {key}: {_fmt(v)}" for key, v in training.items()]
    else:
        lines.append("Not recorded (the draft was not trained by this draftsmith run).")
    metrics = prov.get("metrics") or {}
    lines += ["", "## Measured by draftsmith", ""]
    if metrics:
        if "acceptance_length" in metrics:
            lines.append(f"- acceptance length: {_fmt(metrics['acceptance_length'])} tokens per verifier pass")
        ppa = metrics.get("per_position_acceptance")
        if ppa:
            lines += ["", "| position | " + " | ".join(str(i + 1) for i in range(len(ppa))) + " |",
                      "|---|" + "---|" * len(ppa),
                      "| acceptance | " + " | ".join(f"{x:.3f}" for x in ppa) + " |", ""]
        if "speedup" in metrics:
            lines.append(f"- speedup over plain decoding (wall clock): {_fmt(metrics['speedup'])}x")
        rest = {key: v for key, v in metrics.items()
                if key not in ("acceptance_length", "per_position_acceptance", "speedup")}
        lines += [f"- {key}: {_fmt(v)}" for key, v in rest.items()]
    else:
        lines.append("Not measured yet: run `draftsmith bench` to measure acceptance and speedup.")
    short, full = serve_commands(draft_dir, vname, k)
    lines += ["", "## Serving with vLLM", "",
              "The verifier is read from `speculators_config` in `config.json`:", "",
              "```bash", short, "```", "", "or name the verifier and the draft explicitly:", "",
              "```bash", full, "```", "",
              "## Provenance", "",
              f"- draftsmith {prov.get('draftsmith')}; "
              + ", ".join(f"{key} {v}" for key, v in (prov.get("versions") or {}).items()),
              f"- created {prov.get('created')} by `{prov.get('command')}`"]
    if prov.get("source"):
        lines.append(f"- exported from: {_fmt(prov['source'])}")
    lines += [f"- full record: `{PROVENANCE_FILE}`", ""]
    return "\n".join(lines)
