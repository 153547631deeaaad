"""The request-sized KV cache and the verifier runners: rollback by index, capacity, aux states, paths."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from draftsmith import generate
from draftsmith.decoding.runner import runner_kind, verifier_runner
from draftsmith.errors import DraftsmithError
from draftsmith.models.kv import KVCache
from draftsmith.models.lean import LeanDecoder, fast_rope_matches

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
PATHS = ["lean", "hf-static", "hf-dynamic"]


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _after_rollback(model, path, prompt, draft, n, new, wrong_by=0):
    """Logits of ``new`` after verifying ``draft`` and keeping its first n (+ ``wrong_by``) tokens."""
    with torch.inference_mode():
        r = verifier_runner(model, 64, mode=path)
        r.forward(prompt, 1)
        r.forward(draft, draft.shape[0])
        r.rollback(prompt.shape[0] + n + wrong_by)
        return r.forward(new, new.shape[0])[0]


def _fresh(model, path, prefix, new):
    with torch.inference_mode():
        r = verifier_runner(model, 64, mode=path)
        r.forward(prefix, 1)
        return r.forward(new, new.shape[0])[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", PATHS)
def test_rollback_by_index_equals_fresh_forward(arch, path):
    """Verify 5 drafts, keep 2, go on: the logits equal a fresh forward on the accepted prefix.

    12 prompt tokens + drafts cross the sliding window (8) of mistral and gemma3."""
    model = tiny_model(arch)
    prompt, draft, new = _ids(12), _ids(5, 1), _ids(3, 2)
    got = _after_rollback(model, path, prompt, draft, 2, new)
    want = _fresh(model, path, torch.cat([prompt, draft[:2]]), new)
    # Not bitwise: the kept keys came from a 5-token matmul, the fresh ones from a 14-token one.
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_wrong_rollback_is_detected(path):
    """Negative control: keeping one rejected draft too many changes the logits far beyond tolerance."""
    model = tiny_model("mistral")
    prompt, draft, new = _ids(12), _ids(5, 1), _ids(3, 2)
    got = _after_rollback(model, path, prompt, draft, 2, new, wrong_by=1)
    want = _fresh(model, path, torch.cat([prompt, draft[:2]]), new)
    assert (got - want).abs().max() > 1e-2


def test_capacity_and_rollback_errors_are_clear():
    model = tiny_model("llama")
    for path in ("lean", "hf-static"):
        with torch.inference_mode():
            r = verifier_runner(model, 10, mode=path)
            r.forward(_ids(8), 1)
            with pytest.raises(DraftsmithError, match="KV cache full: 8 cached \\+ 3 new positions > capacity 10"):
                r.forward(_ids(3), 3)
            with pytest.raises(DraftsmithError, match="cannot roll the KV cache back to 9: it holds 8"):
                r.rollback(9)
    cache = KVCache(1, 2, 4, 4, torch.float32, "cpu")
    with pytest.raises(DraftsmithError, match="cannot roll the KV cache back to -1"):
        cache.rollback(-1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", PATHS)
def test_aux_hidden_states_equal_transformers(arch, path):
    """Only the asked layers come back, equal to transformers' ``hidden_states`` (last one: normed)."""
    model = tiny_model(arch)
    ids = _ids(10)
    aux = (0, 1, 2)  # 2 = num_layers: the final normed output
    with torch.inference_mode():
        ref = model(ids[None], output_hidden_states=True)
        r = verifier_runner(model, 16, mode=path)
        logits, hidden = r.forward(ids, 10, aux)
    want = torch.cat([ref.hidden_states[i][0] for i in aux], -1)
    assert hidden.shape == (10, 3 * model.config.hidden_size)
    if path == "lean":  # the same ops in the same order as transformers: bitwise
        assert torch.equal(hidden, want) and torch.equal(logits, ref.logits[0])
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_lean_steps_bitwise_equal_transformers(arch):
    """Prefill, one-token and multi-token steps of the lean forward: bitwise the transformers forward's."""
    from transformers import DynamicCache

    model = tiny_model(arch)
    ids = _ids(30)
    dec = LeanDecoder(model)
    with torch.inference_mode():
        dc, cache = DynamicCache(config=model.config), dec.new_cache(40)
        for a, b in [(0, 12), (12, 13), (13, 17), (17, 18), (18, 19), (19, 25), (25, 26)]:
            ref = model(ids[None, a:b], cache=dc, use_cache=True).logits[0]
            got, _ = dec.forward(ids[a:b], torch.arange(a, b), cache, b - a)
            cache.advance(b - a)
            assert torch.equal(got, ref), (arch, a, b)


