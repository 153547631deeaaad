"""Quantized copies of a verifier (the alternative to a draft that is faster but not lossless),
and the int8 draft of ``--draft-precision`` (:func:`quantize_draft`: faster, still lossless).

``int8`` (CPU): W8A8 with dynamic *per-token* activation scales. Every ``nn.Linear``
(the decoder's projections and the output head) keeps its weight as int8 with one
symmetric scale per output channel; at run time each input row (token) is scaled to
int8 by its own absolute maximum, multiplied in int32 (``torch._int_mm``, exact) and
rescaled to the input dtype. Embeddings, norms and attention stay in the model's dtype.

Why per-token: a token's result then depends on that token alone, never on which
other tokens share the forward (the integer product is exact, the scales are per
row), so the quantized verifier is one well-defined model. That alone is not enough:
the rounding to int8 is discontinuous, and a k+1-token verify forward's attention
rounds an ulp differently from a one-token step's; where that crosses a rounding
boundary the layer's output moves by a whole int8 step (Gemma-3-270M: logits 1-2
apart, BENCHMARKS.md section 12). So the lean engine attends one query at a time on
such a verifier (``KVCache(per_query=True)``), every position is then computed
bitwise as plain decoding computes it, and speculative decoding on the quantized
verifier reproduces its own plain decoding exactly. ``torch.ao.quantization.quantize_dynamic``
(deprecated in torch 2.10, still shipped in 2.13) scales activations *per tensor*:
a k+1-token verify forward then quantizes each token with a scale set by the others,
computes another function than the one-token step, and speculative decoding on it
leaves its plain decoding (``tests/test_quantize.py`` shows both). torchao's int8 tensors
run eagerly on CPU by dequantizing the whole weight per call (slower than float32
here); they pay off under ``torch.compile`` only.

``int4`` (CUDA): torchao's int4 weight-only format (group size 128, tinygemm's
tile-packed layout, bfloat16 activations), the format transformers loads with
``TorchAoConfig``. Needs ``torchao`` (``requirements-quant.txt``) and a GPU of compute
capability 8.0 or newer. Not tested here (no GPU on the development machines).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from draftsmith.errors import DraftsmithError

#: Quantization name -> (device type it runs on, one line for reports and ``--help``).
QUANTIZATIONS: dict[str, tuple[str, str]] = {
    "int8": ("cpu", "int8 weights per channel, int8 activations per token (W8A8 dynamic), CPU"),
    "int4": ("cuda", "torchao int4 weight-only, group 128, bfloat16 activations (tinygemm), CUDA; needs torchao"),
}
TORCHAO_PIN = "torchao==0.18.0"
INT4_GROUP_SIZE = 128


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (per output channel) and int8 activations (per token).

    ``y = (round(x / s_x) @ round(W / s_w)^T) * s_x * s_w + b`` with ``s_x = max|x_row| / 127``
    and ``s_w = max|W_row| / 127``; the product is accumulated in int32 (exact).

    ``rounds_activations`` tells the lean engine that this layer rounds its input: an
    ulp of difference upstream can move a whole int8 step, so a verify forward must
    reach it with bitwise the inputs a one-token step would (``KVCache(per_query=True)``).
    """

    rounds_activations = True

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(-1).clamp_min(1e-12) / 127.0  # [N]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                         requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()  # [M, K]
        s_x = x2.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0  # [M, 1]: one scale per token
        xq = torch.round(x2 / s_x).clamp(-127, 127).to(torch.int8)
        # qweight.t() is a transposed view: the layout the CPU int8 GEMM reads fastest (measured).
        y = torch._int_mm(xq, self.qweight.t()).float() * s_x * self.scale  # [M, N]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, W8A8 per-token"


