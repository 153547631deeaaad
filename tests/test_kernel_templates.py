"""Inductor's GEMM template texts parsed once (decoding/kernel_templates.py)."""

from __future__ import annotations

import re

import torch
import torch._inductor.compile_fx  # noqa: F401  (inductor's import order: its codegen modules alone are circular)
from torch._inductor.codegen import cpp_template_kernel
from torch._inductor.codegen.common import KernelTemplate

from draftsmith.decoding import kernel_templates as kt
from draftsmith.decoding.runner import CPU_COMPILE_TIERS, FROZEN_UNCACHED

SOURCE = "{{ a }} + {{ b | indent_except_first(1) }}"


def _parse(source: str):
    return KernelTemplate._template_from_string(source)


def test_templates_are_parsed_once_per_source_and_render_alike(monkeypatch):
    """With the cache on, one source gives one template object (a hit the second time) that renders
    each call's arguments; another source another object; off (the negative control), every call
    parses anew and inductor's own function is back in place; on again, one wrapper, not two."""
    monkeypatch.setenv("DRAFTSMITH_TEMPLATE_CACHE", "1")
    try:
        assert kt.cache_kernel_templates()
        first, again = _parse(SOURCE), _parse(SOURCE)
        assert first is again and kt.template_cache_info()["templates"]["hits"] >= 1
        assert first.render(a=1, b="x\ny") == "1 + x\n    y" and again.render(a=2, b="z") == "2 + z"
        assert _parse(SOURCE + " ") is not first

        monkeypatch.setenv("DRAFTSMITH_TEMPLATE_CACHE", "0")
        assert not kt.cache_kernel_templates()
        assert _parse(SOURCE) is not _parse(SOURCE) and kt.template_cache_info() is None
        assert _parse(SOURCE).render(a=1, b="x") == "1 + x"

        monkeypatch.setenv("DRAFTSMITH_TEMPLATE_CACHE", "1")
        assert kt.cache_kernel_templates() and kt.cache_kernel_templates()
        fn = KernelTemplate.__dict__["_template_from_string"].__func__
        assert fn.__wrapped__ is kt._slot("templates")[1] and not getattr(fn.__wrapped__, "draftsmith_memo", False)
    finally:
        monkeypatch.undo()
        kt.cache_kernel_templates()  # as the environment the suite runs in says


def test_index_expressions_are_parsed_once_per_text(monkeypatch):
    """The same text gives the same (immutable) sympy expression, with inductor's index symbols; a list
    comes back a new list each call (its users unpack and keep it), its items memoized; an expression
    passes through; off (the negative control), inductor's own function is back in place."""
    import sympy

    monkeypatch.setenv("DRAFTSMITH_TEMPLATE_CACHE", "1")
    try:
        kt.cache_kernel_templates()
        parse = cpp_template_kernel.parse_expr_with_index_symbols
        a, b = parse("m_end - m_start"), parse("m_end - m_start")
        assert a is b and a == kt._slot("index_exprs")[1]("m_end - m_start")
        assert all(s.is_integer and s.is_nonnegative for s in a.free_symbols)
        pair, again = parse(["0", "n_size"]), parse(["0", "n_size"])
        assert pair == again and pair is not again and pair[1] is again[1]
        x = sympy.Symbol("x")
        assert parse(x) is x
        assert kt.template_cache_info()["index_exprs"]["hits"] >= 2

        monkeypatch.setenv("DRAFTSMITH_TEMPLATE_CACHE", "0")
        kt.cache_kernel_templates()
        parse = cpp_template_kernel.parse_expr_with_index_symbols
        # (sympy caches expressions too, so the same object may come back: what is in place tells)
        assert parse is kt._slot("index_exprs")[1] and parse("m_end - m_start") == a
        assert kt.template_cache_info() is None
    finally:
        monkeypatch.undo()
        kt.cache_kernel_templates()


def _compiled_code(monkeypatch, setting: str) -> tuple[torch.Tensor, list[str]]:
    """A Linear + GELU compiled as a CPU step compiles (frozen weights through the C++ GEMM template), with
    the memos ``setting``: its output's difference from eager and inductor's generated code."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("DRAFTSMITH_TEMPLATE_CACHE", setting)
    kt.cache_kernel_templates()
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96).eval()
    x = torch.randn(1, 64)
    with torch.inference_mode(), torch._inductor.config.patch({**CPU_COMPILE_TIERS[0], **FROZEN_UNCACHED}):
        fn = torch.compile(lambda t: torch.nn.functional.gelu(lin(t)))
        out, code = run_and_get_code(fn, x)
        # what differs between two compiles of one function anyway: the graph's serial and constants' addresses
        code = [re.sub(r" [0-9a-f]{8,}$", "", re.sub(r"# AOT ID: .*", "", c), flags=re.M) for c in code]
        return out - torch.nn.functional.gelu(lin(x)), code


def test_a_compiled_gemm_is_the_same_code_with_the_cache_and_without(monkeypatch):
    """The C++ GEMM template renders byte-identical code whether its templates come from the cache or
    are parsed per use, and the cached parses were used (hits) by that compile; the output matches eager."""
    try:
        diff_off, code_off = _compiled_code(monkeypatch, "0")
        diff_on, code_on = _compiled_code(monkeypatch, "1")
        hits_before = kt.template_cache_info()
        _compiled_code(monkeypatch, "1")  # a second compile renders from the cache
        hits = kt.template_cache_info()
        assert all(hits[m]["hits"] > hits_before[m]["hits"] for m in ("templates", "index_exprs")), (hits_before, hits)
        assert code_on == code_off and any("micro_gemm" in c for c in code_on)  # the C++ GEMM template's kernel
        assert float(diff_on.abs().max()) < 1e-4 and float(diff_off.abs().max()) < 1e-4
    finally:
        monkeypatch.undo()
        kt.cache_kernel_templates()
        torch._dynamo.reset()