def _lean_steps_match_transformers(model, ids, loaded, bitwise: bool = True) -> None:
    """A lean decoder built now steps bitwise as the transformers forward does now (prefill, one
    token, several; within rounding where not ``bitwise``), and both stay within rounding of
    ``loaded``, the logits of another kernel."""
    from transformers import DynamicCache

    dec = LeanDecoder(model)
    with torch.inference_mode():
        dc, cache = DynamicCache(config=model.config), dec.new_cache(24)
        for a, b in [(0, 12), (12, 13), (13, 17), (17, 20)]:
            ref = model(ids[None, a:b], cache=dc, use_cache=True).logits[0]
            got, _ = dec.forward(ids[a:b], torch.arange(a, b), cache, b - a)
            cache.advance(b - a)
            if bitwise:
                assert torch.equal(got, ref), (a, b)
            else:
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
                assert torch.equal(got.argmax(-1), ref.argmax(-1)), (a, b)
            torch.testing.assert_close(got, loaded[a:b], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_in_out_keep_lean_bitwise_transformers_and_are_put_back(arch):
    """--weight-layout in-out: inside the block every Linear weight is stored [in, out] (a tied one
    once), the lean forward built there stays bitwise the transformers forward there, the logits
    stay within rounding of the loaded layout's, and the weights come back bitwise as loaded."""
    from draftsmith.models.verifier import _plain_linear_weights, weights_in_out

    model = tiny_model(arch)
    if arch == "llama":  # tied embeddings, as SmolLM2's: the one weight is re-laid once, read by both
        model.lm_head.weight = model.model.embed_tokens.weight
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = _ids(20)
    with torch.inference_mode():
        loaded = model(ids[None]).logits[0]
    weights = _plain_linear_weights(model)
    with weights_in_out(model) as n:
        assert n == len(weights) > 0
        assert all(w.t().is_contiguous() and not w.is_contiguous() for w in weights)
        _lean_steps_match_transformers(model, ids, loaded)
    for name, p in model.named_parameters():
        assert p.is_contiguous() and torch.equal(p, before[name]), name
    with weights_in_out(model, enabled=False) as n:  # negative control: nothing moves
        assert n == 0 and all(w.is_contiguous() for w in weights)


@pytest.mark.parametrize("layout", ["onednn", "cpp"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_switched_linears_keep_lean_bitwise_transformers_and_are_put_back(arch, layout):
    """--weight-layout onednn / cpp: inside the block every (float32) Linear is the layout's module
    (oneDNN's matmul; draftsmith's few-row kernel for steps, MKL for a prefill), the lean forward built
    there (its projections call the module) stays bitwise the transformers forward there (cpp: with
    its attention on SDPA; through the C++ attention kernel, which cpp also turns on, within rounding),
    the logits stay within rounding of the loaded ones, and the modules come back as loaded."""
    from draftsmith.models import cpu_linear
    from draftsmith.models.verifier import CppLinear, CppNorm, OneDNNLinear, linears_cpp, linears_onednn, weight_layout

    if layout == "cpp" and not cpu_linear.available():
        pytest.skip("no C++ toolchain to build the kernel")
    cls, switch = {"onednn": (OneDNNLinear, linears_onednn), "cpp": (CppLinear, linears_cpp)}[layout]
    model = tiny_model(arch)
    if arch == "llama":
        model.lm_head.weight = model.model.embed_tokens.weight
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = _ids(20)
    with torch.inference_mode():
        loaded = model(ids[None]).logits[0]
    with weight_layout(model, layout) as n:
        # cpp: the norms too, on the kernel for transformers' forward as for the lean one (CppNorm)
        norms = [m for m in model.modules() if isinstance(m, CppNorm)]
        assert len(norms) == (5 if layout == "cpp" else 0)  # 2 layers x 2 + the final norm
        assert n == len(linears) + len(norms) > 0 and all(type(m) is cls for m in linears)
        if layout == "cpp":
            from draftsmith.models.kv import eager_cpu_attention

            # the lean steps' attention through the C++ kernel (transformers' stays SDPA): within rounding
            _lean_steps_match_transformers(model, ids, loaded, bitwise=False)
            with eager_cpu_attention(False):  # the Linears alone: bitwise
                _lean_steps_match_transformers(model, ids, loaded)
        else:
            _lean_steps_match_transformers(model, ids, loaded)
    assert all(type(m) is torch.nn.Linear for m in linears)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    with switch(model, enabled=False) as n:  # negative control: nothing switched
        assert n == 0 and all(type(m) is torch.nn.Linear for m in linears)


def test_weight_layout_refuses_unknown_layouts_and_onednn_off_the_cpu():
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.verifier import weight_layout

    with pytest.raises(DraftsmithError, match="expected one of"):
        with weight_layout(torch.nn.Linear(4, 4), "columns"):
            pass
    with pytest.raises(DraftsmithError, match="CPU kernel"):
        with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta")), "onednn"):
            pass
    with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4)), "onednn") as n:  # the control: on the CPU
        assert n == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_lean_uses_its_one_call_rewrites_where_they_are_the_models(arch):
    """The bitwise test above runs the folded rope on every family, and F.rms_norm for the
    Llama-style norms; Gemma's ``1 + w`` norm differs, so the probe keeps its own forward."""
    import torch.nn.functional as F

    dec = LeanDecoder(tiny_model(arch))
    assert dec.rope_fast
    fused = [getattr(L.in_norm, "func", None) is F.rms_norm for L in dec.layers]
    assert fused == [arch != "gemma3"] * len(dec.layers)


def test_norm_probe_refuses_a_different_norm_negative_control():
    """A norm whose arithmetic is not F.rms_norm's (another eps in its formula, or a centring
    LayerNorm) keeps its own forward; a Llama-style one gets the one call."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from draftsmith.models.lean import norm_fn

    llama = LlamaRMSNorm(16, eps=1e-6)
    assert norm_fn(llama) is not llama.forward

    class OffByEps(LlamaRMSNorm):
        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.variance_epsilon + 1e-3))

    other = OffByEps(16, eps=1e-6)
    assert norm_fn(other) == other.forward
    ln = torch.nn.LayerNorm(16, eps=1e-6)
    assert norm_fn(ln) == ln.forward


def test_folded_rope_refuses_a_different_formula_negative_control():
    """An interleaved-pairs rope (GPT-J style) or a partial rotary dim is not the folded one: the probe says so."""
    def interleaved(q, k, cos, sin):
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rot(q) * s, k * c + rot(k) * s

    def partial(q, k, cos, sin):  # rope on the first half of the head dim only
        def one(x):
            h = x.shape[-1] // 2
            return torch.cat((one_rot(x[..., :h], cos[..., :h], sin[..., :h]), x[..., h:]), -1)

        def one_rot(x, c, s):
            h = x.shape[-1] // 2
            return x * c.unsqueeze(1) + torch.cat((-x[..., h:], x[..., :h]), -1) * s.unsqueeze(1)
        return one(q), one(k)

    def standard(q, k, cos, sin):
        def rot(x):
            h = x.shape[-1] // 2
            return torch.cat((-x[..., h:], x[..., :h]), -1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rot(q) * s, k * c + rot(k) * s

    assert fast_rope_matches(standard, {8}, torch.float32)  # the positive twin of the controls
    assert not fast_rope_matches(interleaved, {8}, torch.float32)
    assert not fast_rope_matches(partial, {8}, torch.float32)
    assert not fast_rope_matches(standard, {8, 16}, torch.float32)  # head dims differ per layer


@pytest.mark.parametrize("arch", ARCHS)
def test_static_mode_equals_eager(arch):
    """The compiled path's attention (all slots, masked by position) equals the prefix one, run eagerly."""
    model = tiny_model(arch)
    dec = LeanDecoder(model)
    ids = _ids(20)
    with torch.inference_mode():
        eager, static = dec.new_cache(32), dec.new_cache(32)
        for c in (eager, static):
            dec.forward(ids[:12], torch.arange(12), c, 1)
            c.advance(12)
        static.static = True
        for a, b in [(12, 13), (13, 17), (17, 18)]:
            want, _ = dec.forward(ids[a:b], torch.arange(a, b), eager, b - a)
            got, _ = dec.forward(ids[a:b], torch.arange(a, b), static, None)
            eager.advance(b - a)
            static.advance(b - a)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nkv", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kernel", [True, False, "folded"], ids=["cpu-kernel", "sdpa", "sdpa-folded"])
