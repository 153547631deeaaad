"""A lean forward of a transformers decoder-only LM over a preallocated :class:`KVCache`.

The same arithmetic as the transformers forward, op for op, over the same modules'
weights, without what a general framework pays for on every step: kwargs plumbing
and decorators per layer, mask builders, cache objects that concatenate, output
dataclasses, and all layers' hidden states when only a few are read. Norms, rotary
tables and the rope formula are the model's own (its modules and its modeling
file's ``apply_rotary_pos_emb``), so each family's quirks (Gemma's ``1 + w`` norms
and scaled embeddings, Qwen3's per-head q/k norms) come with them.

Two decoder-layer layouts are covered (h: hidden state, x: layer input):

    pre-norm (Llama, Mistral, Qwen2, Qwen3):
        h = x + attn(input_layernorm(x));  out = h + mlp(post_attention_layernorm(h))
    sandwich (Gemma 3):
        h = x + post_attention_layernorm(attn(input_layernorm(x)))
        out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

Any other model (or option: eager attention, logit soft-capping, chunked or
bidirectional attention) is refused by :func:`lean_unsupported`, and the engine runs
the transformers forward instead. Modules are called through their ``forward`` (or
``F.linear`` for a plain Linear), so forward hooks placed on them do not run; a
module that changes what it computes must do so in its ``forward``.

:meth:`LeanDecoder.forward` runs one sequence over a :class:`KVCache` (the decoding
engine); :meth:`LeanDecoder.forward_batch` runs several left-padded sequences over a
:class:`BatchKVCache` (regeneration, :func:`draftsmith.data.generation.generate_batch`).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from draftsmith.models.kv import BatchKVCache, KVCache
from draftsmith.models.quantize import rounds_activations

#: ``config.model_type`` values whose layers this forward reproduces exactly.
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def _text_config(model: torch.nn.Module) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def layer_windows(config: Any) -> list[int | None] | None:
    """Per-layer sliding window (None: full attention), or None if a layer is neither kind."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    windows: list[int | None] = []
    for t, kw in zip(types, kwargs):
        if t == "full_attention":
            windows.append(None)
        elif t == "sliding_attention":
            windows.append(int(kw["sliding_window"]))
        else:
            return None
    return windows


