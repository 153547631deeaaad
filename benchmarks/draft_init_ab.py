"""A/B arm: `draftsmith train` with the draft's decoder layer started from a verifier layer.

The recorded A/B (BENCHMARKS.md section 3) trained three arms on the same shards, seed and
schedule: the reference, ``--train-lm-head`` (a `draftsmith train` option) and this script's
variant, which starts the draft's layer from verifier layer n-2 (attention and MLP weights; the
hidden half of q/k/v from the verifier's, the embedding half at half of them) and ``fc`` as the
identity on the last captured layer. Every other flag passes through to `draftsmith train`.

Usage (the recorded arm)::

    PYTHONPATH=src python benchmarks/draft_init_ab.py --verifier smollm2-135m --data runs/full-trimmed/shards \\
        --out runs/ab-layerfcid --draft-vocab-size 8192 --ttt-steps 3 --epochs 1 --max-steps 300 \\
        --eval-every 1000 --checkpoint-every 100 --seed 0
"""

from __future__ import annotations

import sys

import torch

from draftsmith.cli import main
from draftsmith.train import loop

_build = loop.build_draft


def build_from_verifier_layer(verifier, draft_vocab, seed, **kw):
    draft = _build(verifier, draft_vocab, seed, **kw)
    src = verifier.model.layers[len(verifier.model.layers) - 2]
    layer, H = draft.layers[0], draft.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(src.self_attn, name).weight.float()
            dst = getattr(layer.self_attn, name).weight
            dst[:, H:] = w
            dst[:, :H] = 0.5 * w
        layer.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight.float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight.float())
        layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())
        layer.hidden_norm.weight.copy_(src.input_layernorm.weight.float())
        layer.input_layernorm.weight.copy_(src.input_layernorm.weight.float())
        Ht = draft.fc.weight.shape[1] // len(draft.config.aux_layer_ids)
        draft.fc.weight.zero_()
        draft.fc.weight[:, -Ht:] = torch.eye(Ht)
    return draft


if __name__ == "__main__":
    loop.build_draft = build_from_verifier_layer
    sys.exit(main(["train"] + sys.argv[1:]))