def test_static_attention_equals_the_prefix_read(nkv, window, dtype, kernel, monkeypatch):
    """The static path (as a compiled step attends: the CPU kernel over the slots up to each query, or
    SDPA over all slots under the position mask, with the grouped query heads folded as on CUDA) gives
    the eager prefix read's attention, for one and several queries, MHA to MQA, with and without a window."""
    from draftsmith.models import kv

    fold, kernel = kernel == "folded", kernel is True
    eager_attend = KVCache.attend

    def attend_unfolded(self, *a):  # the reference: the CPU's unfolded calls, whatever the case folds
        monkeypatch.setattr(kv, "FOLD_GQA", False)
        try:
            return eager_attend(self, *a)
        finally:
            monkeypatch.setattr(kv, "FOLD_GQA", fold)

    monkeypatch.setattr(kv, "FOLD_GQA", fold)
    g = torch.Generator().manual_seed(nkv)
    nh, hd, S = 4, 8, 24
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    eager = KVCache(1, nkv, hd, S, dtype, "cpu", [window])
    static = KVCache(1, nkv, hd, S, dtype, "cpu", [window])
    static.cpu_kernel = kernel
    assert static.cpu_kernel == kernel  # the kernel builds here

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k0, v0 = randn(1, nkv, 10, hd), randn(1, nkv, 10, hd)
    for c in (eager, static):
        c.attend(0, randn(1, nh, 10, hd), k0, v0, torch.arange(10), 0.3)
        c.advance(10)
    static.static = True
    for m in (1, 3):
        T = eager.length
        q = randn(1, nh, m, hd)
        k, v = randn(1, nkv, m, hd), randn(1, nkv, m, hd)
        want = attend_unfolded(eager, 0, q, k, v, torch.arange(T, T + m), 0.3)
        got = static.attend(0, q, k, v, torch.arange(T, T + m), 0.3)
        eager.advance(m)
        static.advance(m)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        if nkv < nh and m > 1:
            # negative control: the same queries in another order attend with the wrong positions' masks
            rep = nh // nkv
            wrong = q.view(1, nkv, rep, m, hd).transpose(2, 3).reshape(1, nh, m, hd)
            static.rollback(T)
            bad = static.attend(0, wrong, k, v, torch.arange(T, T + m), 0.3)
            static.advance(m)
            assert not torch.allclose(bad.view(1, nkv, m, rep, hd).transpose(2, 3).reshape(1, nh, m, hd), want,
                                      atol=10 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4])
def test_folded_grouped_query_attention_equals_sdpas_own(m, dtype):
    """Off the CPU a masked grouped-query call folds each KV head's query heads into one sequence under
    the mask tiled (CUDA's fused kernels take a mask or grouped heads, not both): it equals SDPA's
    ``enable_gqa``. Negative control: the mask tiled in the other order (each row repeated) differs."""
    from draftsmith.models.kv import gqa_attention

    g = torch.Generator().manual_seed(m)
    nh, nkv, hd, S = 6, 2, 8, 16
    q = torch.randn(1, nh, m, hd, generator=g).to(dtype)
    K, V = (torch.randn(1, nkv, S, hd, generator=g).to(dtype) for _ in range(2))
    pos = torch.arange(S - m, S) - 3  # the queries' positions; slots past them are stale
    keep = torch.arange(S)[None, :] <= pos[:, None]
    keep &= torch.arange(S)[None, :] > pos[:, None] - 6  # a window, so every row's mask differs
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    from draftsmith.models import kv

    for mask in (keep, kv.additive_mask(keep, dtype)):
        want = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=0.3, enable_gqa=True)
        kv.FOLD_GQA = True
        try:
            got = gqa_attention(q, K, V, mask, 0.3)
        finally:
            kv.FOLD_GQA = None
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert torch.equal(gqa_attention(q, K, V, mask, 0.3), want)  # the CPU's own call, unfolded
        if m > 1:
            rep = nh // nkv
            bad = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(1, nkv, rep * m, hd), K, V, attn_mask=mask.repeat_interleave(rep, 0), scale=0.3)
            assert not torch.allclose(bad.reshape(1, nh, m, hd), want, atol=10 * tol)


def test_greedy_decoding_with_folded_grouped_queries_equals_generate(monkeypatch):
    """The whole engine with the fold (verify rows of several tokens under a mask, as on CUDA): the
    same tokens as ``generate`` on a grouped-query model, with an n-gram drafter's multi-token rounds."""
    from draftsmith.decoding.proposers import NgramProposer
    from draftsmith.models import kv

    model = tiny_model("llama")
    prompt = torch.tensor([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], dtype=torch.long)
    with torch.inference_mode():
        want = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, prompt.shape[0]:].tolist()
    calls = []
    folded = kv.gqa_attention

    def counting(q, K, V, mask, *a, **kw):
        if mask is not None:
            calls.append(q.shape[2])
        return folded(q, K, V, mask, *a, **kw)

    monkeypatch.setattr(kv, "FOLD_GQA", True)
    monkeypatch.setattr(kv, "gqa_attention", counting)
    out = generate(model, prompt, max_new_tokens=24, proposer=NgramProposer(), num_draft_tokens=3)
    assert out.token_ids == want
    assert max(calls) > 1 and out.stats["draft_tokens"] > 0  # masked multi-token verify rows were folded


def test_auto_path_per_model():
    """Supported models take the lean path; others run transformers' forward on the static cache."""
    for arch in ARCHS:
        assert runner_kind(tiny_model(arch)) == ("lean", None)
    from conftest import _config
    from transformers import AutoModelForCausalLM

    cfg = _config("llama")
    cfg._attn_implementation = "eager"
    eager = AutoModelForCausalLM.from_config(cfg)
    kind, why = runner_kind(eager)
    assert kind == "hf-static" and "attention implementation 'eager'" in why
    out = generate(eager.eval(), [5, 6, 7], max_new_tokens=3, eos_token_id=[])
    assert out.stats["engine"] == "hf-static"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", ["hf-static", "hf-dynamic"])
def test_greedy_equivalence_fallback_paths(arch, path):
    """The transformers-forward paths decode like HF generate too, with a partially right drafter."""
    from conftest import perturbed_copy
    from test_engine import _hf_greedy, _prompt

    from draftsmith.decoding import DraftModelProposer

    verifier = tiny_model(arch)
    prompt = _prompt(0)
    want = _hf_greedy(verifier, prompt, 30)
    partial = DraftModelProposer(perturbed_copy(verifier, noise=0.02))
    for proposer in (None, partial):
        out = generate(verifier, prompt, proposer=proposer, max_new_tokens=30, num_draft_tokens=3, eos_token_id=[],
                       engine=path)
        assert out.token_ids == want and out.stats["engine"] == path


def test_models_do_not_import_decoding():
    """Imports point down: nothing under models/ imports decoding when it loads."""
    root = Path(__file__).resolve().parents[1] / "src" / "draftsmith" / "models"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.startswith("draftsmith.decoding")], path.name


