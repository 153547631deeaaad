"""The EAGLE-3 draft model (Li et al., 2025) in the speculators / vLLM layout.

Symbols: H draft hidden size (= verifier hidden size unless ``target_hidden_size``
says otherwise), Ht verifier hidden size, A number of aux layers (3), V verifier
vocabulary, Vd draft vocabulary, nh / nkv / hd query heads, kv heads, head dim.

One draft step at sequence position t (fed token x_{t+1}, feature g_t):

    g_0   = fc(cat(a_low, a_mid, a_high))                   [.., A*Ht] -> [.., H]
    e     = embed(x_{t+1})                                   [.., H]
    z     = cat(input_layernorm(e), hidden_norm(g))          [.., 2H]   embeddings first
    h     = resid(g) + attn(z)                               resid = hidden_norm(g) if norm_before_residual else g
    h     = h + mlp(post_attention_layernorm(h))
    logits= lm_head(norm(h))                                 [.., Vd]   predicts x_{t+2}
    g'    = norm(h) if norm_output else h                    fed to the next draft step

Draft id i maps to verifier id ``i + d2t[i]``; ``t2d[v]`` marks verifier ids that
are in the draft vocabulary. Module and parameter names equal speculators' so
state dicts are exchanged without renaming.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.cpu_attention import CHUNK
from draftsmith.models.cpu_linear import MAX_ROWS as _CPP_MAX_ROWS
from draftsmith.models.kv import KVCache
from draftsmith.models.lean import fold_sin


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high feature layers: indices into HF ``hidden_states`` (input of layer i)."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Eagle3Config:
    """Shape and wiring of an EAGLE-3 draft.

    Attributes:
        vocab_size: verifier vocabulary V (the embedding's rows).
        draft_vocab_size: Vd, rows of ``lm_head``.
        hidden_size: H of the draft layer.
        intermediate_size: MLP width.
        num_attention_heads: nh.
        num_key_value_heads: nkv.
        head_dim: hd.
        aux_layer_ids: verifier layers whose hidden states feed ``fc`` (HF ``hidden_states`` index).
        target_hidden_size: verifier hidden size when it differs from H (None: equal).
        rms_norm_eps: RMSNorm epsilon.
        rope_parameters: HF rope parameters (``rope_type``, ``rope_theta``, ...), from the verifier.
        max_position_embeddings: longest position the rope tables cover.
        attention_bias: bias on the q/k/v/o projections (HF Llama/Qwen3 put it on all four).
        qk_norm: per-head RMSNorm on q and k before rope (a Qwen3 decoder layer; speculators
            ``transformer_layer_config.model_type == "qwen3"``).
        norm_before_residual: residual is ``hidden_norm(g)`` (True) or raw ``g``.
        norm_before_fc: one RMSNorm over the A*Ht aux vector before ``fc``.
        fc_norm: one RMSNorm per aux chunk before ``fc`` (exclusive with norm_before_fc).
        norm_output: feed ``norm(h)`` instead of ``h`` to the next draft step.
        num_draft_tokens: default k when serving (speculators' ``speculative_tokens``).
        verifier_name: verifier name or path recorded for serving.
        verifier_architectures: the verifier's HF architectures.
    """

    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    aux_layer_ids: list[int]
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    qk_norm: bool = False
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    num_draft_tokens: int = 5
    verifier_name: str | None = None
    verifier_architectures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.norm_before_fc and self.fc_norm:
            raise DraftsmithError("norm_before_fc and fc_norm cannot both be set")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DraftsmithError(f"draft vocab size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftsmithError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def verifier_hidden_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @classmethod
    def from_verifier(cls, verifier_config: Any, draft_vocab_size: int | None = None,
                      aux_layer_ids: list[int] | None = None, **overrides: Any) -> "Eagle3Config":
        """Draft config matching a verifier's (text) config: same width, heads and rope."""
        c = verifier_config.get_text_config() if hasattr(verifier_config, "get_text_config") else verifier_config
        n = c.num_hidden_layers
        ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n)
        if any(not 0 <= i < n for i in ids):
            raise DraftsmithError(f"aux layer ids {ids} out of range for a {n}-layer verifier")
        rope = dict(getattr(c, "rope_parameters", None) or {})
        if rope and all(isinstance(v, dict) for v in rope.values()):  # per-layer-type (Gemma 3)
            rope = dict(rope.get("full_attention") or next(iter(rope.values())))
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", float(getattr(c, "rope_theta", 10000.0)))
        V = c.vocab_size
        fields: dict[str, Any] = dict(
            vocab_size=V,
            draft_vocab_size=min(draft_vocab_size or 32000, V),
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            aux_layer_ids=ids,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)),
            verifier_architectures=list(getattr(verifier_config, "architectures", None) or []),
        )
        return cls(**{**fields, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rope_config(self) -> Any:
        """A ``LlamaConfig`` carrying just what HF's rotary embedding reads."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                           rope_parameters=dict(self.rope_parameters), vocab_size=self.vocab_size)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (Llama's), as one ``F.rms_norm`` call: on CPU bitwise the
    written-out ``x * rsqrt(mean(x^2) + eps)`` (tested) and ~3x cheaper for one row."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def qkv(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """z [B, L, 2H] -> q [B, nh, L, hd], k, v [B, nkv, L, hd] (rope applied to q, k)."""
        B, L, _ = z.shape
        q = self.q_proj(z).view(B, L, self.nh, self.hd)
        k = self.k_proj(z).view(B, L, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(z).view(B, L, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, L, hd]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The single decoder layer whose attention reads [embedding, fused hidden] (width 2H)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend) -> torch.Tensor:
        """embeds, hidden [B, L, H] -> h [B, L, H]; ``attend(q, k, v) -> [B, L, nh*hd]``."""
        g = self.hidden_norm(hidden)
        resid = g if self.norm_before_residual else hidden
        z = torch.cat([self.input_layernorm(embeds), g], dim=-1)  # [B, L, 2H]
        q, k, v = self.self_attn.qkv(z, cos, sin)
        h = resid + self.self_attn.o_proj(attend(q, k, v))
        return h + self.mlp(self.post_attention_layernorm(h))


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft: fc + one decoder layer + norm + lm_head over the draft vocabulary."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        H, Ht, A = cfg.hidden_size, cfg.verifier_hidden_size, len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the verifier, frozen by default
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(A * Ht, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(A))
        self.fc = nn.Linear(A * Ht, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        Vd, V = cfg.draft_vocab_size, cfg.vocab_size
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool) if Vd == V else torch.zeros(V, dtype=torch.bool))
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary_emb = LlamaRotaryEmbedding(cfg.rope_config())
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # Queries per attention block in the TTT unroll (0: one block of all L). Only speed
        # depends on it (BENCHMARKS.md section 7); results agree to rounding.
        self.ttt_attn_chunk = 256
        self._rope_table: tuple[torch.Tensor, ...] | None = None  # (cos, sin, sin folded) [1, n, hd]: _rope_at

    # ------------------------------------------------------------------ building blocks
    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary from the sorted verifier ids it keeps (``[Vd]``)."""
        ids = draft_to_target.to(self.d2t.device, torch.long)
        if ids.shape != self.d2t.shape or (ids[1:] <= ids[:-1]).any():
            raise DraftsmithError("draft vocabulary must be Vd strictly increasing verifier ids")
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Verifier id of every draft id, ``[Vd]``."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Verifier aux hidden states [.., A*Ht] -> fused feature g [.., H]."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        elif self.config.fc_norm:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(aux.to(self.fc.weight.dtype))

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [.., H] -> (draft logits [.., Vd], hidden fed to the next step [.., H])."""
        hn = self.norm(h)
        return self.lm_head(hn), (hn if self.config.norm_output else h)

    def rope(self, position_ids: torch.Tensor, like: torch.Tensor):
        return self.rotary_emb(like, position_ids)

    def _rope_at(self, position_ids: torch.Tensor, like: torch.Tensor, folded: bool = False):
        """:meth:`rope` at ``position_ids [1, m]`` for a cached step: on the CPU outside autograd and
        compiled graphs, rows of a table the rotary module computed once for positions ``[0, n)``
        (bitwise its per-step result, tested; ~8 us instead of ~20 for its call), grown by doubling.
        ``folded``: the sine folded by :func:`~draftsmith.models.lean.fold_sin` (the fused layer's
        rope; from a folded table, on the CPU)."""
        if (like.device.type != "cpu" or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or getattr(self.rotary_emb, "rope_type", "default") in ("dynamic", "longrope")):  # tables by length
            cos, sin = self.rope(position_ids, like)
            return (cos, fold_sin(sin)) if folded else (cos, sin)
        need = int(position_ids.max()) + 1
        table = self._rope_table
        if table is None or table[0].shape[1] < need or table[0].dtype != like.dtype:
            size = max(need, 2 * table[0].shape[1] if table is not None else 512)
            cos, sin = self.rope(torch.arange(size)[None], like)
            table = self._rope_table = (cos, sin, fold_sin(sin))
        return table[0][:, position_ids[0]], table[2 if folded else 1][:, position_ids[0]]

    # ------------------------------------------------------------------ training: TTT unroll
    def forward(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """The training forward (what DDP wraps) is the TTT unroll."""
        return self.forward_ttt(*args, **kwargs)

    def forward_ttt(self, aux: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    attn_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: unroll ``steps`` draft steps over packed sequences.

        Args:
            aux: ``[B, L, A*Ht]`` verifier aux states g_t of positions t.
            input_ids: ``[B, L]`` ids x_{t+1} fed with g_t at step 0. Step j feeds
                x_{t+1+j} (ground truth, shifted left by j, 0-padded).
            position_ids: ``[B, L]`` rope position of the token fed at step 0.
            attn_mask: ``[B, L, L]`` bool, step-0 visibility (causal within a document).
            steps: number of unrolled steps.

        Returns:
            ``steps`` logits tensors ``[B, L, Vd]``; step j at position t predicts x_{t+2+j}.
        """
        layer = self.layers[0]
        rep = layer.self_attn.nh // layer.self_attn.nkv
        g = self.fuse(aux)  # [B, L, H]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        B, L = input_ids.shape
        visible0 = attn_mask[:, None]  # [B, 1, L, L]
        chunk = min(L, self.ttt_attn_chunk or L)
        diagonal = torch.eye(chunk, dtype=torch.bool, device=attn_mask.device).expand(B, 1, chunk, chunk)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Step j's query at t sees step-0 keys s <= t (same document) and, from every
            # later step i <= j, only its own position t: the chain it would draft at inference.
            # One SDPA over [K_0 | K_1 | ... | K_j] with that mask per block of C queries: a block
            # needs only the step-0 keys up to its end and, of every later step, its own C keys.
            # Exact; it skips the all-masked blocks a single [L, (j+1)L] SDPA would compute.
            keys.append(_repeat_kv(k, rep))
            values.append(_repeat_kv(v, rep))
            j = len(keys) - 1
            outs = []
            for a in range(0, L, chunk):
                b = min(a + chunk, L)
                mask = torch.cat([visible0[..., a:b, :b]] + [diagonal[..., :b - a, :b - a]] * j, dim=-1)
                kk = torch.cat([keys[0][:, :, :b]] + [x[:, :, a:b] for x in keys[1:]], 2)
                vv = torch.cat([values[0][:, :, :b]] + [x[:, :, a:b] for x in values[1:]], 2)
                outs.append(F.scaled_dot_product_attention(q[:, :, a:b], kk, vv, attn_mask=mask, scale=self.scale))
            return torch.cat(outs, 2).transpose(1, 2).reshape(B, L, -1)

        logits = []
        ids = input_ids
        for j in range(steps):
            if j:
                ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
            e = self.embed_tokens(ids)
            cos, sin = self.rope(position_ids + j, e)
            h = layer(e, g, cos, sin, attend)
            lj, g = self.head(h)
            logits.append(lj)
        return logits

    # ------------------------------------------------------------------ inference: cached steps
    def new_cache(self, capacity: int) -> KVCache:
        """An empty KV cache of the draft layer for ``capacity`` positions."""
        a = self.layers[0].self_attn
        return KVCache(1, a.nkv, a.hd, capacity, self.fc.weight.dtype, self.fc.weight.device)

    def fused_args(self) -> tuple | None:
        """The draft layer's arguments for ``draftsmith::llama_layer`` (the cpp layout's fused eager
        layer: :meth:`step`'s ``fused``), or None where it is not on that layout's kernels: every
        projection a :class:`~draftsmith.models.verifier.CppLinear` of the draft's dtype or a
        :class:`~draftsmith.models.verifier.CppInt8WeightLinear` (an int8 draft), every norm a
        :class:`~draftsmith.models.verifier.CppRMSNorm`, float32 or bfloat16 on the CPU. Read once
        per request (``Eagle3Proposer.prepare``): it holds the weights as they are now."""
        layer = self.layers[0]
        a, mlp = layer.self_attn, layer.mlp
        dtype = self.embed_tokens.weight.dtype
        projs = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        norms = [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm]
        norms += [a.q_norm, a.k_norm] if a.qk_norm else []
        if dtype not in (torch.float32, torch.bfloat16) or self.embed_tokens.weight.device.type != "cpu" or a.hd % 2:
            return None
        if not all(getattr(type(mod), "cpp_kernel", False) for mod in projs + norms):
            return None
        if any(n.weight.dtype is not dtype for n in norms):
            return None
        w, scales = [], []
        for mod in projs:
            q = getattr(mod, "qweight", None)
            if q is None and mod.weight.dtype is not dtype:
                return None
            w.append(mod.weight if q is None else q)
            scales.append(None if q is None else mod.scale32)
        from draftsmith.models import cpu_attention

        if not cpu_attention.available():
            return None
        weights = [torch.empty(0, dtype=dtype), *w[:4], layer.post_attention_layernorm.weight, *w[4:]]
        weights += [a.q_norm.weight, a.k_norm.weight] if a.qk_norm else []
        eps = layer.post_attention_layernorm.eps
        if a.qk_norm and a.q_norm.eps != a.k_norm.eps:
            return None  # the op takes one eps for q's and k's norms
        return weights, scales, [mod.bias for mod in projs], eps, a.q_norm.eps if a.qk_norm else 0.0

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
             slots: torch.Tensor | None = None, fused: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached forward over m new positions.

        Args:
            input_ids: ``[1, m]`` fed tokens (verifier ids).
            hidden: ``[1, m, H]`` fused or draft-carried features.
            position_ids: ``[1, m]`` rope positions.
            cache: the draft's :class:`KVCache`; the m positions are written at ``slots``
                and the caller then calls ``cache.advance(m)``.
            slots: ``[m]`` cache slots (default: ``cache.length ..``; a compiled step passes them).
            fused: :meth:`fused_args`, to run the layer as one C++ call where the cache attends through
                the C++ kernel (the cpp layout, eager): bitwise the same results (tested).

        Returns:
            draft logits ``[1, m, Vd]`` and the hidden to carry ``[1, m, H]``.
        """
        m = input_ids.shape[1]
        if fused is not None and slots is None and m <= _CPP_MAX_ROWS and cache.kernel_step(m) \
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return self._step_fused(input_ids, hidden, position_ids, cache, fused)
        if slots is None:
            slots = torch.arange(cache.length, cache.length + m, device=input_ids.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = cache.attend(0, q, k, v, slots, self.scale)  # GQA inside SDPA: no repeated K/V
            return out.transpose(1, 2).reshape(1, m, -1)

        e = self.embed_tokens(input_ids)
        cos, sin = self._rope_at(position_ids, e)
        return self.head(self.layers[0](e, hidden, cos, sin, attend))

    def _step_fused(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                    cache: KVCache, fused: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` with the layer's attention and MLP in one ``draftsmith::llama_layer`` call."""
        layer, m = self.layers[0], input_ids.shape[1]
        a = layer.self_attn
        weights, scales, biases, eps, qk_eps = fused
        cache.check_room(m)
        start = cache.length
        e = self.embed_tokens(input_ids)
        cos, sin = self._rope_at(position_ids, e, folded=True)
        g = layer.hidden_norm(hidden)
        z = torch.cat([layer.input_layernorm(e), g], dim=-1)  # [1, m, 2H]
        h = torch.ops.draftsmith.llama_layer(
            z, g if layer.norm_before_residual else hidden, weights, scales, biases, cos, sin, cache.keys[0],
            cache.values[0], torch.arange(start, start + m), start, 0, self.scale, eps, qk_eps, a.nh, a.nkv, a.hd,
            CHUNK)
        return self.head(h)