def lean_unsupported(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` exactly, or None when it can."""
    cfg = _text_config(model)
    if cfg.model_type not in LEAN_MODEL_TYPES:
        return f"model type {cfg.model_type!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
    if getattr(cfg, "_attn_implementation", "sdpa") != "sdpa":
        return f"attention implementation {cfg._attn_implementation!r} (the lean forward reproduces 'sdpa')"
    for flag in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(cfg, flag, None):
            return f"{flag} is set"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if layer_windows(cfg) is None:
        return "a layer is neither full nor sliding-window attention"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    return None


#: ``x -> x W^T + b`` of one projection: F.linear bound to a Linear's weight, or a module's own forward.
Projection = Callable[[torch.Tensor], torch.Tensor]


def projection(module: torch.nn.Module) -> Projection:
    """The projection ``module`` computes, callable without nn.Module's hook machinery.

    A plain ``nn.Linear`` (its weight may be a tensor subclass, e.g. torchao's quantized
    tensors, which dispatch ``F.linear`` themselves) becomes ``F.linear`` bound to its
    parameters; any other module (a quantized linear that packs its weight) runs its
    own ``forward``, so the lean path computes what the module computes.
    """
    if type(module).forward is torch.nn.Linear.forward:
        return functools.partial(F.linear, weight=module.weight, bias=module.bias)
    return module.forward


@dataclass
class _Layer:
    """References into one decoder layer (no copies of weights)."""

    in_norm: Callable
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    q_norm: Callable | None
    k_norm: Callable | None
    scale: float
    nh: int
    nkv: int
    hd: int
    post_attn_norm: Callable | None  # sandwich layout only
    mlp_norm: Callable
    post_mlp_norm: Callable | None  # sandwich layout only
    act: Callable
    gate: Projection
    up: Projection
    down: Projection
    rope_key: str | None  # Gemma 3 keeps one rotary table per layer type


class LeanDecoder:
    """Runs a supported transformers causal LM step by step on a :class:`KVCache`.

    Args:
        model: the causal LM (see :func:`lean_unsupported`).

    Raises:
        ValueError: if the model is not supported (check :func:`lean_unsupported` first).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        why = lean_unsupported(model)
        if why is not None:
            raise ValueError(f"lean forward unsupported: {why}")
        cfg = _text_config(model)
        base = model.model
        self.model = model
        self.embed = model.get_input_embeddings()
        self.norm = base.norm
        self.head = projection(model.get_output_embeddings())
        # The cache's dtype and device: the embedding's (a quantized projection has no float weight to ask).
        self.dtype, self.device = self.embed.weight.dtype, self.embed.weight.device
        self.rotary = base.rotary_emb
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.windows = layer_windows(cfg)
        types = getattr(cfg, "layer_types", None)
        per_type_rope = hasattr(self.rotary, "layer_types")
        self.layers: list[_Layer] = []
        for i, layer in enumerate(base.layers[: cfg.num_hidden_layers]):
            a, mlp = layer.self_attn, layer.mlp
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            nh = a.q_proj.out_features // a.head_dim  # a quantized linear keeps in/out_features too
            nkv = a.k_proj.out_features // a.head_dim
            self.layers.append(_Layer(
                layer.input_layernorm, projection(a.q_proj), projection(a.k_proj), projection(a.v_proj),
                projection(a.o_proj), getattr(a, "q_norm", None), getattr(a, "k_norm", None), a.scaling, nh, nkv,
                a.head_dim, layer.post_attention_layernorm if sandwich else None,
                layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
                layer.post_feedforward_layernorm if sandwich else None,
                mlp.act_fn, projection(mlp.gate_proj), projection(mlp.up_proj), projection(mlp.down_proj),
                types[i] if per_type_rope else None))
        self.rope_keys = sorted({L.rope_key for L in self.layers}, key=str)
        self.apply_rope = sys.modules[type(base.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.num_layers = len(self.layers)
        self.hidden_size = cfg.hidden_size
        # A layer that rounds its input (W8A8 int8) needs each position's inputs bitwise as a
        # one-token step makes them: attention one query at a time (see models/kv.py).
        self.per_query = rounds_activations(model)

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for ``capacity`` positions in the model's dtype and device."""
        return KVCache(self.num_layers, [L.nkv for L in self.layers], [L.hd for L in self.layers], capacity,
                       self.dtype, self.device, self.windows, per_query=self.per_query)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, keep: int | None,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over ``ids [m]`` at positions ``pos [m]`` (= T .. T+m-1).

        Writes the m positions into ``cache`` but leaves ``cache.length`` to the caller
        (``cache.advance(m)``), so that a compiled step reads no host-side counter.

        Returns:
            logits ``[keep, V]`` of the last ``keep`` positions (None: all m) and, when
            ``aux_layer_ids`` is non-empty, hidden states ``[m, A*H]``: for id i the
            input of layer i (0: the embeddings; n: the final normed output), as
            transformers' ``hidden_states[i]``.
        """
        x, saved = self._layers(self.embed(ids[None]), pos[None],
                                lambda i, q, k, v, scale: cache.attend(i, q, k, v, pos, scale), aux_layer_ids)
        logits = self.head(x if keep is None else x[:, -keep:])[0]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        hidden = torch.cat([saved[i][0] for i in aux_layer_ids], -1) if aux_layer_ids else None
        return logits, hidden

    def _layers(self, x: torch.Tensor, position_ids: torch.Tensor, attend: Callable,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers and final norm over embeddings ``x [B, m, H]`` at ``position_ids [B, m]``.

        ``attend(i, q, k, v, scale)`` writes layer i's keys/values ``[B, nkv, m, hd]`` into
        its cache and returns the attention ``[B, nh, m, hd]`` of the queries ``q``.
        Returns the normed output and the inputs of the layers in ``aux_layer_ids``.
        """
        B, m = x.shape[:2]
        rope = {key: (self.rotary(x, position_ids) if key is None else self.rotary(x, position_ids, key))
                for key in self.rope_keys}
        saved: dict[int, torch.Tensor] = {}
        for i, L in enumerate(self.layers):
            if i in aux_layer_ids:
                saved[i] = x
            cos, sin = rope[L.rope_key]
            h = L.in_norm(x)
            q = L.q(h).view(B, m, L.nh, L.hd)
            k = L.k(h).view(B, m, L.nkv, L.hd)
            v = L.v(h).view(B, m, L.nkv, L.hd).transpose(1, 2)
            if L.q_norm is not None:
                q, k = L.q_norm(q), L.k_norm(k)
            q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            a = attend(i, q, k, v, L.scale)  # [B, nh, m, hd]
            a = L.o(a.transpose(1, 2).reshape(B, m, L.nh * L.hd))
            if L.post_attn_norm is not None:
                a = L.post_attn_norm(a)
            x = x + a
            h = L.mlp_norm(x)
            h = L.down(L.act(L.gate(h)) * L.up(h))
            if L.post_mlp_norm is not None:
                h = L.post_mlp_norm(h)
            x = x + h
        x = self.norm(x)
        if self.num_layers in aux_layer_ids:
            saved[self.num_layers] = x
        return x, saved

    def new_batch_cache(self, pads: list[int], capacity: int) -> BatchKVCache:
        """An empty cache for ``len(pads)`` left-padded sequences of ``capacity`` slots each."""
        return BatchKVCache(self.num_layers, [L.nkv for L in self.layers], [L.hd for L in self.layers], pads,
                            capacity, self.dtype, self.device, self.windows)

    def forward_batch(self, ids: torch.Tensor, cache: BatchKVCache) -> torch.Tensor:
        """One forward of ``ids [B, m]`` into the next m slots of a batch; the last slot's logits ``[B, V]``.

        Positions come from the cache (slot minus the row's left padding); the cache's
        length moves by m.
        """
        m = ids.shape[1]
        position_ids = cache.begin(m)
        x, _ = self._layers(self.embed(ids), position_ids, cache.attend)
        cache.advance(m)
        logits = self.head(x[:, -1])
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