@pytest.mark.slow
def test_compiled_steps_equal_eager_and_are_reused(monkeypatch):
    """--compile: the same tokens as eager (plain and EAGLE-3 drafted), compiled once, reused on the next
    prompt; under the C++ host-code wrapper (runner.CPU_WRAPPER), the engine's default on the CPU. Under
    the Python wrapper, the suite's default (conftest), other compiled tests keep most of this: tokens
    equal to eager (test_device.py's EAGLE-3 rounds, test_bench.py's compiled rows), an EAGLE-3 request
    that compiles nothing after the first (test_device.py); plain decoding's reuse across prompts and the
    engine-level guard counts below are checked under the C++ wrapper only. Both wrappers here took
    2.5 min on an AVX2-only EPYC (BENCHMARKS.md 15r)."""
    from test_eagle3 import _draft

    from draftsmith.decoding import Eagle3Proposer

    monkeypatch.setenv("DRAFTSMITH_COMPILE_WRAPPER", "cpp")
    verifier = tiny_model("llama", layers=3, seed=1)  # graphs of its own
    prompts = [_ids(10, 3).tolist(), _ids(14, 4).tolist()]
    d = _draft(verifier, vd=64)
    d.config.aux_layer_ids = [0, 1, 3]
    proposer = Eagle3Proposer(d)
    for drafter in (None, proposer):
        for i, prompt in enumerate(prompts):
            eager = generate(verifier, prompt, proposer=drafter, max_new_tokens=24, num_draft_tokens=3,
                             eos_token_id=[])
            compiled = generate(verifier, prompt, proposer=drafter, max_new_tokens=24, num_draft_tokens=3,
                                eos_token_id=[], compile=True)
            assert compiled.token_ids == eager.token_ids
            assert compiled.stats["engine"] == "lean+compiled"
            assert (compiled.stats["compile_seconds"] > 0) == (i == 0)  # the second prompt reuses the graphs
    from draftsmith.decoding import runner as runner_mod

    # the compiled verifier steps attended through the CPU kernel (models/cpu_attention), not SDPA
    assert all(c.cpu_kernel for c in runner_mod._COMPILED[verifier].caches.values())
    # and the later calls of a seen signature skipped the full guard check: the verifier's one-token
    # and verify steps, and the draft's steps
    assert len(runner_mod._COMPILED[verifier].fn.trusted) >= 2
    assert len(proposer._compiled.trusted) >= 2
    # ... and none of them needed a graph its distinguishing guards could not find (the signature
    # tells apart every call dynamo's guards do here: views by their offsets among them)
    assert not runner_mod._COMPILED[verifier].fn.distrusted and not proposer._compiled.distrusted
    # and they compiled under the C++ wrapper
    for fn in (runner_mod._COMPILED[verifier].fn, proposer._compiled):
        assert fn.options.get("cpp_wrapper", False) is True


_FACTOR = 2.0


def _times_factor(x: torch.Tensor) -> torch.Tensor:
    return x * _FACTOR  # a global a guard watches: changing it recompiles, unless guards are skipped


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "full"])
def test_compiled_calls_skip_guards_only_on_a_signature_that_passed_them(monkeypatch, mode):
    """CompiledFn checks dynamo's guards in full on the first call of each signature (shapes, dtypes,
    strides, caches, autograd mode) and skips all but the distinguishing ones on its repeats
    (DRAFTSMITH_COMPILE_GUARDS=auto on the CPU); =full checks every call. The control: a global the
    graph reads changes between calls of one signature - under skipping the stale graph runs (so
    the skip is real, and why a compiled step is rebuilt when its weights or layout change), under
    full checks it recompiles."""
    from draftsmith.decoding.runner import CompiledFn, call_signature

    monkeypatch.setenv("DRAFTSMITH_COMPILE_GUARDS", mode)
    monkeypatch.setattr(__import__(__name__), "_FACTOR", 2.0)
    fn = CompiledFn(_times_factor, torch.device("cpu"))
    assert fn.skip_guards == (mode == "auto")
    a, b = torch.arange(3.0), torch.arange(5.0)
    with torch.inference_mode():
        assert torch.equal(fn(a), a * 2) and torch.equal(fn(b), b * 2)  # two signatures, each checked in full
        assert torch.equal(fn(b), b * 2) and torch.equal(fn(a), a * 2)  # repeats pick their own graphs
        c = torch.arange(7.0)  # a new shape while the others are trusted: checked in full, correct
        assert torch.equal(fn(c), c * 2)
        monkeypatch.setattr(__import__(__name__), "_FACTOR", 3.0)
        stale = torch.equal(fn(a), a * 2)
        assert stale == (mode == "auto")
        assert torch.equal(fn(torch.arange(4.0)), torch.arange(4.0) * 3)  # unseen: full check, recompiled
    assert len(fn.trusted) == (3 if mode == "auto" else 0) + (1 if mode == "auto" else 0)
    # the signature tells shapes, strides, dtypes and the autograd mode apart
    x = torch.zeros(2, 3)
    sigs = {call_signature((x,)), call_signature((x.t(),)), call_signature((x.double(),)),
            call_signature((x, (1, 2))), call_signature((x, (1, 3)))}
    with torch.no_grad():
        sigs.add(call_signature((x,)))
    assert len(sigs) == 6
    # lists of tensors element by element (a list argument once made the signature unhashable);
    # a value it cannot key by gives None: every guard is checked for that call
    ls = call_signature(([x, x],))
    assert hash(ls) is not None and ls == call_signature(([x, x.clone()],)) != call_signature(([x, x.t()],))
    assert call_signature((x, object())) is None and call_signature((x, {"a": 1})) is None
    fn2 = CompiledFn(lambda xs, n: xs[0] * n, torch.device("cpu"))
    with torch.inference_mode():
        assert torch.equal(fn2([a, b], 2), a * 2) and torch.equal(fn2([a, b], 2), a * 2)
    assert len(fn2.trusted) == (1 if mode == "auto" else 0)
    # an inference tensor and a plain one of one shape: dynamo guards their dispatch keys apart, so the
    # signature must too, or the second one's signature is distrusted and checked in full for good
    # (it once was: 1.2 ms of guards on every 14 ms step of a benchmark that made its ids outside
    # inference mode)
    plain = torch.arange(6.0)
    with torch.inference_mode():
        inf = torch.arange(6.0)
        assert call_signature((plain,)) != call_signature((inf,))
        fn3 = CompiledFn(lambda t: t + 1, torch.device("cpu"))
        for t in (inf, plain, inf, plain):
            assert torch.equal(fn3(t), t + 1)
    assert not fn3.distrusted and len(fn3.trusted) == (2 if mode == "auto" else 0)


@pytest.mark.slow
def test_a_trusted_signature_that_needs_another_graph_falls_back_to_full_guards(monkeypatch):
    """If a signature ever missed what tells two graphs apart, the skipped check finds no graph (dynamo
    refuses to recompile under skipping): the call reruns with every guard checked, and the signature
    is never trusted again. Here every call is given one signature, and shapes change under it."""
    from draftsmith.decoding import runner

    monkeypatch.setenv("DRAFTSMITH_COMPILE_GUARDS", "auto")
    monkeypatch.setattr(runner, "call_signature", lambda args: ("one",))
    fn = runner.CompiledFn(lambda x: x * 2, torch.device("cpu"))
    with torch.inference_mode():
        for n in (3, 5, 3, 7, 7):
            x = torch.arange(float(n))
            assert torch.equal(fn(x), x * 2)
    assert fn.distrusted == {("one",)} and not fn.trusted


