"""The verifier's side of a generation: forward over a cache sized to the request, rollback by index.

:func:`verifier_runner` picks, for a given model, the leanest path that computes
exactly what the transformers forward computes:

- ``lean``: :class:`~draftsmith.models.lean.LeanDecoder` over a preallocated
  :class:`~draftsmith.models.kv.KVCache` (Llama, Mistral, Qwen2/3, Gemma 3 with
  SDPA attention). Optionally compiled (``torch.compile``; CUDA graphs on CUDA).
- ``hf-static``: the model's own transformers forward with :class:`StaticPrefixCache`
  (preallocated, rollback by index) and forward hooks for the aux hidden states:
  any decoder whose layers are full or sliding-window attention.
- ``hf-dynamic``: the transformers forward with a ``DynamicCache`` (with past
  recording, so sliding windows can roll back): everything else, e.g. linear or
  chunked attention layers, whose state cannot be rolled back by an index.

Every path appends the new positions on :meth:`VerifierRunner.forward` and keeps
the first ``n`` on :meth:`VerifierRunner.rollback`; that is all the engine sees.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import statistics
import time
import types
import weakref
from typing import Any, Callable

import torch

from draftsmith.decoding.frozen import after_compiled_call
from draftsmith.decoding.kernel_templates import cache_kernel_templates
from draftsmith.errors import DraftsmithError
from draftsmith.models.kv import KVCache
from draftsmith.models.lean import LeanDecoder, layer_windows, lean_unsupported
from draftsmith.models.quantize import rounds_activations

log = logging.getLogger(__name__)

MODES = ("auto", "lean", "hf-static", "hf-dynamic")


class VerifierRunner:
    """Interface: ``forward`` appends positions, ``rollback`` keeps a prefix, ``length`` counts them.

    Attributes:
        kind: ``lean``, ``hf-static`` or ``hf-dynamic``.
        compiled: whether steps run a compiled graph.
        compile_seconds: wall time spent compiling (warm-up calls), 0 when cached or eager.
    """

    kind = ""
    compiled = False
    compile_seconds = 0.0
    length = 0

    def forward(self, ids: torch.Tensor, keep: int,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``ids [m]``; return logits ``[keep, V]`` and aux hidden states ``[m, A*H]`` (or None)."""
        raise NotImplementedError

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        raise NotImplementedError

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` positions in all (a no-op where the cache grows by itself)."""

    def close(self) -> None:
        """Release hooks placed on the model."""


# --------------------------------------------------------------------------------------- lean
class _CompiledStep:
    """One compiled lean step per model, shared by its runners and reused across prompts.

    Its caches (one per role: the verifier, or the same model serving as a draft) are kept
    too, so CUDA graphs see the same buffer addresses from one prompt to the next.
    """

    def __init__(self, decoder: LeanDecoder) -> None:
        self.decoder = decoder
        self.held: tuple = ()  # (projections_held, weights_version) of the model when it was built
        self.cuda = decoder.device.type == "cuda"
        self.caches: dict[str, KVCache] = {}
        self.warm: set[tuple] = set()  # (capacity, step length, aux) shapes already compiled (and chosen)
        self.fn = CompiledFn(self._step, decoder.device)  # the one-token steps
        # the verify steps' candidates (one graph each for every length > 1), and which one each length runs
        self.verify = {name: self.fn if tiers is None else CompiledFn(self._step, decoder.device, tiers)
                       for name, tiers in verify_candidates(self.cuda).items()}
        self.verify_choice: dict[tuple, dict[str, Any]] = {}  # (length, aux) -> {"tier", "ms"}
        self.choice_seconds = 0.0  # spent compiling and timing candidates (see _choose)

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, aux: tuple[int, ...]):
        return self.decoder.forward(ids, pos, cache, None, aux)

    def cache(self, role: str, capacity: int) -> KVCache:
        """The role's cache, grown to ``capacity`` rounded up to :data:`CAPACITY_BUCKET` when short."""
        cache = self.caches.get(role)
        if cache is None or cache.capacity < capacity:
            cache = self.caches[role] = self.decoder.new_cache(-(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET)
            if self.cuda:
                cache.mark_static_addresses()
        cache.length = 0
        return cache

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, aux: tuple[int, ...]):
        fn = self.fn
        if ids.shape[0] > 1:  # one graph for every verify length instead of one per k + 1
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
            fn = self._verify_fn(ids, pos, cache, aux)
        logits, hidden = self._run(fn, ids, pos, cache, aux)
        if self.cuda:  # a CUDA graph's outputs are overwritten by its next replay
            logits = logits.clone()
            hidden = hidden.clone() if hidden is not None else None
        return logits, hidden

    def _run(self, fn: "CompiledFn", ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, aux: tuple[int, ...]):
        cache.static = True
        try:
            if self.cuda:
                torch.compiler.cudagraph_mark_step_begin()
            return fn(ids, pos, cache, aux)
        finally:
            cache.static = False

    def _verify_fn(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, aux: tuple[int, ...]) -> "CompiledFn":
        if len(self.verify) == 1:
            return next(iter(self.verify.values()))
        key = (ids.shape[0], aux)
        choice = self.verify_choice.get(key)
        if choice is None:
            choice = self.verify_choice[key] = self._choose(ids, pos, cache, aux)
        return self.verify[choice["tier"]]

    def _choose(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, aux: tuple[int, ...]) -> dict[str, Any]:
        """Time each verify candidate on this call's arguments (its length, its cache) and pick one:
        the first (the engine's tiers) unless another is more than :data:`VERIFY_TIE` faster.

        The calls are repeats of the one about to run: each writes the same positions of the cache,
        and the chosen candidate's call that follows writes them last. Compiling a candidate the
        first time (a new graph) is part of the time spent here, all of it reported as compile time.
        """
        t0 = time.perf_counter()
        for name in list(self.verify):  # the first call of a candidate may compile its graph: not timed
            try:
                self._run(self.verify[name], ids, pos, cache, aux)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                if name == next(iter(self.verify)):
                    raise
                log.warning("the %s verify step does not compile here (%s); it is not a candidate", name,
                            str(e).splitlines()[0][:200])
                del self.verify[name]
        names = list(self.verify)
        seen: dict[str, list[float]] = {name: [] for name in names}
        for p in range(VERIFY_PROBE_PASSES):
            for name in names[p % len(names):] + names[:p % len(names)]:  # alternate, so drift hits all
                t = time.perf_counter()
                self._run(self.verify[name], ids, pos, cache, aux)
                seen[name].append(time.perf_counter() - t)
        ms = {name: 1e3 * statistics.median(v) for name, v in seen.items()}
        tier = pick_verify(ms)
        self.choice_seconds += time.perf_counter() - t0
        log.info("compiled verify of %d tokens: %s (%s)", ids.shape[0], tier,
                 ", ".join(f"{n} {v:.2f} ms" for n, v in ms.items()))
        return {"tier": tier, "ms": ms}

    def warmup(self, cache: KVCache, aux: tuple[int, ...], shapes: tuple[int, ...]) -> float:
        """Compile (and on CUDA record) the step lengths in ``shapes``; returns the seconds it took."""
        t0 = time.perf_counter()
        did = False
        dev = cache.keys[0].device
        for m in shapes:
            # one graph with a dynamic length serves every verify length on the CPU (unless its candidates
            # are timed per length); on CUDA each length records a CUDA graph of its own
            key = (cache.capacity, m if m == 1 or len(self.verify) > 1 or self.cuda else "verify", aux)
            if key in self.warm:
                continue
            for _ in range(3 if self.cuda else 1):  # CUDA graph trees warm up, then record
                self(torch.zeros(m, dtype=torch.long, device=dev), torch.arange(m, device=dev), cache, aux)
            self.warm.add(key)
            did = True
        if did and self.cuda:
            torch.cuda.synchronize(dev)
        cache.length = 0  # the warm-up wrote garbage at positions the prompt overwrites
        return time.perf_counter() - t0 if did else 0.0


#: How a compiled CPU step is built, tried in order: a tier whose compile fails gives way to the next.
#: ``freezing`` makes the weights constants of the graph (packed once, at compile time), which lets
#: inductor's C++ GEMM template (``CPP``) multiply them: a kernel tuned for the few rows of a decode
#: or verify step that streams the weights near memory bandwidth, where MKL's and oneDNN's are not
#: (AMD EPYC, float32, SmolLM2-135M: a one-token step 24 ms compiled this way, 54 ms eager; BENCHMARKS
#: 9j). The cost: the packed copy of the weights lives beside the model's own (RSS + ~1x weights; one
#: copy for all of a model's frozen graphs, which would each hold their own: decoding/frozen.py).
#: The C++ template alone first (tuning it against ATen compiles and times both, +25% compile time
#: for steps no faster), then with ATen as a choice, then inductor's defaults.
CPU_COMPILE_TIERS: tuple[dict[str, Any], ...] = (
    {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
    {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
    {},
)


#: Options added to every CPU tier that freezes: inductor's FX graph cache off. It keys a frozen
#: graph by its weights' shapes, not their values, and the int8 GEMM template's weights, packed at
#: compile time, are stored in the cache entry: a second model of the same shapes (another draft,
#: or a draft retrained since), compiled on this machine in any later process, multiplied the
#: first one's packed weights. A retrained int8 draft then accepted nothing (acceptance 1.000
#: compiled, 1.31 eager; PyTorch 2.13, BENCHMARKS 9v); float32 graphs were never served from it.
FROZEN_UNCACHED: dict[str, Any] = {"fx_graph_cache": False}


#: inductor's C++ wrapper on the CPU: the compiled step's host code, which calls the ~300 kernels of
#: a SmolLM2-135M step one by one and checks their arguments, generated as C++ instead of Python,
#: and built apart from the kernels (``cpp_wrapper_build_separate``: at -O1, +130 s of compile for
#: every step of a bench with a draft instead of +235 s in one -O3 build, as fast). Intel Sapphire
#: Rapids, float32, 2 threads: the one-token step 2.5-3.0% faster; ``generate`` ~5% more tokens per
#: second plain, ~3% with an EAGLE-3 draft at k = 2. AMD EPYC (Zen 4, no AMX): the step 1-2% *slower*,
#: ``generate`` plain ~2% slower, with a draft even (both load orders; BENCHMARKS 15). Hence
#: :func:`compile_wrapper`'s ``auto``. A tier under it that fails to compile gives way to the same
#: tier without.
CPU_WRAPPER: dict[str, Any] = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}

#: ``DRAFTSMITH_COMPILE_WRAPPER`` values
COMPILE_WRAPPERS = ("auto", "cpp", "python")


def compile_wrapper() -> str:
    """Which host code a compiled CPU step runs (``DRAFTSMITH_COMPILE_WRAPPER``): ``cpp``
    (:data:`CPU_WRAPPER`), ``python`` (inductor's default; compiles faster), or ``auto`` (the default):
    ``cpp`` on a CPU with AMX tiles, the kind it was measured faster on (an Intel Sapphire Rapids),
    ``python`` elsewhere (an AMD EPYC ran it 1-2% slower). Returns ``cpp`` or ``python``."""
    mode = os.environ.get("DRAFTSMITH_COMPILE_WRAPPER", "auto").strip().lower()
    if mode not in COMPILE_WRAPPERS:
        raise DraftsmithError(f"DRAFTSMITH_COMPILE_WRAPPER={mode!r}: expected one of {', '.join(COMPILE_WRAPPERS)}")
    if mode == "auto":  # the CPU's own flag: the wrapper is host code, whatever oneDNN is limited to
        from draftsmith.utils import cpu_has_amx

        return "cpp" if cpu_has_amx(onednn_limit=False) else "python"
    return mode


def wrapped_tiers(tiers: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """``tiers`` as a compiled CPU step tries them: under :func:`compile_wrapper` ``cpp``, the first
    with :data:`CPU_WRAPPER` before it as it is (a wrapper that does not build costs one compile)."""
    if compile_wrapper() == "python" or not tiers:
        return tiers
    return (dict(tiers[0], **CPU_WRAPPER), *tiers)


#: The compiled verify step's other candidate on the CPU: the weights read as they are (not frozen),
#: so its matmuls are ATen's ``mm``/``addmm`` (MKL). On an Intel Sapphire Rapids (float32, SmolLM2-135M)
#: a verify of 3 tokens cost 26.4 ms this way against 31.5 ms with the C++ GEMM template, whose
#: one-token step is the faster one (21.4 vs 23.4 ms), and of 4 tokens 38.2 against 34.3 ms
#: (BENCHMARKS 9r); on an AMD EPYC the template is what made the compiled step fast (9j). So which
#: one verifies is measured per length, on the machine (:meth:`_CompiledStep._choose`).
CPU_VERIFY_ATEN: dict[str, Any] = {"freezing": False}
#: A candidate must beat the first (the engine's tiers) by more than this fraction to verify instead
VERIFY_TIE = 0.03
#: Timed calls per candidate when a verify length is first seen
VERIFY_PROBE_PASSES = 5


def verify_candidates(cuda: bool) -> dict[str, tuple[dict[str, Any], ...] | None]:
    """The compiled verify steps' candidates, by name, each the tiers its :class:`CompiledFn` tries
    (None: the one-token steps' own, sharing their function). ``DRAFTSMITH_VERIFY_TIER``: ``auto``
    (default: on the CPU, the C++ template and ATen, timed per verify length), ``template`` or
    ``aten`` (only that one). CUDA steps have one path (CUDA graphs)."""
    mode = os.environ.get("DRAFTSMITH_VERIFY_TIER", "auto").strip().lower()
    if mode not in ("auto", "template", "aten"):
        raise DraftsmithError(f"DRAFTSMITH_VERIFY_TIER={mode!r}: expected auto, template or aten")
    if cuda or mode == "template":
        return {"template": None}
    if mode == "aten":
        return {"aten": (CPU_VERIFY_ATEN,)}
    return {"template": None, "aten": (CPU_VERIFY_ATEN,)}


def pick_verify(ms: dict[str, float], tie: float = VERIFY_TIE) -> str:
    """The candidate that verifies, from their times ``ms`` (in order, the engine's tiers first): the
    fastest if it beats the first by more than ``tie``, else the first."""
    first = next(iter(ms))
    best = min(ms, key=ms.__getitem__)
    return best if ms[best] < ms[first] * (1 - tie) else first


_SERIAL = itertools.count()


def _own_code(fn: Callable) -> Callable:
    """``fn`` (a function or bound method) over a code object of its own.

    Dynamo keeps compiled graphs per code object and reuses one for any call whose guards pass:
    the steps of two models (or of one model before and after its weights were written) share
    ``_step``'s code, and their guards look at shapes, not at which weights are read. Graphs
    with frozen weights must not be shared, so each :class:`CompiledFn` compiles its own.
    """
    bound = getattr(fn, "__self__", None)
    f = getattr(fn, "__func__", fn)
    code = f.__code__.replace(co_name=f"{f.__name__}_{next(_SERIAL)}")
    own = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    own.__kwdefaults__ = f.__kwdefaults__
    return types.MethodType(own, bound) if bound is not None else own


class CompiledFn:
    """``torch.compile(fn)``: CUDA graphs on CUDA (``reduce-overhead``); on CPU, under the first of
    :data:`CPU_COMPILE_TIERS` (or ``tiers``; :func:`wrapped_tiers`) that compiles (inductor reads its
    options while it compiles, which happens inside a call: every call runs under them).

    The CPU tiers freeze the weights fn reads: a graph keeps multiplying the values they had when
    it was compiled. Whoever holds one rebuilds it when the weights change (:func:`weights_version`).
    """

    def __init__(self, fn: Callable, device: torch.device,
                 tiers: tuple[dict[str, Any], ...] | None = None) -> None:
        self.raw, self.cuda = _own_code(fn), torch.device(device).type == "cuda"
        self.tiers = CPU_COMPILE_TIERS if tiers is None else tiers
        if not self.cuda:
            self.tiers = wrapped_tiers(self.tiers)
        self.tier = 0
        self.skip_guards = guard_skipping(self.cuda)
        cache_kernel_templates()  # inductor's GEMM templates parsed once, not per GEMM rendered
        self._build()

    def _build(self) -> None:
        self.options = {} if self.cuda else dict(self.tiers[self.tier])
        if self.options.get("freezing"):
            self.options.update(FROZEN_UNCACHED)
        self.fn = torch.compile(self.raw, mode="reduce-overhead" if self.cuda else None)
        self.trusted: set[tuple] = set()  # call signatures whose guards passed in a full check (see __call__)
        self.distrusted: set[tuple] = set()  # trusted ones that still needed a recompile: always checked in full

    def __call__(self, *args: Any) -> Any:
        """``fn(*args)`` compiled. A call whose signature (:func:`call_signature`) already passed dynamo's
        full guard check skips it, running only the guards that tell this function's compiled graphs
        apart (``skip_guard_eval_unsafe``): 1.5 ms of a 20 ms compiled step of SmolLM2-135M on the CPU
        went to checking ~3000 guards on the model's modules, none of which can change between two
        calls of one step (a step whose weights or layout change is rebuilt: :class:`_CompiledStep`).
        """
        sig = call_signature(args) if self.skip_guards else None
        while True:
            try:
                if sig is not None and sig in self.trusted:
                    try:
                        # no inductor options patched in: under this stance nothing compiles (a call
                        # that would raises, below), and a compiled graph reads none when it runs
                        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                            return self.fn(*args)
                    except RuntimeError as e:  # no graph's distinguishing guards passed: check them all
                        if "skip_guard_eval_unsafe" not in str(e):
                            raise
                        log.debug("a trusted call signature needed a recompile; its guards are checked in full")
                        self.trusted.discard(sig)
                        self.distrusted.add(sig)
                out = self._run(args)
                after_compiled_call()  # a graph compiled now: its packed weights shared, the heap trimmed
                if sig is not None and sig not in self.distrusted:
                    self.trusted.add(sig)
                return out
            except torch._dynamo.exc.BackendCompilerFailed as e:
                if self.cuda or self.tier + 1 >= len(self.tiers):
                    raise
                log.warning("compiling with %s failed (%s); trying %s", self.options or "defaults",
                            str(e).splitlines()[0][:200], self.tiers[self.tier + 1] or "inductor's defaults")
                self.tier += 1
                self._build()

    def _run(self, args: tuple) -> Any:
        if not self.options:
            return self.fn(*args)
        with torch._inductor.config.patch(self.options):
            return self.fn(*args)


def guard_skipping(cuda: bool) -> bool:
    """Whether :class:`CompiledFn` skips the full guard check on calls it has seen pass it
    (``DRAFTSMITH_COMPILE_GUARDS``: ``full`` never, ``skip`` always, ``auto``: on the CPU, where it was
    measured; CUDA graphs keep the full check until a GPU run measures them)."""
    mode = os.environ.get("DRAFTSMITH_COMPILE_GUARDS", "auto").strip().lower()
    if mode not in ("auto", "full", "skip"):
        raise DraftsmithError(f"DRAFTSMITH_COMPILE_GUARDS={mode!r}: expected auto, full or skip")
    return mode == "skip" or (mode == "auto" and not cuda)


def _signature_of(a: Any) -> Any:
    """One argument's part of :func:`call_signature`; TypeError for a value it cannot key by."""
    if isinstance(a, torch.Tensor):  # is_inference: dynamo guards the dispatch keys, which it changes
        return (tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device, a.requires_grad, a.is_inference())
    if isinstance(a, KVCache):
        k = a.keys[0]
        return ("cache", id(a), a.capacity, len(a.keys), tuple(k.shape), k.dtype, k.device, a.static,
                tuple(a.windows), a.cpu_kernel)
    if isinstance(a, (list, tuple)):
        return (type(a), tuple(_signature_of(x) for x in a))
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(a), a)
    raise TypeError(type(a).__name__)


def call_signature(args: tuple) -> tuple | None:
    """What selects a compiled graph for a call of a compiled step: each tensor's shape, strides,
    storage offset (dynamo guards views by it), dtype, device and whether it is an inference tensor
    (one made outside ``inference_mode`` has other dispatch keys: another graph); each cache by
    identity and the shape, dtype and windows of its buffers; lists and tuples element by element;
    other values as they are (ints, floats, strings); and the autograd mode. Two calls of one
    signature run the same graph on whatever the tensors hold. None (check every guard) for a value
    it cannot key by."""
    try:
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) + tuple(_signature_of(a) for a in args)
    except TypeError:
        return None


def weights_version(module: torch.nn.Module) -> tuple[int, ...]:
    """Each parameter's in-place version counter: changes whenever a weight is written in place
    (an optimizer step, ``load_state_dict``, ``copy_``), so a graph with frozen weights can tell."""
    out = []
    for p in module.parameters():
        try:
            out.append(p._version)
        except RuntimeError:  # an inference tensor: no counter (and no in-place writes outside inference mode)
            out.append(-1)
    return tuple(out)


_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, _CompiledStep]" = weakref.WeakKeyDictionary()


def projections_held(model: torch.nn.Module) -> tuple:
    """What a lean decoder binds of ``model``'s Linear layers when it is built: each one's class and
    its weight's storage. A compiled step built under another ``--weight-layout`` (oneDNN's class,
    the weights held transposed) would keep multiplying the old way, so it is rebuilt on a change."""
    held = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = getattr(m, "weight", None)
            plain = isinstance(w, torch.Tensor) and type(w.data) is torch.Tensor
            held.append((type(m), w.data_ptr() if plain else id(w), tuple(w.stride()) if plain else None))
    return tuple(held)

# Compiled caches come in sizes of this many positions, so prompts of similar length share graphs.
CAPACITY_BUCKET = 512

#: Per model: the aux hidden states its compiled steps compute when a call asks for none
#: (:func:`shared_aux_outputs`).
_SHARED_AUX: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def share_aux() -> bool:
    """Whether :func:`shared_aux_outputs` applies (``DRAFTSMITH_SHARE_AUX``, default on; ``0`` gives
    the steps that ask for no aux hidden states graphs of their own, as before it)."""
    return os.environ.get("DRAFTSMITH_SHARE_AUX", "1") != "0"


def shared_aux_layers(model: torch.nn.Module) -> tuple[int, ...]:
    """The aux layers whose graphs ``model``'s compiled steps without aux outputs run now (``()``: their own)."""
    return _SHARED_AUX.get(model, ())


@contextlib.contextmanager
def shared_aux_outputs(model: torch.nn.Module, aux_layer_ids: tuple[int, ...]):
    """Within the block, ``model``'s compiled steps that ask for no aux hidden states (a plain
    decode, an n-gram drafter's verify, a step timed alone) run the graphs that return
    ``aux_layer_ids``'s, and drop them.

    A bench of EAGLE-3 drafts otherwise compiles every verifier step twice, with and without aux
    outputs, each a full compile of the model: a compiled bench of one draft at two precisions
    compiled in 84-99 s this way, 166-169 s without (SmolLM2-135M, AMD EPYC, BENCHMARKS 15e). The
    shared graph writes three more ``[m, H]`` rows per step: the plain one-token step 0.997x its own
    graph's time there. Runners made before the block keep their graphs; eager steps are untouched.
    No-op for an empty ``aux_layer_ids`` or under ``DRAFTSMITH_SHARE_AUX=0``.
    """
    aux = tuple(aux_layer_ids)
    if not aux or not share_aux():
        yield
        return
    before = _SHARED_AUX.get(model)
    _SHARED_AUX[model] = aux
    try:
        yield
    finally:
        if before is None:
            _SHARED_AUX.pop(model, None)
        else:
            _SHARED_AUX[model] = before


class LeanRunner(VerifierRunner):
    """:class:`LeanDecoder` over a :class:`KVCache`; compiled decode/verify steps when ``compile``."""

    kind = "lean"

    def __init__(self, model: torch.nn.Module, capacity: int, compile: bool = False,
                 aux_layer_ids: tuple[int, ...] = (), warmup_shapes: tuple[int, ...] = (),
                 role: str = "verifier") -> None:
        self.aux = tuple(aux_layer_ids)
        if compile and rounds_activations(model):
            # The compiled step attends all queries at once over a static cache; a verifier that
            # rounds its activations needs one query at a time to stay bitwise (models/kv.py).
            log.warning("--compile: this verifier rounds its activations (int8); its steps run eager")
            compile = False
        self.compiled = compile
        if not compile:
            self.decoder = LeanDecoder(model)
            self.cache = self.decoder.new_cache(capacity)
            return
        step, held = _COMPILED.get(model), (projections_held(model), weights_version(model))
        # new, or the weights are held otherwise now (--weight-layout), or written since (frozen in its graphs)
        if step is None or step.held != held:
            step = _COMPILED[model] = _CompiledStep(LeanDecoder(model, by_module=True))
            step.held = held
        self.step, self.decoder = step, step.decoder
        # the aux outputs its compiled steps return: its own, else those the model's steps share
        self.graph_aux = self.aux or shared_aux_layers(model)
        self.cache = step.cache(role, capacity)
        self._warm_seconds = step.warmup(self.cache, self.graph_aux, warmup_shapes)
        self._chosen_before = step.choice_seconds  # choices made later (a verify length first seen) add to it

    @property
    def compile_seconds(self) -> float:  # type: ignore[override]
        """Warm-up compiles, and any verify candidates compiled and timed since (:meth:`_CompiledStep._choose`)."""
        if not self.compiled:
            return 0.0
        return self._warm_seconds + self.step.choice_seconds - self._chosen_before

    @property
    def verify_tiers(self) -> dict[str, Any]:
        """Compiled: which candidate verifies each length so far, with their timings (ms), by length."""
        if not self.compiled:
            return {}
        return {str(m): dict(c) for (m, aux), c in sorted(self.step.verify_choice.items()) if aux == self.graph_aux}

    @property
    def length(self) -> int:  # type: ignore[override]
        return self.cache.length

    def forward(self, ids: torch.Tensor, keep: int,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, start = ids.shape[0], self.cache.length
        self.cache.check_room(m)
        pos = torch.arange(start, start + m, device=ids.device)
        aux = tuple(aux_layer_ids)
        # The prompt runs eager: one graph per prompt length would not pay for its compile time.
        if self.compiled and start > 0 and keep == m:
            logits, hidden = self.step(ids, pos, self.cache, aux or self.graph_aux)
            if not aux:
                hidden = None  # computed by a shared graph (shared_aux_outputs), not asked for
        else:
            logits, hidden = self.decoder.forward(ids, pos, self.cache, keep, aux)
        self.cache.advance(m)
        return logits, hidden

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def reserve(self, capacity: int) -> None:
        if self.compiled and capacity > self.cache.capacity:
            raise DraftsmithError(f"compiled KV cache holds {self.cache.capacity} positions, {capacity} asked")
        self.cache.reserve(capacity)


# --------------------------------------------------------------------------------------- transformers forward
@functools.lru_cache(maxsize=None)
def _prefix_cache_classes():
    """The transformers-protocol classes, built on first use (importing transformers is slow)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class PrefixLayer(CacheLayerMixin):
        """One preallocated layer: ``update`` writes at the index and returns the prefix view."""

        is_compileable = False
        is_croppable = True
        supports_early_init = False

        def __init__(self, capacity: int, sliding: bool) -> None:
            super().__init__()
            self.capacity, self.is_sliding = capacity, sliding
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            b, h, _, d = key_states.shape
            self.keys = key_states.new_zeros(b, h, self.capacity, d)
            self.values = value_states.new_zeros(b, value_states.shape[1], self.capacity, value_states.shape[3])
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, end = self.length, self.length + key_states.shape[-2]
            if end > self.capacity:
                raise DraftsmithError(f"KV cache full: {start} cached + {end - start} new positions > capacity "
                                      f"{self.capacity}; the cache is sized to the request")
            self.keys[:, :, start:end] = key_states
            self.values[:, :, start:end] = value_states
            self.length = end
            # Sliding layers keep every position too: the mask (absolute positions, offset 0) applies
            # the window, and nothing leaves the cache that a rollback might need back.
            return self.keys[:, :, :end], self.values[:, :, :end]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length + query_length, 0

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return self.capacity

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError("crop takes a negative count of tokens to remove")
            self.length -= min(-tokens_to_remove, self.length)

        def reset(self) -> None:
            self.length = 0

        def reserve(self, capacity: int) -> None:
            if capacity <= self.capacity:
                return
            capacity = max(capacity, 2 * self.capacity)  # amortised growth
            if self.is_initialized:
                for name in ("keys", "values"):
                    old = getattr(self, name)
                    new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
                    new[:, :, : self.length] = old[:, :, : self.length]
                    setattr(self, name, new)
            self.capacity = capacity

    class StaticPrefixCache(Cache):
        """A transformers ``Cache`` of preallocated layers returning prefix views; crop moves an index."""

        def __init__(self, config: Any, capacity: int) -> None:
            super().__init__(layers=[PrefixLayer(capacity, w is not None) for w in layer_windows(config)])

    return PrefixLayer, StaticPrefixCache


def static_prefix_cache(config: Any, capacity: int) -> Any:
    """A transformers ``Cache`` preallocated for ``capacity`` positions, for full/sliding-attention models."""
    return _prefix_cache_classes()[1](config, capacity)


class HFRunner(VerifierRunner):
    """The model's transformers forward; aux hidden states from forward hooks, not ``output_hidden_states``."""

    def __init__(self, model: torch.nn.Module, capacity: int, static: bool) -> None:
        from transformers import DynamicCache

        self.model = model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.kind = "hf-static" if static else "hf-dynamic"
        self.cache = static_prefix_cache(cfg, capacity) if static else DynamicCache(config=model.config)
        self._recording = static  # a DynamicCache records the past only once its layers exist
        self._saved: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self._layers = list(base.layers)
        self._norm = base.norm
        self._want: tuple[int, ...] = ()

    def _hook(self, aux: tuple[int, ...]) -> None:
        if aux == self._want:
            return
        self.close()
        self._want = aux
        n = len(self._layers)
        for i in aux:
            if i < n:
                def pre(mod, args, kwargs, i=i):
                    self._saved[i] = args[0] if args else kwargs["hidden_states"]
                self._hooks.append(self._layers[i].register_forward_pre_hook(pre, with_kwargs=True))
            else:  # hidden_states[n]: the final normed output
                def post(mod, args, out, i=i):
                    self._saved[i] = out
                self._hooks.append(self._norm.register_forward_hook(post))

    @property
    def length(self) -> int:  # type: ignore[override]
        return int(self.cache.get_seq_length())

    def forward(self, ids: torch.Tensor, keep: int,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        aux = tuple(aux_layer_ids)
        self._hook(aux)
        self._saved.clear()
        out = self.model(input_ids=ids[None], cache=self.cache, use_cache=True, logits_to_keep=keep)
        if not self._recording:
            # From here on sliding-window layers keep what a rollback needs.
            self.cache.activate_past_recording()
            self._recording = True
        hidden = torch.cat([self._saved[i][0] for i in aux], -1) if aux else None
        return out.logits[0], hidden

    def rollback(self, length: int) -> None:
        cur = self.length
        if not 0 <= length <= cur:
            raise DraftsmithError(f"cannot roll the KV cache back to {length}: it holds {cur} positions")
        self.cache.crop(-(cur - length))  # crop(0) also trims sliding windows of a DynamicCache

    def reserve(self, capacity: int) -> None:
        for layer in self.cache.layers:
            if hasattr(layer, "reserve"):
                layer.reserve(capacity)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._want = ()


def runner_kind(model: torch.nn.Module) -> tuple[str, str | None]:
    """The path ``auto`` takes for ``model`` and, when it is not ``lean``, why."""
    why = lean_unsupported(model)
    if why is None:
        return "lean", None
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if layer_windows(cfg) is None:
        return "hf-dynamic", f"{why}; and a layer is neither full nor sliding-window attention"
    return "hf-static", why


def verifier_runner(model: torch.nn.Module, capacity: int, compile: bool = False, mode: str = "auto",
                    aux_layer_ids: tuple[int, ...] = (), warmup_shapes: tuple[int, ...] = (),
                    role: str = "verifier") -> VerifierRunner:
    """A runner for ``model`` with room for ``capacity`` positions.

    Args:
        model: the transformers causal LM.
        capacity: the most positions the request reaches (prompt + new tokens + draft + slack).
        compile: compile the decode/verify steps (lean path only; others run eager and say so).
        mode: ``auto`` (the leanest exact path) or one of ``lean``, ``hf-static``, ``hf-dynamic``.
        aux_layer_ids: the hidden states compiled steps return (eager steps take them per call).
        warmup_shapes: step lengths to compile before returning (their time is ``compile_seconds``).
        role: names the compiled cache this runner reuses (a model can verify and draft at once).
    """
    if mode not in MODES:
        raise DraftsmithError(f"engine mode must be one of {', '.join(MODES)}, got {mode!r}")
    kind, why = runner_kind(model) if mode == "auto" else (mode, None)
    if kind == "lean":
        if mode == "lean" and lean_unsupported(model):
            raise DraftsmithError(f"the lean forward cannot run this model: {lean_unsupported(model)}")
        return LeanRunner(model, capacity, compile, aux_layer_ids, warmup_shapes, role)
    if rounds_activations(model):
        log.warning("this verifier rounds its activations (int8) and runs the %s path (%s): its verify "
                    "forwards may round an ulp into an int8 step, and speculative output may leave its "
                    "plain decoding; the lean path attends per query and stays exact", kind, why)
    if compile:
        log.warning("--compile applies to the lean path only; this model runs the %s path (%s)", kind, why)
    elif why:
        log.debug("engine path %s: %s", kind, why)
    return HFRunner(model, capacity, static=kind == "hf-static")
