"""A lean forward of a transformers decoder-only LM over a preallocated :class:`KVCache`.

The same arithmetic as the transformers forward, op for op, over the same modules'
weights, without what a general framework pays for on every step: kwargs plumbing
and decorators per layer, mask builders, cache objects that concatenate, output
dataclasses, and all layers' hidden states when only a few are read. Norms, rotary
tables and the rope formula are the model's own (its modules and its modeling
file's ``apply_rotary_pos_emb``), so each family's quirks (Gemma's ``1 + w`` norms
and scaled embeddings, Qwen3's per-head q/k norms) come with them. Two rewrites cut
the small ops of a step and keep every result bitwise: a plain Linear is the ``mm``
(``addmm``) F.linear would reach, called on 2-D hidden states, and the rotate-half
rope runs folded (:func:`rope_folded`) where a probe at construction shows it equal
to the model's.

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

from draftsmith.models.cpu_attention import CHUNK
from draftsmith.models.cpu_linear import MAX_ROWS as _CPP_MAX_ROWS
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


def _linear_of(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module``'s GEMM, its parameters read at call time (what ``torch.compile`` sees as parameters)."""
    if module.bias is None:
        return torch.mm(x, module.weight.t())
    return torch.addmm(module.bias, x, module.weight.t())


def projection(module: torch.nn.Module, by_module: bool = False) -> Projection:
    """The projection ``module`` computes, callable without nn.Module's hook machinery.

    A plain ``nn.Linear`` (its weight may be a tensor subclass, e.g. torchao's quantized
    tensors, which dispatch ``F.linear`` themselves) becomes ``F.linear`` bound to its
    parameters; any other module (a quantized linear that packs its weight) runs its
    own ``forward``, so the lean path computes what the module computes.
    ``by_module``: the plain Linear's GEMM reads ``module.weight`` at every call instead of
    binding a view of it, so ``torch.compile`` sees a parameter it can freeze (the compiled step).
    """
    if type(module).forward is not torch.nn.Linear.forward:
        return module.forward
    w, b = module.weight, module.bias
    if type(w) is torch.nn.Parameter and type(w.data) is torch.Tensor and (b is None or type(b.data) is torch.Tensor):
        # A plain float weight: the GEMM that F.linear reaches on a contiguous input (``mm``, or
        # ``addmm`` with a bias), called directly on the 2-D hidden states, which skips the
        # linear/matmul/t dispatch layers around it: bitwise the same result, ~2% of a step.
        if by_module:
            return functools.partial(_linear_of, module)
        wt = w.t()
        if b is None:
            return functools.partial(torch.mm, mat2=wt)
        return lambda x: torch.addmm(b, x, wt)
    return functools.partial(F.linear, weight=w, bias=b)


def fold_sin(sin: torch.Tensor) -> torch.Tensor:
    """``cat(-sin1, sin2)`` of a rope sine table (halves of the last dim), for :func:`rope_folded`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), -1)


def rope_folded(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin_folded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotate-half rope, ``x*cos + rotate_half(x)*sin``, in 4 ops per tensor instead of 8.

    ``rotate_half(x) = cat(-x2, x1)``; ``roll(x) = cat(x2, x1)`` times ``fold_sin(sin)``
    is the same products (negation is exact), so the result is bitwise the same.
    """
    half = q.shape[-1] // 2
    return q * cos + q.roll(half, -1) * sin_folded, k * cos + k.roll(half, -1) * sin_folded


def fast_rope_matches(apply_rope: Callable, head_dims: set[int], dtype: torch.dtype) -> bool:
    """Whether :func:`rope_folded` computes bitwise what the model's ``apply_rope`` does.

    Probed once on random inputs: the standard rotate-half formula matches; any other
    (interleaved pairs, a partial rotary dim, a new quirk) does not, and keeps the model's own.
    """
    if len(head_dims) != 1:
        return False
    hd = next(iter(head_dims))
    if hd % 2:
        return False
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, n, 3, hd, generator=g).to(dtype) for n in (4, 2))
    cos, sin = (torch.randn(2, 3, hd, generator=g).to(dtype) for _ in range(2))
    fast = rope_folded(q, k, cos.unsqueeze(1), fold_sin(sin).unsqueeze(1))
    try:
        ref = apply_rope(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - a different signature is a different formula
        return False
    return all(torch.equal(a, b) for a, b in zip(ref, fast))


def _call(module: torch.nn.Module | None) -> Callable | None:
    """A module's ``forward`` (nn.Module's call wrapper costs a few microseconds per call)."""
    return None if module is None else module.forward


def norm_fn(module: torch.nn.Module | None) -> Callable | None:
    """An RMSNorm module as one ``F.rms_norm`` call where a probe shows that bitwise equal.

    transformers' Llama-style RMSNorm is 8 Python-level ops; ``F.rms_norm`` runs the same
    ATen ops (on CPU) from one call. A norm that computes anything else (Gemma's
    ``1 + w``, a fused kernel that reduces in another order) fails the probe and keeps
    its own ``forward``, and so does a norm on the cpp layout's C++ kernel (``cpp_kernel``).
    """
    if module is None:
        return None
    if getattr(module, "cpp_kernel", False):  # the cpp layout's one C++ call (models.verifier.CppNorm)
        return module.forward
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not isinstance(eps, float):
        return module.forward
    fused = functools.partial(F.rms_norm, normalized_shape=(w.shape[0],), weight=w, eps=eps)
    x = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype) * 3
    with torch.no_grad():
        return fused if torch.equal(module.forward(x), fused(x)) else module.forward


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