@pytest.mark.slow
def test_a_trusted_call_runs_without_inductor_options_patched_in(monkeypatch):
    """Inductor's options matter only while compiling: a call that may compile (a signature's first, or
    any under DRAFTSMITH_COMPILE_GUARDS=full, the control) runs under them; a trusted one, under which
    nothing can compile, skips the patch (~39 us a call, BENCHMARKS 15d) and still runs its own graph."""
    from draftsmith.decoding import runner

    patches = []  # CompiledFn._run: the call under inductor's options
    real = runner.CompiledFn._run
    monkeypatch.setattr(runner.CompiledFn, "_run", lambda self, args: patches.append(args) or real(self, args))
    for mode, per_call in (("auto", [1, 0, 0, 1, 0]), ("full", [1, 1, 1, 1, 1])):
        monkeypatch.setenv("DRAFTSMITH_COMPILE_GUARDS", mode)
        fn = runner.CompiledFn(lambda x: x * 3, torch.device("cpu"))
        assert fn.options.get("freezing")  # a CPU tier with options to patch in
        seen = []
        with torch.inference_mode():
            for n in (3, 3, 3, 5, 5):
                x = torch.arange(float(n))
                before = len(patches)
                assert torch.equal(fn(x), x * 3)
                seen.append(min(len(patches) - before, 1))
        assert seen == per_call, (mode, seen)


@pytest.mark.slow
@pytest.mark.parametrize("share", ["1", "0"])
def test_steps_without_aux_run_the_shared_aux_graphs(monkeypatch, share):
    """Under shared_aux_outputs (a compiled bench of EAGLE-3 drafts), a plain decode and a step table's
    runner compile nothing of their own: they run the graphs that return the drafts' aux hidden states
    and drop them, with the plain decode's tokens unchanged. DRAFTSMITH_SHARE_AUX=0 (the negative
    control) compiles the graphs without aux outputs, as before."""
    from draftsmith.decoding import runner as runner_mod

    monkeypatch.setenv("DRAFTSMITH_SHARE_AUX", share)
    model = tiny_model("llama", layers=3)
    aux = (0, 2)
    prompt = _ids(10, 5).tolist()
    eager = generate(model, prompt, max_new_tokens=12, eos_token_id=[])
    runner_mod._COMPILED.pop(model, None)  # a step of its own (a tiny model may be shared with other tests)
    try:
        with runner_mod.shared_aux_outputs(model, aux), torch.inference_mode():
            drafts = verifier_runner(model, 64, compile=True, aux_layer_ids=aux, warmup_shapes=(1, 3))
            assert drafts.compile_seconds > 0
            step = runner_mod._COMPILED[model]
            assert {key[2] for key in step.warm} == {aux}
            plain = generate(model, prompt, max_new_tokens=12, eos_token_id=[], compile=True)
            table = verifier_runner(model, 64, compile=True, warmup_shapes=(1, 3))
            logits, hidden = table.forward(torch.tensor(prompt), 1)
            logits, hidden = table.forward(_ids(3, 6), 3)
        assert plain.token_ids == eager.token_ids
        assert hidden is None and logits.shape[0] == 3  # the shared graph's aux states are not handed out
        if share == "1":
            assert plain.stats["compile_seconds"] == 0 and table.compile_seconds == 0
            assert {key[2] for key in step.warm} == {aux}
            assert table.verify_tiers == drafts.verify_tiers
        else:
            assert plain.stats["compile_seconds"] > 0 and table.compile_seconds > 0
            assert {key[2] for key in step.warm} == {aux, ()}
        assert model not in runner_mod._SHARED_AUX  # the block is left as it was found
    finally:
        runner_mod._COMPILED.pop(model, None)


class _Slowed:
    """A compiled step made slower by ``seconds`` per call (a candidate the choice must not pick)."""

    def __init__(self, fn, seconds):
        self.fn, self.seconds, self.calls = fn, seconds, 0

    def __call__(self, *args):
        import time

        self.calls += 1
        time.sleep(self.seconds)
        return self.fn(*args)


@pytest.mark.parametrize("slow", ["aten", "template"])
def test_compiled_verify_runs_the_candidate_timed_faster_per_length(monkeypatch, slow):
    """On the CPU each verify length first seen times the candidates (the C++ template, ATen) on the
    call itself and runs the faster; the time is compile time. A candidate slowed by 200 ms is never
    chosen, and the cache then holds what the chosen one wrote: the next tokens' logits are bitwise
    those of a step compiled with only the chosen candidate (DRAFTSMITH_VERIFY_TIER)."""
    from draftsmith.decoding import runner as runner_mod

    monkeypatch.setenv("DRAFTSMITH_VERIFY_TIER", "auto")
    model = tiny_model("llama", layers=2)
    prompt, draft, nxt = _ids(9, 1), _ids(3, 2), _ids(1, 3)
    fast = "template" if slow == "aten" else "aten"
    runner_mod._COMPILED.pop(model, None)  # a step of its own (a tiny model may be shared with other tests)
    with torch.inference_mode():
        r = verifier_runner(model, 64, compile=True, warmup_shapes=(1,))
        step = runner_mod._COMPILED[model]
        assert list(step.verify) == ["template", "aten"] and step.verify["template"] is step.fn
        step.verify[slow] = _Slowed(step.verify[slow], 0.2)
        before = r.compile_seconds
        r.forward(prompt, 1)
        r.forward(nxt, 1)  # a one-token step: no choice
        assert r.verify_tiers == {}
        r.forward(draft, 3)
        tiers = r.verify_tiers
        assert set(tiers) == {"3"} and tiers["3"]["tier"] == fast
        assert tiers["3"]["ms"][slow] > tiers["3"]["ms"][fast]
        assert r.compile_seconds - before >= 0.2 * runner_mod.VERIFY_PROBE_PASSES  # the probe is compile time
        calls = step.verify[slow].calls
        r.forward(_ids(3, 4), 3)  # the length is chosen: only the faster one runs
        assert step.verify[slow].calls == calls
        got = r.forward(nxt, 1)[0]
        # the reference: only the chosen candidate verifies
        monkeypatch.setenv("DRAFTSMITH_VERIFY_TIER", fast)
        runner_mod._COMPILED.pop(model)
        ref = verifier_runner(model, 64, compile=True, warmup_shapes=(1,))
        assert list(runner_mod._COMPILED[model].verify) == [fast]
        ref.forward(prompt, 1)
        ref.forward(nxt, 1)
        ref.forward(draft, 3)
        ref.forward(_ids(3, 4), 3)
        assert torch.equal(got, ref.forward(nxt, 1)[0])
        assert ref.verify_tiers == {}  # one candidate: nothing to time
        eager = verifier_runner(model, 64)
        eager.forward(prompt, 1)
        eager.forward(nxt, 1)
        eager.forward(draft, 3)
        eager.forward(_ids(3, 4), 3)
        torch.testing.assert_close(got, eager.forward(nxt, 1)[0], rtol=1e-4, atol=1e-4)
    runner_mod._COMPILED.pop(model)


