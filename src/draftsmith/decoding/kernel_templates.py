"""Inductor's C++ GEMM template rendered without parsing the same text again for every GEMM.

A compiled CPU step (:class:`~draftsmith.decoding.runner.CompiledFn`) multiplies its weights through
inductor's C++ GEMM template, and rendering one GEMM's kernel parses text that is the same for every
GEMM, over and over (PyTorch 2.13):

- ``KernelTemplate._template_from_string`` builds a new jinja2 ``Template`` (jinja's lexer, parser
  and compiler to Python bytecode) from its source on each of the ~10 calls a GEMM's rendering makes
  (the kernel, its micro-kernel, its stubs and parameter blocks); the sources are module constants
  of inductor;
- ``cpp_template_kernel.parse_expr_with_index_symbols`` parses each index expression the template
  writes as text (``"m_end - m_start"``) with sympy's parser, ~40 times per GEMM.

SmolLM2-135M's one-token step has 211 GEMMs, each rendered twice; a profile of its compile (AMD EPYC,
cProfile) put 48 s of 117 in ``jinja2.Environment.from_string`` and 12 s in the index parses
(BENCHMARKS 15d). :func:`cache_kernel_templates` memoizes both by their text. Sound because the result
is a function of the text alone and never changed by its users: a jinja2 ``Template`` is immutable
once built and renders from each ``render`` call's arguments (a new context per call), in the one
environment inductor builds per process (``jinja2_env``, itself cached) with the same filter set
always; a sympy expression is immutable; lists are built anew per call (their items memoized); a
text that fails to parse raises again (exceptions are not cached). ``DRAFTSMITH_TEMPLATE_CACHE=0``
leaves inductor as it is.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

log = logging.getLogger(__name__)

#: distinct texts kept per memo (inductor's templates are a few dozen; a model's index texts, hundreds)
MAX_TEXTS = 4096


def template_cache_enabled() -> bool:
    """``DRAFTSMITH_TEMPLATE_CACHE``: ``1`` (default) parses each text once; ``0`` leaves inductor as is."""
    return os.environ.get("DRAFTSMITH_TEMPLATE_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def _memo_templates(raw: Callable) -> Callable:
    return functools.lru_cache(maxsize=MAX_TEXTS)(raw)


def _memo_index_exprs(raw: Callable) -> Callable:
    import sympy

    by_text = functools.lru_cache(maxsize=MAX_TEXTS)(lambda text: raw(text))

    @functools.wraps(raw)
    def parse(expr: Any) -> Any:
        if isinstance(expr, (sympy.Expr, list, tuple)):  # as it is / a new list, each item through here
            return raw(expr)
        return by_text(str(expr))  # the raw function parses str(expr): the same text, the same result

    parse.cache_info = by_text.cache_info  # type: ignore[attr-defined]
    return parse


#: name -> (module, class or None, attribute, the memo around inductor's own function)
_TARGETS: dict[str, tuple[str, str | None, str, Callable[[Callable], Callable]]] = {
    "templates": ("torch._inductor.codegen.common", "KernelTemplate", "_template_from_string", _memo_templates),
    "index_exprs": ("torch._inductor.codegen.cpp_template_kernel", None, "parse_expr_with_index_symbols",
                    _memo_index_exprs),
}


def _slot(name: str) -> tuple[Any, Callable | None, Callable | None]:
    """(where the function lives, inductor's own function, the one in place now); Nones where this
    PyTorch lacks it or holds it otherwise than this was written against."""
    module, cls, attr, _ = _TARGETS[name]
    try:
        import importlib

        import torch._inductor.compile_fx  # noqa: F401  inductor in its own import order (a codegen module first is circular)

        owner = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls)
    except (ImportError, AttributeError):
        return None, None, None
    current = owner.__dict__.get(attr) if cls is not None else getattr(owner, attr, None)
    if cls is not None:
        if not isinstance(current, staticmethod):
            return None, None, None
        current = current.__func__
    if not callable(current):
        return None, None, None
    raw = current.__wrapped__ if getattr(current, "draftsmith_memo", False) else current
    return owner, raw, current


def _put(name: str, owner: Any, fn: Callable) -> None:
    _, cls, attr, _ = _TARGETS[name]
    setattr(owner, attr, staticmethod(fn) if cls is not None else fn)


def cache_kernel_templates() -> bool:
    """Memoize inductor's template and index-expression parses (the module's docstring), or put its own
    functions back under ``DRAFTSMITH_TEMPLATE_CACHE=0``. Idempotent; True when the memos are in place
    (either one, where this PyTorch has only one of the functions)."""
    on, placed = template_cache_enabled(), False
    for name, (_, _, _, memo) in _TARGETS.items():
        owner, raw, current = _slot(name)
        if raw is None:
            continue
        if not on:
            if current is not raw:
                _put(name, owner, raw)
            continue
        if current is raw:
            fn = memo(raw)
            fn.__wrapped__, fn.draftsmith_memo = raw, True
            _put(name, owner, fn)
            log.debug("inductor's %s: parsed once per text", name)
        placed = True
    return placed


def template_cache_info() -> dict[str, Any] | None:
    """Each memo's ``functools`` statistics (hits, misses, size) by name; None when none is in place."""
    out = {}
    for name in _TARGETS:
        _, raw, current = _slot(name)
        if raw is not None and current is not raw:
            out[name] = current.cache_info()._asdict()
    return out or None