_NO_SCALES: list[torch.Tensor | None] = [None] * 7  # llama_layer's int8 scales: a verifier's weights are float


@dataclass
class _Fused:
    """One layer's arguments for ``draftsmith::llama_layer`` (the cpp layout's fused eager layer)."""

    w: list[torch.Tensor]
    b: list[torch.Tensor | None]
    eps: float
    qk_eps: float
    window: int


def _fused_layers(base: torch.nn.Module, layers: list[_Layer], windows: list[int | None], dtype: torch.dtype,
                  rope_fast: bool) -> list[_Fused] | None:
    """Each layer's arguments for the fused C++ layer, or None where a layer is not one it computes.

    It computes a pre-norm layer (Llama, Mistral, Qwen2, Qwen3) whose 7 projections run on the cpp
    layout's few-row kernel (:class:`~draftsmith.models.verifier.CppLinear`) and whose norms on its
    norm (:class:`~draftsmith.models.verifier.CppNorm`), float32 or bfloat16 on the CPU, with silu
    (probed against ``F.silu``) and the rotate-half rope (:func:`rope_folded`): what the Python loop
    computes op for op, in one call. The arguments hold the weight tensors the modules hold now: a
    decoder is built per request (a parameter reassigned later would not be seen)."""
    if not rope_fast or dtype not in (torch.float32, torch.bfloat16):
        return None
    from draftsmith.models import cpu_attention, cpu_linear
    from draftsmith.models.verifier import _norm_eps

    def kernel(mod) -> bool:
        w = getattr(mod, "weight", None)
        return (getattr(type(mod), "cpp_kernel", False) and isinstance(w, torch.Tensor) and w.dtype is dtype
                and w.device.type == "cpu")

    out = []
    probe = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(dtype) * 4
    for layer, L, W in zip(base.layers, layers, windows):
        a, mlp = layer.self_attn, layer.mlp
        if hasattr(layer, "pre_feedforward_layernorm") or L.hd % 2:
            return None
        projs = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        qk = [getattr(a, "q_norm", None), getattr(a, "k_norm", None)]
        if any(n is not None for n in qk):
            norms += qk
        if not all(kernel(mod) for mod in projs + norms):
            return None
        with torch.no_grad():
            if not torch.equal(mlp.act_fn(probe), F.silu(probe)):
                return None
        w = [norms[0].weight, *(p.weight for p in projs[:4]), norms[1].weight, *(p.weight for p in projs[4:])]
        out.append(_Fused(w + [n.weight for n in norms[2:]], [p.bias for p in projs], _norm_eps(norms[0]),
                          _norm_eps(norms[2]) if len(norms) > 2 else 0.0, W or 0))
        if _norm_eps(norms[1]) != out[-1].eps or (len(norms) > 2 and _norm_eps(norms[3]) != out[-1].qk_eps):
            return None  # one eps for the two norms, one for q's and k's: the op takes two
    if not (cpu_linear.available() and cpu_attention.available()):
        return None
    return out