def test_verify_pick_and_its_setting(monkeypatch):
    """pick_verify: the first candidate unless another is more than the tie faster; the setting is checked."""
    from draftsmith.decoding.runner import VERIFY_TIE, pick_verify, verify_candidates

    assert pick_verify({"template": 30.0, "aten": 26.0}) == "aten"
    assert pick_verify({"template": 30.0, "aten": 30.0 * (1 - VERIFY_TIE / 2)}) == "template"  # within the tie
    assert pick_verify({"template": 25.0, "aten": 30.0}) == "template"
    monkeypatch.setenv("DRAFTSMITH_VERIFY_TIER", "auto")
    assert list(verify_candidates(False)) == ["template", "aten"] and list(verify_candidates(True)) == ["template"]
    monkeypatch.setenv("DRAFTSMITH_VERIFY_TIER", "template")
    assert verify_candidates(False) == {"template": None}
    monkeypatch.setenv("DRAFTSMITH_VERIFY_TIER", "mkl")
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_VERIFY_TIER"):
        verify_candidates(False)


def test_compile_wrapper_setting_and_tiers(monkeypatch):
    """The C++ wrapper goes before the first tier as it is; ``python`` keeps the tiers; ``auto`` (the
    default) takes it on a CPU with AMX tiles only; the setting is checked."""
    from draftsmith.decoding.runner import CPU_WRAPPER, compile_wrapper, wrapped_tiers

    a, b = {"freezing": True}, {}
    monkeypatch.delenv("DRAFTSMITH_COMPILE_WRAPPER", raising=False)  # auto (the tests run under python: conftest)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert compile_wrapper() == "cpp"
    assert wrapped_tiers((a, b)) == ({"freezing": True, **CPU_WRAPPER}, a, b) and a == {"freezing": True}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN's limit does not change the host code's answer
    assert compile_wrapper() == "cpp"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert compile_wrapper() == "python" and wrapped_tiers((a, b)) == (a, b)
    monkeypatch.setenv("DRAFTSMITH_COMPILE_WRAPPER", " CPP ")
    assert compile_wrapper() == "cpp" and wrapped_tiers((a, b))[0] == {"freezing": True, **CPU_WRAPPER}
    monkeypatch.setenv("DRAFTSMITH_COMPILE_WRAPPER", "python")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert wrapped_tiers((a, b)) == (a, b)
    monkeypatch.setenv("DRAFTSMITH_COMPILE_WRAPPER", "rust")
    with pytest.raises(DraftsmithError, match="expected one of auto, cpp, python"):
        wrapped_tiers((a, b))


@pytest.mark.slow
def test_a_cpp_wrapper_that_does_not_build_gives_way_to_the_tier_without_it(monkeypatch, caplog):
    """CompiledFn under the C++ wrapper: compiled, it computes what the function does, with the wrapper
    in its options; a wrapper that cannot build (here: a compiler that does not exist, for the wrapper's
    tier only) gives way to the same tier without it; the control: under ``python`` no wrapper is tried."""
    from draftsmith.decoding import runner

    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(3, 16)
    monkeypatch.setenv("DRAFTSMITH_COMPILE_WRAPPER", "cpp")
    monkeypatch.setattr(runner, "CPU_COMPILE_TIERS", ({"freezing": True},))
    with torch.no_grad():
        c = runner.CompiledFn(lambda t: lin(t).relu(), torch.device("cpu"))
        assert torch.allclose(c(x), lin(x).relu(), atol=1e-6)
        assert c.tier == 0 and c.options.get("cpp_wrapper") is True
        monkeypatch.setattr(runner, "CPU_WRAPPER", {"cpp_wrapper": True, "cpp.cxx": ("/nonexistent/g++",)})
        c = runner.CompiledFn(lambda t: lin(t).tanh(), torch.device("cpu"))
        assert torch.allclose(c(x), lin(x).tanh(), atol=1e-6)
        assert c.tier == 1 and "cpp_wrapper" not in c.options and "trying" in caplog.text
        monkeypatch.setenv("DRAFTSMITH_COMPILE_WRAPPER", "python")
        c = runner.CompiledFn(lambda t: lin(t).sigmoid(), torch.device("cpu"))
        assert torch.allclose(c(x), lin(x).sigmoid(), atol=1e-6)
        assert c.tier == 0 and "cpp_wrapper" not in c.options


def test_compile_guards_setting_is_checked(monkeypatch):
    from draftsmith.decoding.runner import guard_skipping

    monkeypatch.setenv("DRAFTSMITH_COMPILE_GUARDS", "sometimes")
    with pytest.raises(DraftsmithError, match="auto, full or skip"):
        guard_skipping(False)
    monkeypatch.setenv("DRAFTSMITH_COMPILE_GUARDS", "auto")
    assert guard_skipping(False) and not guard_skipping(True)
    monkeypatch.setenv("DRAFTSMITH_COMPILE_GUARDS", "skip")
    assert guard_skipping(True)


@pytest.mark.slow
def test_compiled_steps_follow_the_weight_layout():
    """--compile inside --weight-layout onednn: compiled tokens equal eager ones there; a step compiled
    as loaded (its projections bound to MKL's mm) is rebuilt inside the block and again after it,
    and reused while the layout stays (the control)."""
    from draftsmith.decoding.runner import _COMPILED, projections_held
    from draftsmith.models.verifier import OneDNNLinear, weight_layout

    verifier = tiny_model("llama", layers=2)
    prompt = _ids(10, 3).tolist()
    run = lambda **kw: generate(verifier, prompt, max_new_tokens=16, eos_token_id=[], **kw)  # noqa: E731
    run(compile=True)
    loaded = _COMPILED[verifier]
    with weight_layout(verifier, "onednn"):
        eager, compiled = run(), run(compile=True)
        assert compiled.token_ids == eager.token_ids and compiled.stats["engine"] == "lean+compiled"
        inside = _COMPILED[verifier]
        assert inside is not loaded and inside.held[0] == projections_held(verifier)
        assert inside.decoder.layers[0].q.__func__ is OneDNNLinear.forward
        run(compile=True)
        assert _COMPILED[verifier] is inside  # same layout: the graphs are reused
    run(compile=True)
    assert _COMPILED[verifier] is not inside and _COMPILED[verifier].held == loaded.held


@pytest.mark.slow
def test_compiled_cpu_steps_are_rebuilt_when_the_weights_change():
    """On CPU a compiled step's graphs hold the weights as constants (CPU_COMPILE_TIERS' freezing;
    a GEMM kernel may have packed its own copy): once the weights are written in place, the step is
    rebuilt and its tokens equal eager ones again. The control: nothing written, the step is kept."""
    from draftsmith.decoding.runner import _COMPILED

    verifier = tiny_model("llama", layers=2)
    prompt = _ids(10, 3).tolist()
    run = lambda **kw: generate(verifier, prompt, max_new_tokens=16, eos_token_id=[], **kw)  # noqa: E731
    with torch.inference_mode():
        before = run(compile=True)
        old = _COMPILED[verifier]
        assert run(compile=True).token_ids == before.token_ids and _COMPILED[verifier] is old
        with torch.no_grad():
            verifier.lm_head.weight.mul_(-1.0)  # argmax becomes argmin: other tokens
        eager, compiled = run(), run(compile=True)
        assert eager.token_ids != before.token_ids
        assert compiled.token_ids == eager.token_ids and _COMPILED[verifier] is not old