class Int8WeightLinear(torch.nn.Module):
    """A linear layer with int8 weights (per output channel) and bfloat16 activations (W8A16), CPU.

    ``y = (bf16(x) @ round(W / s_w)^T) * s_w + b`` through ``torch._weight_int8pack_mm``, ATen's
    CPU kernel for weight-only int8 (the one gpt-fast decodes with): it reads a quarter of the
    bytes of a float32 GEMV and was 1.8-2.4x faster than it for an 8192 x 576 head at one row on
    SPR (BENCHMARKS.md 14). Its output is bfloat16, returned in the input's dtype. Meant for the
    draft, whose numerics change only which tokens it proposes: the verifier still decides every
    token, so output stays lossless.

    The kernel is private and checks less than it should: an input width that is not a multiple
    of 16 returns garbage or crashes (torch 2.13). :func:`int8_weight_only_usable` probes it
    before a layer is swapped.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(-1).clamp_min(1e-12) / 127.0  # [N]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("scale32", scale)  # float32: the few-row kernel's (``--weight-layout cpp``)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                         requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.qweight, self.scale).to(x.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, W8A16 weight-only"


def int8_weight_only_usable(linear: torch.nn.Linear) -> bool:
    """Whether :class:`Int8WeightLinear` computes ``linear`` here: a CPU float layer whose input
    width is a multiple of 16, and the kernel agreeing with a float product of the same int8
    weights on a random row (within bfloat16 rounding)."""
    w = linear.weight
    if (w.device.type != "cpu" or not w.is_floating_point() or w.dim() != 2 or w.shape[1] % 16
            or not hasattr(torch, "_weight_int8pack_mm")):
        return False
    q = Int8WeightLinear(linear)
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        got = torch._weight_int8pack_mm(x, q.qweight, q.scale).float()
        ref = (x.float() @ q.qweight.float().t()) * q.scale.float()
    return bool(torch.isfinite(got).all()) and float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


#: ``--draft-precision`` name -> one line for reports and ``--help``.
DRAFT_PRECISIONS: dict[str, str] = {
    "as-loaded": "the draft in the verifier's dtype (what the export holds)",
    "int8": "the draft layer's and head's weights int8 per channel, CPU: bfloat16 activations through ATen's "
            "kernel (W8A16), or in the cpp layout the few-row kernel's int8 form (float32 sums, activations in "
            "the model's dtype); proposals change by rounding, output stays lossless",
}


def quantize_draft(draft: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The draft ``draft`` at ``precision`` (a key of :data:`DRAFT_PRECISIONS`); ``as-loaded`` returns it.

    ``int8`` returns a copy whose decoder layer and ``lm_head`` Linears are
    :class:`Int8WeightLinear` (what a cached draft step multiplies by); ``fc``, which maps
    the verifier's states once per round, and the embedding stay as they are.

    Raises:
        DraftsmithError: an unknown precision, a draft not on the CPU, or no layer the kernel takes.
    """
    if precision not in DRAFT_PRECISIONS:
        raise DraftsmithError(f"--draft-precision: expected one of {list(DRAFT_PRECISIONS)}, got {precision!r}")
    if precision == "as-loaded":
        return draft
    device = next(draft.parameters()).device
    if device.type != "cpu":
        raise DraftsmithError(f"--draft-precision int8 runs on CPU (ATen's int8 weight-only kernel); the draft "
                              f"is on {device}, where it runs in the verifier's dtype")
    q = copy.deepcopy(draft)
    # A draft inside a weight layout (``--weight-layout onednn`` / ``cpp``) holds its Linears as
    # subclasses switched in place for the block; its copy gets plain Linears (the block puts
    # back only the original's), and each is quantized as a plain one would be. Swapping only
    # ``type is nn.Linear`` here once left such a draft's decoder layer in float32 unnoticed.
    for mod in q.modules():
        if isinstance(mod, torch.nn.Linear) and type(mod) is not torch.nn.Linear:
            mod.__class__ = torch.nn.Linear
    n = _swap_linears(q.layers, Int8WeightLinear, int8_weight_only_usable)
    if int8_weight_only_usable(q.lm_head):
        q.lm_head = Int8WeightLinear(q.lm_head)
        n += 1
    if n == 0:
        raise DraftsmithError("--draft-precision int8: no layer of the draft fits the int8 kernel "
                              "(input widths must be multiples of 16)")
    return q.eval()


def rounds_activations(model: torch.nn.Module) -> bool:
    """Whether a layer of ``model`` rounds its input (:class:`Int8Linear`): its verify forwards must
    then attend one query at a time to compute what one-token steps compute (``KVCache(per_query=True)``)."""
    return any(getattr(mod, "rounds_activations", False) for mod in model.modules())


def _swap_linears(module: torch.nn.Module, make: type = Int8Linear,
                  takes: Callable[[torch.nn.Linear], bool] = lambda _: True) -> int:
    """Replace every ``nn.Linear`` below ``module`` that ``takes`` accepts with ``make(linear)``;
    returns how many."""
    n = 0
    for name, child in module.named_children():
        if type(child) is torch.nn.Linear:
            if takes(child):
                setattr(module, name, make(child))
                n += 1
        else:
            n += _swap_linears(child, make, takes)
    return n


def quantize_verifier(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """A quantized copy of ``model`` (the original is left as it is).

    Args:
        model: a transformers causal LM (float weights).
        method: a key of :data:`QUANTIZATIONS`.

    Raises:
        DraftsmithError: unknown method, the wrong device for it, or a missing package.
    """
    if method not in QUANTIZATIONS:
        raise DraftsmithError(f"--quantize: expected one of {list(QUANTIZATIONS)}, got {method!r}")
    device = next(model.parameters()).device
    wants = QUANTIZATIONS[method][0]
    if device.type != wants:
        other = next(m for m, (d, _) in QUANTIZATIONS.items() if d == device.type) if any(
            d == device.type for d, _ in QUANTIZATIONS.values()) else None
        raise DraftsmithError(f"--quantize {method} runs on {wants.upper()}, the verifier is on {device}"
                              + (f"; use --quantize {other} there" if other else ""))
    if method == "int8":
        q = copy.deepcopy(model)
        if _swap_linears(q) == 0:
            raise DraftsmithError("--quantize int8: the verifier has no nn.Linear layers to quantize")
        return q.eval()
    return _torchao_int4(model)


def parameters_to(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its floating parameters in ``dtype`` and its buffers as they are: ``Module.to(dtype)``
    also rounds the rotary embedding's float32 ``inv_freq`` tables, which transformers keeps in float32
    at any dtype (in bfloat16 each frequency is off by up to 2^-9, a phase error growing with position)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return model


def _torchao_int4(model: torch.nn.Module) -> torch.nn.Module:
    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_
    except ImportError as e:
        raise DraftsmithError(f"--quantize int4 needs torchao: pip install --no-deps {TORCHAO_PIN} "
                              "(requirements-quant.txt)") from e
    if torch.cuda.get_device_capability(next(model.parameters()).device)[0] < 8:
        raise DraftsmithError("--quantize int4: tinygemm's int4 kernel needs a GPU of compute capability >= 8.0")
    q = parameters_to(copy.deepcopy(model), torch.bfloat16)  # tile-packed int4 takes bfloat16 activations only
    # Layers whose input width is not a multiple of the group size stay in bfloat16 (torchao skips them too).
    quantize_(q, Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d"),
              filter_fn=lambda m, _fqn: isinstance(m, torch.nn.Linear) and m.in_features % INT4_GROUP_SIZE == 0)
    return q.eval()


def output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output head (a quantized head has no float weight to ask)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])
