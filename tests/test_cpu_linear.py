"""draftsmith's few-row CPU linear (``--weight-layout cpp``), float32 and int8 weights: its sums, its
batch invariance, and the modules that route decode and verify steps to it."""

from __future__ import annotations

import pytest
import torch

from draftsmith.models import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no C++ toolchain to build the kernel")


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("K", [1, 15, 16, 17, 33, 576])
@pytest.mark.parametrize("N", [1, 7, 9, 65])
def test_small_linear_is_x_wt_plus_b_for_every_row_count(K, N):
    """Tails of K (lanes of 8 and 16), partial blocks of weight rows, 1 to 8 rows and more (several
    passes of 8), with and without a bias: within float32 rounding of a float64 product."""
    g = torch.Generator().manual_seed(K * 100 + N)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
        x = torch.randn(M, K, generator=g)
        for bias in (b, None):
            got = cpu_linear.small_linear(x, w, bias)
            assert got.shape == (M, N) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), _exact(x, w, bias), atol=1e-5 * K ** 0.5 + 1e-6, rtol=1e-5)


def _int8(N: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 weights [N, K] (the full range, -128 included) and positive float32 scales [N]."""
    return torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8), torch.rand(N, generator=g) / 64 + 1e-3


@pytest.mark.parametrize("K", [1, 15, 16, 17, 33, 576])
@pytest.mark.parametrize("N", [1, 7, 9, 65])
def test_small_linear_i8_is_the_int8_product_rescaled(K, N):
    """``(x @ q^T) * scale + b`` with int8 weights widened exactly: within float32 rounding of the
    float64 product, over the same tails of K, partial blocks and row counts."""
    g = torch.Generator().manual_seed(K * 100 + N)
    q, scale = _int8(N, K, g)
    b = torch.randn(N, generator=g)
    for M in (1, 2, 3, 8, 9, 17):
        x = torch.randn(M, K, generator=g)
        for bias in (b, None):
            got = cpu_linear.small_linear_i8(x, q, scale, bias)
            assert got.shape == (M, N) and got.dtype == torch.float32
            want = _exact(x, q.double() * scale.double()[:, None], bias)
            torch.testing.assert_close(got.double(), want, atol=(1e-5 * K ** 0.5 + 1e-6) * 128 / 64, rtol=1e-5)


def _within_a_rounding(got: torch.Tensor, want: torch.Tensor, K: int) -> None:
    """bfloat16 ``got`` is float64 ``want`` rounded to bfloat16, but where float32 summation moves a value
    across a rounding boundary (one bfloat16 ulp, rarely)."""
    ulp = want.abs().clamp_min(2.0 ** -126).log2().floor().exp2() * 2.0 ** -7
    assert ((got.double() - want).abs() <= ulp * 0.5 + 1e-5 * K ** 0.5 * want.abs().clamp_min(1)).all()
    assert (got == want.bfloat16()).double().mean() > 0.9


@pytest.mark.parametrize("K", [1, 15, 16, 17, 33, 576])
@pytest.mark.parametrize("N", [1, 9, 65])
def test_small_linear_i8_takes_bfloat16_activations(K, N):
    """A bfloat16 model's int8 draft layer (W8A16): bfloat16 x and b widened, the int8 product rescaled in
    float32, y rounded to bfloat16."""
    g = torch.Generator().manual_seed(K * 100 + N + 7)
    q, scale = _int8(N, K, g)
    b = torch.randn(N, generator=g).bfloat16()
    for M in (1, 2, 3, 9, 17):
        x = torch.randn(M, K, generator=g).bfloat16()
        for bias in (b, None):
            got = cpu_linear.small_linear_i8(x, q, scale, bias)
            assert got.shape == (M, N) and got.dtype == torch.bfloat16
            _within_a_rounding(got, _exact(x, q.double() * scale.double()[:, None], bias), K)
        # float32 rows through a bfloat16 draft's layer: its bfloat16 bias widened (exact)
        assert torch.equal(cpu_linear.small_linear_i8(x.float(), q, scale, b),
                           cpu_linear.small_linear_i8(x.float(), q, scale, b.float()))


@pytest.mark.parametrize("K", [1, 15, 16, 17, 33, 576])
@pytest.mark.parametrize("N", [1, 9, 65])
def test_small_linear_bfloat16_is_the_product_rounded_to_bfloat16(K, N):
    """bfloat16 x, w and b: the float64 product rounded to bfloat16, but where float32 summation moves a
    value across a rounding boundary (one bfloat16 ulp, rarely); y is bfloat16."""
    g = torch.Generator().manual_seed(K * 100 + N)
    w, b = torch.randn(N, K, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
    for M in (1, 2, 3, 9, 17):
        x = torch.randn(M, K, generator=g).bfloat16()
        for bias in (b, None):
            got = cpu_linear.small_linear(x, w, bias)
            assert got.shape == (M, N) and got.dtype == torch.bfloat16
            _within_a_rounding(got, _exact(x, w, bias), K)


@pytest.mark.parametrize("weights", ["float32", "int8", "bfloat16", "int8-bfloat16"])
def test_small_linear_rows_are_batch_invariant(weights):
    """A row's result is bitwise the same whether it is computed alone (a one-token step) or among
    others (a verify step), for every row count up to 17 and every row in it."""
    g = torch.Generator().manual_seed(0)
    if weights.startswith("int8"):
        q, scale = _int8(193, 577, g)
        w = q.double() * scale.double()[:, None]  # for the control
        op = lambda x_, b_: cpu_linear.small_linear_i8(x_, q, scale, b_)  # noqa: E731
    else:
        w = torch.randn(193, 577, generator=g)
        op = lambda x_, b_: cpu_linear.small_linear(x_, w, b_)  # noqa: E731
    b = torch.randn(193, generator=g)
    x = torch.randn(17, 577, generator=g)
    if weights.endswith("bfloat16"):
        b, x = b.bfloat16(), x.bfloat16()
        w = w if weights.startswith("int8") else w.bfloat16()
    alone = torch.cat([op(x[i:i + 1], b) for i in range(17)])
    for M in range(1, 18):
        assert torch.equal(op(x[:M], b), alone[:M]), M
    # the control: a product summed in another order (float64, rounded) is not bitwise the same (with
    # int8 weights and bfloat16 x, the float32 form above carries it: rounded to bfloat16, the orders'
    # differences vanish at this seed)
    if weights != "int8-bfloat16":
        assert not torch.equal(_exact(x, w, b).to(alone.dtype), alone)


def test_small_linear_takes_any_leading_shape_and_strides():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 40, generator=g)
    x = torch.randn(1, 3, 80, generator=g)[..., ::2]  # [1, 3, 40], not contiguous
    got = cpu_linear.small_linear(x, w)
    assert got.shape == (1, 3, 24)
    assert torch.equal(got[0], cpu_linear.small_linear(x[0].contiguous(), w))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.small_linear(x.double(), w.double())
    with pytest.raises(RuntimeError, match="expected"):
        cpu_linear.small_linear(torch.randn(2, 39), w)
    q, scale = _int8(24, 40, g)
    assert torch.equal(cpu_linear.small_linear_i8(x, q, scale)[0], cpu_linear.small_linear_i8(x[0].contiguous(), q, scale))
    with pytest.raises(RuntimeError, match="int8 w"):
        cpu_linear.small_linear_i8(x, w, scale)
    with pytest.raises(RuntimeError, match="scale"):
        cpu_linear.small_linear_i8(x, q, scale[:-1])
    with pytest.raises(RuntimeError, match="float32 or bfloat16 w"):
        cpu_linear.small_linear(x, q)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        cpu_linear.small_linear(x, w.bfloat16())
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu_linear.small_linear(xb, wb)[0], cpu_linear.small_linear(xb[0].contiguous(), wb))


def test_cpp_linear_routes_steps_to_the_kernel_and_a_prefill_to_mkl():
    """Inside ``--weight-layout cpp`` a Linear of up to MAX_ROWS rows is the kernel's product
    (bitwise), float32 or bfloat16, a longer input (a prefill) and a float64 one are ``F.linear``'s;
    after the block the module is a plain Linear again."""
    from draftsmith.models.verifier import CppLinear, weight_layout

    lin = torch.nn.Linear(64, 48)
    seq = torch.nn.Sequential(lin)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode(), weight_layout(seq, "cpp") as n:
        assert n == 1 and type(lin) is CppLinear
        for M in (1, 3, cpu_linear.MAX_ROWS):
            x = torch.randn(1, M, 64, generator=g)
            assert torch.equal(lin(x), cpu_linear.small_linear(x, lin.weight, lin.bias)), M
        x = torch.randn(1, cpu_linear.MAX_ROWS + 1, 64, generator=g)
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        xb = x[:, :2].bfloat16()
        lin.to(torch.bfloat16)
        assert torch.equal(lin(xb), cpu_linear.small_linear(xb, lin.weight, lin.bias))
        xd = x[:, :2].double()
        assert torch.equal(lin.double()(xd), torch.nn.functional.linear(xd, lin.weight, lin.bias))  # other dtypes
        lin.float()
    assert type(lin) is torch.nn.Linear


def test_cpp_layout_runs_an_int8_draft_layer_through_the_kernel():
    """Inside ``--weight-layout cpp`` an int8 draft layer (``--draft-precision int8``) multiplies up to
    MAX_ROWS float32 or bfloat16 rows with the kernel's int8 form (bitwise), a float32 prefill by the
    dequantized weight (the same function, float32 rounding apart), a bfloat16 prefill with ATen's
    int8 kernel; it agrees with the layer as loaded (bfloat16 activations) within their rounding,
    and is that layer again after the block."""
    from draftsmith.models.quantize import Int8WeightLinear
    from draftsmith.models.verifier import CppInt8WeightLinear, weight_layout

    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 48, bias=True)
    layer = Int8WeightLinear(lin)
    seq = torch.nn.Sequential(layer)
    x = torch.randn(1, cpu_linear.MAX_ROWS + 1, 64, generator=g)
    with torch.inference_mode():
        loaded = layer(x)  # ATen's _weight_int8pack_mm, bfloat16 activations
        with weight_layout(seq, "cpp") as n:
            assert n == 1 and type(layer) is CppInt8WeightLinear
            for M in (1, 3, cpu_linear.MAX_ROWS):
                got = layer(x[:, :M])
                assert torch.equal(got, cpu_linear.small_linear_i8(x[:, :M], layer.qweight, layer.scale32, layer.bias))
                torch.testing.assert_close(got, loaded[:, :M], atol=0.05, rtol=0.02)
                assert not torch.equal(got, loaded[:, :M])  # the control: float32 activations are not bfloat16's
            prefill = layer(x)
            torch.testing.assert_close(prefill[:, :3], layer(x[:, :3]), atol=1e-5, rtol=1e-5)
            xb = x.bfloat16()
            got = layer(xb[:, :2])
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, cpu_linear.small_linear_i8(xb[:, :2], layer.qweight, layer.scale32, layer.bias))
            aten = Int8WeightLinear.forward(layer, xb[:, :2])
            torch.testing.assert_close(got, aten, atol=0.05, rtol=0.02)
            assert not torch.equal(got, aten)  # the control: ATen rounds the product before the bias
            assert torch.equal(layer(xb), Int8WeightLinear.forward(layer, xb))  # a bfloat16 prefill: ATen's
        assert type(layer) is Int8WeightLinear


def test_cpp_layout_switches_only_float32_cpu_linears_and_refuses_without_the_kernel(monkeypatch):
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.verifier import weight_layout

    with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4).half()), "cpp") as n:
        assert n == 0  # nothing float32 or bfloat16 to switch
    with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4).bfloat16()), "cpp") as n:
        assert n == 1
    with pytest.raises(DraftsmithError, match="CPU kernel"):
        with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta")), "cpp"):
            pass
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    with pytest.raises(DraftsmithError, match="could not be built"):
        with weight_layout(torch.nn.Sequential(torch.nn.Linear(4, 4)), "cpp"):
            pass
    from draftsmith.bench import measure

    assert "cpp" not in measure.layout_candidates(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.parametrize("H", [1, 15, 16, 17, 64, 576])
def test_rms_norm_is_f_rms_norm_times_the_weight_and_rows_are_independent(H):
    g = torch.Generator().manual_seed(H)
    x, w = torch.randn(5, 3, H, generator=g) * 3, torch.randn(H, generator=g)
    got = cpu_linear.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, w * torch.nn.functional.rms_norm(x, (H,), eps=1e-6), atol=1e-6, rtol=1e-6)
    rows = x.reshape(-1, H)
    assert torch.equal(torch.cat([cpu_linear.rms_norm(r[None], w, 1e-6) for r in rows]), got.reshape(-1, H))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.rms_norm(x.double(), w.double(), 1e-6)
    with pytest.raises(RuntimeError, match="expected"):
        cpu_linear.rms_norm(x, torch.ones(H + 1), 1e-6)
    with pytest.raises(RuntimeError, match="bfloat16 x and w"):
        cpu_linear.rms_norm(x.bfloat16(), w, 1e-6)


@pytest.mark.parametrize("H", [1, 15, 16, 17, 64, 576])
def test_rms_norm_in_bfloat16_rounds_as_the_module_rounds(H):
    """bfloat16 x and w: ``bf16(w * bf16(x / rms))`` with the rms in float32, the draft module's two
    roundings; equal to the module but where the float32 sum's order moves ``x / rms`` across a
    bfloat16 rounding boundary (rarely; the product then moves by up to 2 ulps); rows independent of
    each other."""
    from draftsmith.models.eagle3 import RMSNorm

    g = torch.Generator().manual_seed(H + 1)
    x, w = (torch.randn(5, 3, H, generator=g) * 3).bfloat16(), torch.randn(H, generator=g).bfloat16()
    got = cpu_linear.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    norm = RMSNorm(H, 1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(w)
    want = norm(x)
    assert want.dtype == torch.bfloat16
    ulp = want.float().abs().clamp_min(2.0 ** -126).log2().floor().exp2() * 2.0 ** -7
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
    assert (got == want).double().mean() > 0.95
    # the control: the float32 norm rounded once differs from the module's two roundings somewhere
    assert not torch.equal((w.float() * torch.nn.functional.rms_norm(x.float(), (H,), eps=1e-6)).bfloat16(), got) or H == 1
    rows = x.reshape(-1, H)
    assert torch.equal(torch.cat([cpu_linear.rms_norm(r[None], w, 1e-6) for r in rows]), got.reshape(-1, H))


def test_cpp_layout_runs_a_drafts_norms_through_the_kernel_outside_autograd(monkeypatch):
    """Inside ``--weight-layout cpp`` an EAGLE-3 draft's RMSNorms are one ``rms_norm`` call (within float32
    rounding of the module's, bitwise the op's) for inference; under autograd (training) and for other
    dtypes they run the module's own ops; after the block they are plain RMSNorms again."""
    from draftsmith.models.eagle3 import RMSNorm
    from draftsmith.models.verifier import CppRMSNorm, weight_layout

    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    plain = norm(x)
    with weight_layout(torch.nn.Sequential(norm), "cpp") as n:
        assert n == 1 and type(norm) is CppRMSNorm
        with torch.inference_mode():
            fast = norm(x)
            assert torch.equal(fast, cpu_linear.rms_norm(x, norm.weight, norm.eps))
            torch.testing.assert_close(fast, plain, atol=1e-6, rtol=1e-6)
        xg = x.clone().requires_grad_()
        out = norm(xg)
        out.sum().backward()  # the module's own ops: differentiable
        assert torch.equal(out.detach(), plain) and xg.grad is not None
        with torch.inference_mode():
            xb = x.bfloat16()
            assert torch.equal(norm(xb), RMSNorm.forward(norm, xb))  # x's dtype not w's: the module's ops
    assert type(norm) is RMSNorm
    norm.bfloat16()  # a bfloat16 draft's norm: the op's bfloat16 form (its calls counted)
    real, calls = torch.ops.draftsmith.rms_norm, []
    monkeypatch.setattr(torch.ops.draftsmith, "rms_norm", lambda *a: calls.append(a[0].dtype) or real(*a))
    with weight_layout(torch.nn.Sequential(norm), "cpp"), torch.inference_mode():
        assert type(norm) is CppRMSNorm
        assert torch.equal(norm(xb), real(xb, norm.weight, norm.eps)) and calls == [torch.bfloat16]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_cpp_layout_runs_a_verifiers_llama_style_norms_through_the_kernel(arch, monkeypatch):
    """Inside ``--weight-layout cpp`` a transformers model's RMSNorms that compute Llama's (probed:
    Llama's, Qwen3's per-head q/k norms) are one ``rms_norm`` call, within float32 rounding of their
    own forward and used by the lean step (calls counted); Gemma's ``x * (1 + w)`` fails the probe and
    keeps its own forward (the control); under autograd the module's own ops run; after the block the
    classes are as loaded."""
    from conftest import tiny_model

    from draftsmith.models.lean import LeanDecoder
    from draftsmith.models.verifier import CppNorm, _computes_llama_rms_norm, weight_layout

    model = tiny_model(arch)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    classes = [type(m) for m in norms]
    expect = {"llama": 5, "qwen3": 9, "gemma3": 0}[arch]  # qwen3: + q_norm, k_norm per layer; gemma3: none
    assert sum(_computes_llama_rms_norm(m) for m in norms) == expect
    x = torch.randn(3, norms[0].weight.shape[0], generator=torch.Generator().manual_seed(0)) * 2
    own = norms[0](x)
    real, calls = torch.ops.draftsmith.rms_norm, []
    monkeypatch.setattr(torch.ops.draftsmith, "rms_norm", lambda *a: calls.append(1) or real(*a))
    with weight_layout(model, "cpp"):
        switched = [m for m in norms if isinstance(m, CppNorm)]
        assert len(switched) == expect
        with torch.inference_mode():
            if expect:
                got = norms[0](x)
                torch.testing.assert_close(got, own, atol=1e-6, rtol=1e-6)
                assert torch.equal(got, real(x, norms[0].weight, float(norms[0].variance_epsilon)))
            calls.clear()
            dec = LeanDecoder(model)
            dec.forward(torch.tensor([3, 4]), torch.arange(2), dec.new_cache(4), 1)
            assert len(calls) == expect  # every switched norm once per step, no other
        if expect:
            xg = x.clone().requires_grad_()
            norms[0](xg).sum().backward()  # autograd: the module's own ops
            assert xg.grad is not None
    assert [type(m) for m in norms] == classes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_fused_layer_is_bitwise_the_loop_it_replaces(arch, dtype, monkeypatch):
    """Inside ``--weight-layout cpp`` an eager step's pre-norm layers run as one ``llama_layer`` call each
    (calls counted): logits, aux hidden states and the cache's keys and values are bitwise those of the
    Python loop over the same kernels, for one-token and verify steps, across a sliding window's edge
    (mistral: windows of 8), with Qwen2's biases and Qwen3's q/k norms; a prefill takes the loop.
    Gemma 3's sandwich layers are not fused (the control: no call)."""
    import copy

    from conftest import tiny_model

    from draftsmith.models.lean import LeanDecoder
    from draftsmith.models.verifier import weight_layout

    model = copy.deepcopy(tiny_model(arch)).to(dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norm weights and biases unlike one another (random init leaves them 1 and 0)
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    for mod in model.modules():  # q/k norms with an eps of their own (a swap of the two would show)
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon") and mod.weight.numel() == 16:
            mod.variance_epsilon = 0.5
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # biases are exercised
    real, calls = torch.ops.draftsmith.llama_layer, []
    monkeypatch.setattr(torch.ops.draftsmith, "llama_layer", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with weight_layout(model, "cpp"), torch.inference_mode():
        fused, loop = LeanDecoder(model), LeanDecoder(model)
        assert (fused.fused is None) == (arch == "gemma3")
        loop.fused = None
        cf, cl = fused.new_cache(40), loop.new_cache(40)
        ids = torch.randint(2, 100, (30,), generator=torch.Generator().manual_seed(1))
        spans = [(0, 12), (12, 13), (13, 17), (17, 18), (18, 25), (25, 26), (26, 28)]
        for s, e in spans:
            a = fused.forward(ids[s:e], torch.arange(s, e), cf, None, (0, 1, 2))
            b = loop.forward(ids[s:e], torch.arange(s, e), cl, None, (0, 1, 2))
            cf.advance(e - s)
            cl.advance(e - s)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (s, e)
        for x, y in zip(cf.keys + cf.values, cl.keys + cl.values):
            assert torch.equal(x[:, :, :28], y[:, :, :28])
    layers = model.config.num_hidden_layers
    assert calls == ([] if arch == "gemma3" else [e - s for s, e in spans[1:] for _ in range(layers)])


def test_fused_layer_rejects_bad_input():
    """Clear errors for what the op does not take."""
    from draftsmith.models import cpu_attention

    assert cpu_attention.available()  # the op attends through draftsmith::decode_attention
    x = torch.randn(1, 8)
    w = [torch.ones(8), *(torch.randn(8, 8) for _ in range(4)), torch.ones(8), *(torch.randn(8, 8) for _ in range(3))]
    K = torch.zeros(1, 2, 4, 4)
    args = (torch.ones(1, 4), torch.zeros(1, 4), K, K.clone(), torch.tensor([0]), 0, 0, 0.5, 1e-5, 0.0, 2, 2, 4, 256)
    layer, none = torch.ops.draftsmith.llama_layer, [None] * 7
    layer(x, None, w, none, none, *args)  # the control: accepted
    with pytest.raises(RuntimeError, match="9 weights"):
        layer(x, None, w[:8], none, none, *args)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 x"):
        layer(x.double(), None, w, none, none, *args)
    with pytest.raises(RuntimeError, match="weights of x's dtype"):
        layer(x.bfloat16(), None, w, none, none, *args)
    with pytest.raises(RuntimeError, match="int8 where a scale is given"):
        layer(x, None, w, [torch.ones(8)] + none[1:], none, *args)  # a scale for a float32 weight
    with pytest.raises(RuntimeError, match="resid of x's dtype"):
        layer(x, torch.zeros(2, 8), w, none, none, *args)
    with pytest.raises(RuntimeError, match="inside the cache"):
        layer(x, None, w, none, none, *args[:5], 4, *args[6:])
    with pytest.raises(RuntimeError, match="weights of shapes"):  # Wq for 3 heads where nh is 2
        layer(x, None, [w[0], torch.randn(12, 8), *w[2:]], none, none, *args)
    with pytest.raises(RuntimeError, match="bias 1 of its projection's output size"):
        layer(x, None, w, none, [None, torch.zeros(3)] + none[2:], *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_argmax_with_ties_nans_and_infinities(dtype):
    """``cpu_linear.argmax`` gives torch.argmax's indices: the first of tied maxima (in a lane's chunk, across
    chunks, in the tail), the first NaN wherever it is, 0 for a row of -inf; every row length around the
    16-lane chunks; any leading shape. The control: a row whose maximum sits twice returns the first."""
    assert cpu_linear._BUILT  # the extension's op, not ATen's fallback
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 15, 16, 17, 31, 32, 33, 100, 8192, 49152):
        x = torch.randn(7, n, generator=g).to(dtype)
        if n > 3:
            x[1, n // 2] = x[1, -1] = 50.0  # a tie: the first
            x[2, -1] = 60.0  # in the tail
            x[3, n // 3] = float("nan")  # a NaN: its index
            x[3, -1] = float("nan")
        x[4] = float("-inf")
        x[5, 0] = float("inf")
        x[6] = 1.0  # all equal: 0
        got = cpu_linear.argmax(x)
        assert got.dtype == torch.long and torch.equal(got, x.argmax(-1)), n
        if n > 3:
            assert got[1] == n // 2 and got[3] == n // 3
    x = torch.randn(2, 3, 40, generator=g).to(dtype)
    assert torch.equal(cpu_linear.argmax(x), x.argmax(-1)) and torch.equal(cpu_linear.argmax(x[0, 0]), x[0, 0].argmax(-1))
    assert cpu_linear.argmax(x[0, 0]).dim() == 0