def _draft_logits(prop, fn) -> torch.Tensor:
    """Draft logits of one step at slot 0 of a fresh static cache the size of ``prop``'s, through ``fn``
    (a compiled step, or the eager one: ``prop._static_step``)."""
    cache = prop.draft.new_cache(prop.cache.capacity)
    cache.static = True
    H = prop.draft.config.hidden_size
    g = torch.Generator().manual_seed(0)
    return fn(torch.tensor([[7]]), torch.randn(1, 1, H, generator=g), torch.tensor([[1]]), torch.arange(1), cache)[0]


@pytest.mark.slow
def test_compiled_draft_is_rebuilt_when_its_weights_change():
    """A compiled EAGLE-3 draft step freezes the draft's weights too: a draft written in place since
    (trained further) is compiled again, and its logits follow the new weights; the control: with
    nothing written, the compiled step is kept."""
    from test_eagle3 import _draft

    from draftsmith.decoding import Eagle3Proposer

    verifier = tiny_model("llama", layers=3)
    d = _draft(verifier, vd=64)
    d.config.aux_layer_ids = [0, 1, 3]
    prop = Eagle3Proposer(d)
    prompt = _ids(10, 3).tolist()
    run = lambda **kw: generate(verifier, prompt, proposer=prop, max_new_tokens=24, num_draft_tokens=3,  # noqa: E731
                                eos_token_id=[], **kw)
    with torch.inference_mode():
        run(compile=True)
        first = prop._compiled
        run(compile=True)
        assert prop._compiled is first  # nothing written, nothing recompiled
        with torch.no_grad():
            for p in d.parameters():
                p.add_(0.5 * torch.randn_like(p))
        eager, compiled = run(), run(compile=True)
        assert prop._compiled is not first and compiled.token_ids == eager.token_ids
        fresh = _draft_logits(prop, prop._static_step)
        assert torch.allclose(_draft_logits(prop, prop._compiled), fresh, atol=1e-4)


@pytest.mark.slow
def test_a_compiled_draft_step_that_disagrees_with_the_eager_one_is_not_used(monkeypatch, caplog):
    """After compiling, the draft step is checked against the eager one on one input: a wrong graph
    (here: the compiled function's logits scaled by -3, what a stale frozen graph looks like to the
    check) is dropped with a warning, the draft runs eagerly, output is plain decoding's, and the
    next prompt does not compile it again. The control: a correct compile passes the check and is kept."""
    from test_eagle3 import _draft

    from draftsmith.decoding import Eagle3Proposer, proposers

    verifier = tiny_model("llama", layers=3)
    d = _draft(verifier, vd=64)
    d.config.aux_layer_ids = [0, 1, 3]
    prompt = _ids(10, 3).tolist()
    with torch.inference_mode():
        plain = generate(verifier, prompt, max_new_tokens=16, eos_token_id=[]).token_ids
        good = Eagle3Proposer(d)
        out = generate(verifier, prompt, proposer=good, max_new_tokens=16, num_draft_tokens=2, eos_token_id=[],
                       compile=True)
        assert out.token_ids == plain and good._compiled is not None
        assert good.compile_error is not None and good.compile_error < 1e-3

        real = proposers.CompiledFn

        class Wrong(real):
            def __call__(self, *args):
                logits, h = super().__call__(*args)
                return -3 * logits, h

        monkeypatch.setattr(proposers, "CompiledFn", Wrong)
        bad = Eagle3Proposer(d)
        out = generate(verifier, prompt, proposer=bad, max_new_tokens=16, num_draft_tokens=2, eos_token_id=[],
                       compile=True)
        assert out.token_ids == plain and out.stats["drafts"] > 0
        assert bad._compiled is None and bad.compile_error > proposers.COMPILED_DRAFT_TOLERANCE
        assert "runs eagerly" in caplog.text
        built = []
        monkeypatch.setattr(proposers, "CompiledFn", lambda *a, **k: built.append(1) or Wrong(*a, **k))
        generate(verifier, prompt, proposer=bad, max_new_tokens=8, num_draft_tokens=2, eos_token_id=[], compile=True)
        assert not built and bad._compiled is None  # refused for these weights: not compiled again


def test_a_cpu_compile_tier_that_fails_gives_way_to_the_next(monkeypatch, caplog):
    """CompiledFn: a tier whose compile fails (here: no C++ compiler) is logged and the next one
    compiles; the control: with only the failing tier, the failure is raised."""
    from draftsmith.decoding import runner

    lin = torch.nn.Linear(8, 8, bias=False)
    fn = lambda x: lin(x).relu()  # noqa: E731
    broken = {"cpp.cxx": ("/nonexistent/g++",)}
    x = torch.randn(2, 8)
    monkeypatch.setattr(runner, "CPU_COMPILE_TIERS", (broken, {}))
    c = runner.CompiledFn(fn, torch.device("cpu"))
    with torch.no_grad():
        assert torch.allclose(c(x), fn(x))
    assert c.tiers[c.tier] == {} and c.tier == len(c.tiers) - 1 and "trying" in caplog.text
    monkeypatch.setattr(runner, "CPU_COMPILE_TIERS", (broken,))
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        runner.CompiledFn(lambda x: lin(x).sigmoid(), torch.device("cpu"))(x)


