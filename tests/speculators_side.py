"""The speculators side of the interop tests; runs in .venv-speculators, not in draftsmith's venv.

Usage: ``python speculators_side.py JOB.json RESULT.json``. The job lists

* ``load``: drafts draftsmith exported. Each is loaded with speculators' own loader
  (``Eagle3SpeculatorConfig.from_pretrained`` + ``Eagle3DraftModel.from_pretrained``,
  which also resolves and checks the verifier named in config.json), run for
  ``steps`` TTT steps on the inputs, and its per-step draft logits saved.
* ``build``: drafts made by speculators' training factory
  (``Eagle3DraftModel.from_training_args``) against a local verifier, given random
  weights, saved with ``save_pretrained`` and run on the same inputs.

Tensors travel through safetensors files; the result JSON says what speculators
parsed, so the test can check that nothing was dropped on the way.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, Qwen3Config

from speculators import SpeculatorModelConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

ATTN = "eager"  # flex attention on CPU needs L % 128 == 0


def draft_logits(model, aux, ids, steps):
    """Logits of each TTT step, caught on lm_head (forward returns only argmax ids)."""
    model.eval()
    logits = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: logits.append(out.detach().clone()))
    try:
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=steps)
    finally:
        hook.remove()
    return {f"step{j}": t[0].contiguous() for j, t in enumerate(logits)}


def summary(cfg):
    sc = cfg.speculators_config
    tl = cfg.transformer_layer_config
    return {
        "config_class": type(cfg).__name__,
        "layer_config_class": type(tl).__name__,
        "draft_vocab_size": cfg.draft_vocab_size,
        "aux_layer_ids": cfg.eagle_aux_hidden_state_layer_ids,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "speculative_tokens": sc.proposal_methods[0].speculative_tokens,
        "verifier": sc.verifier.name_or_path,
        "verifier_architectures": list(sc.verifier.architectures or []),
        "vocab_size": tl.vocab_size,
        "hidden_size": tl.hidden_size,
        "rope_theta": (getattr(tl, "rope_parameters", None) or {}).get("rope_theta"),
    }


def load(task, inputs):
    generic = SpeculatorModelConfig.from_pretrained(task["draft_dir"])  # registry dispatch + validation
    cfg = Eagle3SpeculatorConfig.from_pretrained(task["draft_dir"])
    cfg.transformer_layer_config._attn_implementation = ATTN
    model = Eagle3DraftModel.from_pretrained(task["draft_dir"], config=cfg, dtype=torch.float32)
    save_file(draft_logits(model, inputs["aux"], inputs["ids"], task["steps"]), task["out"])
    # every tensor of the file arrived unchanged, and nothing the forward uses was left unset
    file = load_file(f"{task['draft_dir']}/model.safetensors")
    state = model.state_dict()
    return {"generic_class": type(generic).__name__, "model_class": type(model).__name__,
            "not_in_model": sorted(set(file) - set(state)),
            "changed": sorted(k for k in set(file) & set(state) if not torch.equal(state[k], file[k].to(state[k].dtype))),
            "not_in_file": sorted(set(state) - set(file)),
            "nan": sorted(k for k, v in state.items() if v.is_floating_point() and torch.isnan(v).any()),
            "attn": model.config.transformer_layer_config._attn_implementation,
            "weights_dtype": str(model.fc.weight.dtype), **summary(model.config)}


def build(task, inputs):
    vcfg = AutoConfig.from_pretrained(task["verifier_dir"])
    fields = {k: getattr(vcfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                                            "rope_parameters")}
    fields["head_dim"] = getattr(vcfg, "head_dim", None) or vcfg.hidden_size // vcfg.num_attention_heads
    layer_cls = Qwen3Config if task.get("arch") == "qwen3" else LlamaConfig
    layer_cfg = layer_cls(num_hidden_layers=1, tie_word_embeddings=False, **fields)
    V, Vd = vcfg.vocab_size, task["draft_vocab_size"]
    g = torch.Generator().manual_seed(task["seed"])
    t2d = d2t = None
    if Vd < V:
        chosen = torch.randperm(V, generator=g)[:Vd].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[chosen] = True
        d2t = chosen - torch.arange(Vd)
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=Vd, ttt_steps=task["steps"],
        verifier_name_or_path=task["verifier_dir"], draft_attn_impl=ATTN,
        target_layer_ids=task.get("aux_layer_ids"), **task["flags"])
    with torch.no_grad():  # random weights everywhere, norms included, so every flag shows in the logits
        for name, p in model.named_parameters():
            if name.startswith("verifier_") or name == "embed_tokens.weight":
                continue
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(task["out_dir"])
    save_file(draft_logits(model, inputs["aux"], inputs["ids"], task["steps"]), task["out"])
    return summary(model.config)


def main(job_path, result_path):
    job = json.load(open(job_path))
    inputs = load_file(job["inputs"])
    from importlib.metadata import version

    result = {"speculators": version("speculators"), "transformers": version("transformers"), "load": {}, "build": {}}
    for task in job.get("load", []):
        result["load"][task["name"]] = load(task, inputs)
    for task in job.get("build", []):
        result["build"][task["name"]] = build(task, inputs)
    json.dump(result, open(result_path, "w"), indent=2)


if __name__ == "__main__":
    main(*sys.argv[1:3])