class LeanDecoder:
    """Runs a supported transformers causal LM step by step on a :class:`KVCache`.

    Args:
        model: the causal LM (see :func:`lean_unsupported`).
        by_module: bind the projections by module (see :func:`projection`), as a compiled step does.

    Raises:
        ValueError: if the model is not supported (check :func:`lean_unsupported` first).
    """

    def __init__(self, model: torch.nn.Module, by_module: bool = False) -> None:
        why = lean_unsupported(model)
        if why is not None:
            raise ValueError(f"lean forward unsupported: {why}")
        cfg = _text_config(model)
        base = model.model
        self.model = model
        self.embed = model.get_input_embeddings()
        self.norm = norm_fn(base.norm)
        proj = functools.partial(projection, by_module=by_module)
        self.head = proj(model.get_output_embeddings())
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
                norm_fn(layer.input_layernorm), proj(a.q_proj), proj(a.k_proj), proj(a.v_proj),
                proj(a.o_proj), norm_fn(getattr(a, "q_norm", None)), norm_fn(getattr(a, "k_norm", None)),
                a.scaling, nh, nkv, a.head_dim, norm_fn(layer.post_attention_layernorm) if sandwich else None,
                norm_fn(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                norm_fn(layer.post_feedforward_layernorm) if sandwich else None,
                _call(mlp.act_fn), proj(mlp.gate_proj), proj(mlp.up_proj), proj(mlp.down_proj),
                types[i] if per_type_rope else None))
        self.rope_keys = sorted({L.rope_key for L in self.layers}, key=str)
        self.apply_rope = sys.modules[type(base.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.rope_fast = fast_rope_matches(self.apply_rope, {L.hd for L in self.layers}, self.dtype)
        # (q [B, nh, m, hd], k [B, nkv, m, hd], cos, sin from _tables) -> rotated q, k; chosen once
        self.rope = rope_folded if self.rope_fast else self.apply_rope
        self.num_layers = len(self.layers)
        self.hidden_size = cfg.hidden_size
        # A layer that rounds its input (W8A8 int8) needs each position's inputs bitwise as a
        # one-token step makes them: attention one query at a time (see models/kv.py).
        self.per_query = rounds_activations(model)
        # In the cpp layout (eager): each layer of a step as one C++ call (draftsmith::llama_layer), bitwise
        # the loop of _layers over the same kernels, without its ~40 Python-level ops per layer.
        self.fused = None if by_module else _fused_layers(base, self.layers, self.windows, self.dtype, self.rope_fast)

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
        if self.fused is not None and ids.shape[0] <= _CPP_MAX_ROWS and cache.kernel_step(ids.shape[0]) \
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling():  # (the loop's rows: kernel)
            x, saved = self._layers_fused(self.embed(ids), pos, cache, aux_layer_ids)
        else:
            x, saved = self._layers(self.embed(ids), 1, pos[None],
                                    lambda i, q, k, v, scale: cache.attend(i, q, k, v, pos, scale), aux_layer_ids)
        logits = self.head(x if keep is None else x[-keep:])
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        hidden = torch.cat([saved[i] for i in aux_layer_ids], -1) if aux_layer_ids else None
        return logits, hidden

    def _tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """Per rope key, (cos, sin) ``[B, 1, m, hd]`` (sin sign-folded for the fast rope)."""
        rope = {}
        for key in self.rope_keys:
            cos, sin = self.rotary.forward(x, position_ids) if key is None else self.rotary.forward(x, position_ids, key)
            if self.rope_fast:
                cos, sin = cos.unsqueeze(1), fold_sin(sin).unsqueeze(1)
            rope[key] = (cos, sin)
        return rope

    def _layers(self, x: torch.Tensor, B: int, position_ids: torch.Tensor, attend: Callable,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers and final norm over embeddings ``x [B*m, H]`` at ``position_ids [B, m]``.

        Hidden states stay 2-D, ``[B*m, H]`` (what F.linear folds a contiguous 3-D input
        to), so each projection is one GEMM call.
        ``attend(i, q, k, v, scale)`` writes layer i's keys/values ``[B, nkv, m, hd]`` into
        its cache and returns the attention ``[B, nh, m, hd]`` of the queries ``q``.
        Returns the normed output ``[B*m, H]`` and the inputs of the layers in ``aux_layer_ids``.
        """
        m = x.shape[0] // B
        rope = self._tables(x, position_ids)
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
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            a = attend(i, q, k, v, L.scale)  # [B, nh, m, hd]
            a = L.o(a.transpose(1, 2).reshape(B * m, L.nh * L.hd))
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

    def _layers_fused(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                      aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`_layers` for one sequence's step, each layer one ``draftsmith::llama_layer`` call (same
        results, bitwise; :attr:`fused`); the new keys and values go to the cache's next slots."""
        m, start = x.shape[0], cache.length
        cache.check_room(m)
        rope = self._tables(x, pos[None])
        saved: dict[int, torch.Tensor] = {}
        layer = torch.ops.draftsmith.llama_layer
        for i, (L, F_) in enumerate(zip(self.layers, self.fused)):
            if i in aux_layer_ids:
                saved[i] = x
            cos, sin = rope[L.rope_key]
            x = layer(x, None, F_.w, _NO_SCALES, F_.b, cos, sin, cache.keys[i], cache.values[i], pos, start,
                      F_.window, L.scale, F_.eps, F_.qk_eps, L.nh, L.nkv, L.hd, CHUNK)
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
        B, m = ids.shape
        position_ids = cache.begin(m)
        x, _ = self._layers(self.embed(ids.reshape(-1)), B, position_ids, cache.attend)
        cache.advance(m)
        logits = self.head(x.view(B, m, -1)[:, -1])
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