def _int8_pair(seed):
    from draftsmith.models.quantize import Int8WeightLinear

    torch.manual_seed(seed)
    a, b = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False)
    return torch.nn.Sequential(Int8WeightLinear(a), torch.nn.ReLU(), Int8WeightLinear(b)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("cache_frozen,wrapper", [(False, "python"), (True, "python"), (False, "cpp")])
def test_frozen_compiles_never_reuse_another_models_cached_weights(monkeypatch, tmp_path, cache_frozen, wrapper):
    """Two int8 modules of one shape, different weights, each compiled under the frozen C++ tier.
    Inductor's FX graph cache keys a frozen graph by its weights' shapes only, and the int8
    template's weights packed at compile time are stored in the cache entry: the second module
    would multiply the first one's weights (an int8 draft accepting nothing; PyTorch 2.13).
    CompiledFn compiles frozen tiers without that cache, under either host-code wrapper. The
    control (cache_frozen: the cache left on) shows the test sees the stale weights."""
    from draftsmith.decoding import runner

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("DRAFTSMITH_COMPILE_WRAPPER", wrapper)
    monkeypatch.setattr(runner, "CPU_COMPILE_TIERS", (runner.CPU_COMPILE_TIERS[0],))
    if cache_frozen:
        monkeypatch.setattr(runner, "FROZEN_UNCACHED", {})
    x = torch.randn(3, 64)
    errors = []
    with torch.inference_mode():
        for seed in (0, 1):
            m = _int8_pair(seed)
            got = runner.CompiledFn(lambda t: m(t), torch.device("cpu"))(x)
            errors.append(float((got - m(x)).abs().max() / m(x).abs().max()))
    assert errors[0] < 0.02
    assert (errors[1] > 0.2) if cache_frozen else (errors[1] < 0.02), errors


# --- batched generation (regeneration's engine) -------------------------------------------------

def _prompts(lengths=(5, 17, 9, 30, 12, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in lengths]


class _Bar:
    def __init__(self):
        self.n = 0

    def update(self, n):
        self.n += n


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lean_batch_generation_equals_transformers_generate(arch, temperature, monkeypatch):
    """Left-padded batches through the lean forward: transformers generate's replies, finished rows dropped."""
    from draftsmith.data.generation import generate_batch
    from draftsmith.decoding.sampling import SamplingParams
    from draftsmith.models import kv

    model, prompts = tiny_model(arch), _prompts()
    params = SamplingParams(temperature=temperature, top_p=0.9 if temperature else None)
    seeds = list(range(len(prompts)))
    sizes = []
    real_keep = kv.BatchKVCache.keep
    monkeypatch.setattr(kv.BatchKVCache, "keep", lambda self, rows: (sizes.append(len(rows)), real_keep(self, rows)))
    bar = _Bar()
    lean = generate_batch(model, prompts, seeds, params, 40, [1], 1, bar=bar, engine="lean")
    hf = generate_batch(model, prompts, seeds, params, 40, [1], 1, engine="hf")
    assert lean == hf
    reasons = {r for _, r in lean}
    assert reasons == {"stop", "length"}  # both ways a reply ends are exercised
    assert sizes and sizes[-1] < len(prompts)  # the rows that stopped left the batch
    assert bar.n == len(prompts) * 40  # the bar ends at its total: max_new_tokens slots per reply


def test_lean_batch_rows_do_not_see_padding():
    """A row's reply is the one it gets alone; a negative control that attends to padding differs."""
    from draftsmith.data.generation import generate_batch
    from draftsmith.decoding.sampling import SamplingParams

    model, prompts = tiny_model("llama"), _prompts()
    greedy = SamplingParams(temperature=0.0)
    batch = generate_batch(model, prompts, [0] * len(prompts), greedy, 24, [1], 1, engine="lean")
    alone = [generate_batch(model, [p], [0], greedy, 24, [1], 1, engine="lean")[0] for p in prompts]
    assert batch == alone
    width = max(map(len, prompts))
    # Padding tokens given as prompt tokens (so nothing masks them) change the short prompts' replies.
    padded = [generate_batch(model, [[1] * (width - len(p)) + p], [0], greedy, 24, [1], 1, engine="lean")[0]
              for p in prompts]
    assert sum(a != b for a, b in zip(padded, alone)) >= len(prompts) - 2


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_continuous_batching_equals_transformers_generate(arch, temperature, monkeypatch):
    """More prompts than rows: a finished row takes the next prompt, the cache compacts, replies stay generate's."""
    from draftsmith.data.generation import generate_batch
    from draftsmith.decoding.sampling import SamplingParams
    from draftsmith.models import kv

    model, prompts = tiny_model(arch), _prompts((5, 17, 9, 3, 30, 12, 21, 8, 2, 14))
    params = SamplingParams(temperature=temperature, top_p=0.9 if temperature else None)
    seeds = list(range(len(prompts)))
    admits, moves = [], []
    real_admit, real_move = kv.BatchKVCache.admit, kv.BatchKVCache._move
    monkeypatch.setattr(kv.BatchKVCache, "admit", lambda self, row, src: (admits.append(row), real_admit(self, row, src)))
    monkeypatch.setattr(kv.BatchKVCache, "_move", lambda self, d, capacity=None: (moves.append(d),
                                                                                 real_move(self, d, capacity)))
    bar = _Bar()
    lean = generate_batch(model, prompts, seeds, params, 40, [1], 1, bar=bar, engine="lean", batch_size=3)
    hf = generate_batch(model, prompts, seeds, params, 40, [1], 1, engine="hf")
    assert lean == hf
    assert len(admits) > 3 and set(admits) == {0, 1, 2}  # rows were refilled
    assert any(d < 0 for d in moves)  # the cache dropped all-padding slots instead of growing
    assert bar.n == len(prompts) * 40
    hf3 = generate_batch(model, prompts, seeds, params, 40, [1], 1, engine="hf", batch_size=3)
    assert hf3 == hf  # hf decodes batch_size prompts per generate call
    # a prompt longer than the cache's filled slots arrives mid-stream: every row moves right
    short_first = [prompts[3], prompts[4], prompts[0]]  # 3, 30, 5 tokens; replies of 8 (no eos)
    moves.clear()
    lean = generate_batch(model, short_first, seeds[:3], params, 8, [], 1, engine="lean", batch_size=1)
    assert lean == generate_batch(model, short_first, seeds[:3], params, 8, [], 1, engine="hf")
    assert len([d for d in moves if d > 0]) >= 2  # the first prompt's admission, then the long one's


def test_continuous_batching_negative_control(monkeypatch):
    """A refilled row that also sees its previous prompt's slots gets other replies: the test can fail."""
    from draftsmith.data.generation import generate_batch
    from draftsmith.decoding.sampling import SamplingParams
    from draftsmith.models import kv

    model, prompts = tiny_model("llama"), _prompts((5, 17, 9, 3, 30, 12, 21, 8, 2, 14))
    greedy = SamplingParams(temperature=0.0)
    good = generate_batch(model, prompts, [0] * 10, greedy, 24, [1], 1, engine="lean", batch_size=2)
    real_admit = kv.BatchKVCache.admit

    def leaky(self, row, src):
        real_admit(self, row, src)
        self.pads[row] = 0  # the stale slots before the new prompt become visible
        self._pads[row] = 0

    monkeypatch.setattr(kv.BatchKVCache, "admit", leaky)
    bad = generate_batch(model, prompts, [0] * 10, greedy, 24, [1], 1, engine="lean", batch_size=2)
    assert sum(a != b for a, b in zip(good, bad)) >= 3


def test_batch_generation_engine_errors():
    from draftsmith.data.generation import generate_batch
    from draftsmith.decoding.sampling import SamplingParams

    with pytest.raises(DraftsmithError, match="auto, lean or hf"):
        generate_batch(tiny_model("llama"), [[2, 3]], [0], SamplingParams(temperature=0.0), 4, [1], 1, engine="vllm")
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"
    try:
        with pytest.raises(DraftsmithError, match="lean generation engine cannot run"):
            generate_batch(model, [[2, 3]], [0], SamplingParams(temperature=0.0), 4, [1], 1, engine="lean")
    finally:
        model.config._attn_implementation = "sdpa"
