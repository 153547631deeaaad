"""Quantized verifier: the int8 layer's arithmetic, its batch invariance (and the per-tensor
scheme that lacks it), lossless speculative decoding on it, and its bench rows and report.
Quantized draft (``--draft-precision int8``): the weight-only layer, the kernel probe, and
lossless speculative decoding with it."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from conftest import perturbed_copy, tiny_model
from draftsmith import generate
from draftsmith.decoding import DraftModelProposer, NgramProposer
from draftsmith.errors import DraftsmithError
from draftsmith.models.quantize import (Int8Linear, Int8WeightLinear, int8_weight_only_usable, output_vocab_size,
                                        quantize_draft, quantize_verifier)


def _per_tensor_dynamic(model: torch.nn.Module) -> torch.nn.Module:
    """torch.ao's dynamic int8 (activation scale per tensor): the scheme draftsmith does not use."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation notice
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)


def _prompt(seed: int, n: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(2, 128, (n,), generator=g).tolist()
    return head + head[: n // 2]


def test_int8_linear_is_the_integer_product_rescaled():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    q = Int8Linear(lin)
    x = torch.randn(3, 5, 64)
    y = q(x)
    assert y.shape == (3, 5, 48) and y.dtype == torch.float32
    # exact reference in float64: the int8 codes and scales, multiplied without rounding
    w = lin.weight.detach().double()
    s_w = w.abs().amax(-1) / 127
    wq = torch.round(w / s_w[:, None])
    x2 = x.reshape(-1, 64).double()
    s_x = x2.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(x2 / s_x)
    ref = (xq @ wq.T) * s_x * s_w + lin.bias.detach().double()
    assert torch.allclose(y.reshape(-1, 48).double(), ref, rtol=1e-5, atol=1e-5)
    assert q.qweight.dtype == torch.int8 and int(q.qweight.abs().max()) == 127
    # and close to the float layer (quantization error, a few percent of the output scale)
    err = (y - lin(x)).abs().max() / lin(x).abs().max()
    assert 0 < err < 0.05


def test_int8_per_token_is_batch_invariant_and_per_tensor_is_not():
    """A token's output must not depend on the other tokens of the forward; torch.ao's per-tensor
    activation scale (the negative control) makes it depend on them."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(4, 64)
    x[3] *= 50  # one loud token sets a per-tensor scale for all
    one_by_one = lambda f: torch.cat([f(x[i:i + 1]) for i in range(4)])  # noqa: E731
    q = Int8Linear(lin)
    assert torch.equal(q(x), one_by_one(q))
    pt = _per_tensor_dynamic(torch.nn.Sequential(lin))
    assert not torch.equal(pt(x), one_by_one(pt))
    assert (pt(x)[:3] - one_by_one(pt)[:3]).abs().max() > 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_speculative_decoding_on_int8_reproduces_its_plain_decoding(arch):
    verifier = tiny_model(arch, scale=1.0)  # flatter logits than the default: int8 changes some outputs
    q = quantize_verifier(verifier, "int8")
    assert isinstance(q.get_output_embeddings(), Int8Linear) and output_vocab_size(q) == 128
    assert not isinstance(verifier.get_output_embeddings(), Int8Linear)  # the original is left alone
    drafters = {"perfect": DraftModelProposer(verifier), "partial": DraftModelProposer(perturbed_copy(verifier, 0.02)),
                "ngram": NgramProposer()}
    changed = 0
    for seed in range(3):
        prompt = _prompt(seed)
        full = generate(verifier, prompt, max_new_tokens=40, eos_token_id=[]).token_ids
        plain = generate(q, prompt, max_new_tokens=40, eos_token_id=[]).token_ids
        assert plain == generate(q, prompt, max_new_tokens=40, eos_token_id=[], engine="hf-static").token_ids
        changed += plain != full
        for name, d in drafters.items():
            out = generate(q, prompt, proposer=d, max_new_tokens=40, num_draft_tokens=4, eos_token_id=[])
            assert out.token_ids == plain, (arch, name, seed)
    assert changed  # quantization does change these outputs: the equalities above are not vacuous


def test_per_tensor_quantized_verifier_is_not_lossless_negative_control():
    """Why int8 is per token: on torch.ao's per-tensor int8 model, speculative decoding leaves its plain decoding."""
    verifier = tiny_model("qwen2")
    pt = _per_tensor_dynamic(verifier)
    differ = 0
    for seed in range(3):
        prompt = _prompt(seed)
        plain = generate(pt, prompt, max_new_tokens=40, eos_token_id=[]).token_ids
        spec = generate(pt, prompt, proposer=DraftModelProposer(verifier), max_new_tokens=40, num_draft_tokens=4,
                        eos_token_id=[]).token_ids
        differ += plain != spec
    assert differ >= 2


def test_quantize_errors_name_the_flag():
    verifier = tiny_model("llama")
    with pytest.raises(DraftsmithError, match="--quantize int4 runs on CUDA.*use --quantize int8"):
        quantize_verifier(verifier, "int4")
    with pytest.raises(DraftsmithError, match="--quantize: expected one of"):
        quantize_verifier(verifier, "int3")


# ----------------------------------------------------------------------------- bench rows and report
@pytest.fixture(scope="module")
def bench_report(tmp_path_factory):
    from test_bench import _cfg, _prompts

    from draftsmith.bench import benchmark

    out = tmp_path_factory.mktemp("qbench")
    verifier = tiny_model("llama")
    verifier.generation_config.eos_token_id = None
    cfg = _cfg(out, num_draft_tokens=[2], quantize=["int8"], max_new_tokens=24, num_prompts=3, hf_reference=False)
    drafters = {"perfect": DraftModelProposer(verifier), "ngram": NgramProposer()}
    report = benchmark(verifier, _prompts(3), drafters, cfg, out, {"verifier": "tiny", "dataset": "synthetic"})
    return report, out


def test_bench_quantized_rows_speedups_and_quality(bench_report):
    report, out = bench_report
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["plain (ours)", "perfect k=2", "ngram k=2", "int8 plain", "int8 + perfect k=2",
                          "int8 + ngram k=2"]
    q = rows["int8 plain"]
    assert q["kind"] == "quantized" and q["quant"] == "int8" and q["speedup"]["n"] == 3
    qual = q["quality"]
    assert qual["vs"] == "plain (ours)" and qual["prompts"] == 3
    # the numbers against what the runs produced
    per = qual["first_divergence"]["per_prompt"]
    full = json.loads((out / "report.json").read_text())
    assert qual == full["rows"][3]["quality"]
    assert qual["identical_rate"] == sum(i is None for i in per) / 3
    assert qual["identical_rate"] < 1  # this tiny model's int8 twin leaves it on these prompts
    assert qual["mean_logprob"] < qual["reference_mean_logprob"] < 0  # full precision prefers its own greedy tokens
    for name in ("int8 + perfect k=2", "int8 + ngram k=2"):
        r = rows[name]
        # lossless against the quantized plain row, and the same quality change as it
        assert r["reference"] == "int8 plain" and r["outputs"]["identical"] == 3 and r["identical_output_rate"] == 1.0
        assert r["quality"]["first_divergence"] == qual["first_divergence"]
        assert r["drafter"].endswith("@int8") and r["speedup"]["n"] == 3
    assert rows["int8 + perfect k=2"]["acceptance"]["acceptance_rate"] < 1  # the fp draft is not int8's twin
    assert set(report["break_even"]) == {"perfect", "ngram"}  # the cost model is the full-precision verifier's


def test_which_to_choose_table(bench_report):
    report, out = bench_report
    table = report["which_to_choose"]
    assert [(c["option"], c["row"]) for c in table] == [
        ("plain", "plain (ours)"), ("draft", "perfect k=2"), ("draft", "ngram k=2"), ("quantized", "int8 plain"),
        ("quantized + draft", "int8 + perfect k=2"), ("quantized + draft", "int8 + ngram k=2")]
    ident = report["rows"][3]["quality"]["identical_prompts"]
    assert table[1]["lossless"] == "yes (3/3 identical)" and table[1]["quality"] == "none"
    assert table[3]["lossless"] == f"no ({ident} identical)" and "first divergence at token" in table[3]["quality"]
    assert table[4]["lossless"] == f"no ({ident} identical); vs int8 plain: yes (3/3 identical)"
    md = (out / "report.md").read_text()
    assert md.rstrip().splitlines()[-len(table) - 2].startswith("| option | row | speedup |")
    assert "| quantized + draft | int8 + ngram k=2 |" in md and "## Which to choose" in md


def test_which_to_choose_classifies_mismatches_and_ties():
    from draftsmith.bench.report import which_to_choose

    def row(name, kind, drafter=None, quant=None, speed=1.2, outputs=None, quality=None):
        return {"name": name, "kind": kind, "drafter": drafter, "quant": quant, "engine": "draftsmith",
                "speedup": {"median": speed}, "outputs": outputs, "identical_output_rate": None,
                "quality": quality}

    quality = {"identical_prompts": "1/4", "first_divergence": {"median": 7, "min": 2},
               "mean_logprob": -1.5, "reference_mean_logprob": -1.25}
    rows = [row("plain (ours)", "plain", speed=None),
            row("a k=2", "drafter", "a", speed=1.1, outputs={"identical": 3, "tie": 1, "mismatch": 0}),
            row("a k=4", "drafter", "a", speed=1.3, outputs={"identical": 3, "tie": 0, "mismatch": 1}),
            row("int8 plain", "quantized", quant="int8", speed=1.4, quality=quality),
            row("int8 + a k=2", "drafter", "a @int8", "int8", 1.6, {"identical": 4, "tie": 0, "mismatch": 0}, quality)]
    assert which_to_choose(rows[:3], 0.0) == []  # no quantized rows: no table
    table = which_to_choose(rows, 0.0)
    assert table[1]["row"] == "a k=4" and table[1]["lossless"] == "NO: 1 mismatch(es), a bug"
    assert table[2]["quality"] == ("1/4 outputs identical, first divergence at token 7 (median; earliest 2); "
                                   "mean log-prob/token under full precision -1.500 (its own outputs: -1.250)")
    assert table[3]["speedup"] == 1.6 and table[3]["lossless"] == "no (1/4 identical); vs int8 plain: yes (4/4 identical)"
    rows[2]["speedup"]["median"] = 1.0  # now the k with a tie is the best
    assert which_to_choose(rows, 0.0)[1]["lossless"] == "yes (3/4 identical, 1 numerical tie(s))"
    assert which_to_choose(rows, 0.7)[1]["lossless"] == "yes (sampling: exact by construction)"


def test_bench_quantize_setting_is_checked(tmp_path):
    from test_bench import _cfg

    with pytest.raises(DraftsmithError, match="--quantize: expected some of"):
        _cfg(tmp_path, quantize=["int3"])
    with pytest.raises(DraftsmithError, match="--quantize"):
        _cfg(tmp_path, quantize=["int8"], engines=["vllm"])
    assert _cfg(tmp_path, quantize=["int8", "int8"]).quantize == ["int8"]
    assert _cfg(tmp_path).quantize == []  # off by default



def _verify_vs_steps(model: torch.nn.Module, per_query: bool, seed: int, m: int = 4, vocab: int = 128) -> float:
    """Largest |logit| difference between one m-token verify forward and m one-token steps."""
    from draftsmith.decoding.runner import verifier_runner

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (20 + seed,), generator=g)
    with torch.inference_mode():
        r = verifier_runner(model, 64, mode="lean")
        assert r.cache.per_query  # a verifier that rounds its activations attends per query by default
        r.cache.per_query = per_query
        r.forward(ids[:-m], 1)
        verify, _ = r.forward(ids[-m:], m)
        r.rollback(len(ids) - m)
        steps = torch.cat([r.forward(ids[len(ids) - m + j:len(ids) - m + j + 1], 1)[0] for j in range(m)])
    return (verify - steps).abs().max().item()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_int8_verify_forward_is_bitwise_a_one_token_step(arch):
    """With one query at a time, an m-token verify of the W8A8 verifier computes every position
    bitwise as a one-token step does, so speculative decoding on it is exactly its plain decoding."""
    q = quantize_verifier(tiny_model(arch, scale=1.0), "int8")
    assert all(_verify_vs_steps(q, True, seed) == 0.0 for seed in range(6))
    from draftsmith.models.kv import eager_cpu_attention

    with eager_cpu_attention():  # the cpp layout's eager attention kernel leaves a per-query cache on SDPA
        assert all(_verify_vs_steps(q, True, seed) == 0.0 for seed in range(3))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])  # mistral's windowed masks round alike here
def test_int8_verify_forward_attending_all_queries_at_once_is_not_bitwise_negative_control(arch):
    """What per-query attention removes: one SDPA call over the m queries rounds an ulp
    differently from one-token steps (tiny models: ~5e-7, too small to cross an int8 step)."""
    q = quantize_verifier(tiny_model(arch, scale=1.0), "int8")
    assert max(_verify_vs_steps(q, False, seed) for seed in range(8)) > 0.0


@pytest.mark.slow
def test_int8_smollm2_verify_is_bitwise_and_the_ulp_becomes_an_int8_step(smollm2):
    """On a real model the ulp crosses int8 rounding boundaries: attending all queries at once moves
    logits by whole units (measured 2.6 on SmolLM2-135M; Gemma-3-270M 2.0), per-query attention by 0."""
    model, _, _ = smollm2
    q = quantize_verifier(model, "int8")
    assert max(_verify_vs_steps(q, False, seed, vocab=5000) for seed in range(3)) > 0.1
    assert all(_verify_vs_steps(q, True, seed, vocab=5000) == 0.0 for seed in range(3))


# ----------------------------------------------------------------------------- int8 draft (W8A16)
def test_int8_weight_only_linear_is_the_int8_product_in_bfloat16():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    q = Int8WeightLinear(lin)
    x = torch.randn(3, 5, 64)
    y = q(x)
    assert y.shape == (3, 5, 48) and y.dtype == torch.float32
    assert q.qweight.dtype == torch.int8 and int(q.qweight.abs().max()) == 127
    # reference in float64 from what the kernel is given: bfloat16 inputs, int8 codes, bfloat16 scales
    x2 = x.reshape(-1, 64).to(torch.bfloat16).double()
    ref = (x2 @ q.qweight.double().T) * q.scale.double() + lin.bias.detach().double()
    err = (y.reshape(-1, 48).double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2  # the output's bfloat16 rounding: 2^-8 relative
    # and near the float layer (the int8 rounding of the weights)
    rel = (y - lin(x)).abs().max() / lin(x).abs().max()
    assert 0 < rel < 0.05


def test_int8_weight_only_probe_takes_widths_of_16_and_a_kernel_that_agrees(monkeypatch):
    torch.manual_seed(0)
    assert int8_weight_only_usable(torch.nn.Linear(64, 8))
    # torch 2.13's kernel returns garbage (or crashes) when the input width is no multiple of 16
    assert not int8_weight_only_usable(torch.nn.Linear(24, 8))
    assert not int8_weight_only_usable(torch.nn.Linear(64, 8, device="meta"))  # CPU only
    # negative control of the numerical check: a kernel that answers wrongly is refused
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, w, s: 1.5 * real(x, w, s))
    assert not int8_weight_only_usable(torch.nn.Linear(64, 8))


def test_quantize_draft_int8_swaps_the_step_layers_and_keeps_the_original():
    from draft_factory import random_draft

    verifier = tiny_model("llama")
    d = random_draft(verifier, vd=64, aux_layer_ids=[0, 1, 1])
    assert quantize_draft(d, "as-loaded") is d
    q = quantize_draft(d, "int8")
    swapped = {n for n, m in q.named_modules() if isinstance(m, Int8WeightLinear)}
    assert swapped == {"lm_head", *(f"layers.0.self_attn.{p}_proj" for p in "qkvo"),
                       *(f"layers.0.mlp.{p}_proj" for p in ("gate", "up", "down"))}
    assert type(q.fc) is torch.nn.Linear  # once per round, from the verifier's states: left in float
    assert not any(isinstance(m, Int8WeightLinear) for m in d.modules())  # the original is untouched
    assert torch.equal(q.d2t, d.d2t) and torch.equal(q.embed_tokens.weight, d.embed_tokens.weight)
    with pytest.raises(DraftsmithError, match="--draft-precision"):
        quantize_draft(d, "int4")
    with pytest.raises(DraftsmithError, match="runs on CPU"):  # a draft on another device says where it runs
        quantize_draft(copy.deepcopy(d).to("meta"), "int8")


@pytest.mark.parametrize("layout", ["onednn", "cpp"])
def test_quantize_draft_inside_a_weight_layout_swaps_the_same_layers(layout):
    """A draft already held in a layout (its Linears switched to a subclass) is quantized as a plain
    one: every step layer int8, the copy's fc a plain Linear, the original's layout untouched."""
    from draft_factory import random_draft
    from draftsmith.models import cpu_linear
    from draftsmith.models.verifier import CppLinear, OneDNNLinear, weight_layout

    if layout == "cpp" and not cpu_linear.available():
        pytest.fail("the few-row kernel does not build here")
    d = random_draft(tiny_model("llama"), vd=64, aux_layer_ids=[0, 1, 1])
    plain = quantize_draft(d, "int8")
    cls = {"onednn": OneDNNLinear, "cpp": CppLinear}[layout]
    with weight_layout(d, layout):
        assert type(d.layers[0].mlp.up_proj) is cls
        q = quantize_draft(d, "int8")
        assert type(d.layers[0].mlp.up_proj) is cls  # the original stays in the block's layout
    assert type(d.layers[0].mlp.up_proj) is torch.nn.Linear
    kinds = {n: type(m) for n, m in q.named_modules() if isinstance(m, (torch.nn.Linear, Int8WeightLinear))}
    assert kinds == {n: type(m) for n, m in plain.named_modules() if isinstance(m, (torch.nn.Linear, Int8WeightLinear))}
    assert type(q.fc) is torch.nn.Linear and sum(t is Int8WeightLinear for t in kinds.values()) == 8


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_an_int8_draft_proposes_from_other_logits(arch):
    """Not the float draft under another name: its logits move by the int8 rounding, a little.
    (That its speculative output is plain decoding's: test_eagle3.test_greedy_equivalence_eagle3.)"""
    from draft_factory import random_draft

    d = random_draft(tiny_model(arch), vd=64, aux_layer_ids=[0, 1, 1])
    q = quantize_draft(d, "int8")
    ids, hidden, pos = torch.tensor([[3, 7, 9]]), torch.randn(1, 3, d.config.hidden_size), torch.arange(1, 4)[None]
    with torch.no_grad():
        lf, _ = d.step(ids, hidden, pos, d.new_cache(8))
        lq, _ = q.step(ids, hidden, pos, q.new_cache(8))
    assert 0 < float((lf - lq).abs().max()) < 0.1 * float(lf.abs().max())


def test_bench_draft_precisions_label_the_rows(tmp_path):
    from draft_factory import random_draft
    from draftsmith.bench import BenchConfig
    from draftsmith.bench.run import with_draft_precisions
    from draftsmith.decoding.proposers import Eagle3Proposer

    verifier = tiny_model("llama")
    prop = Eagle3Proposer(random_draft(verifier, vd=64, aux_layer_ids=[0, 1, 1]))
    ngram = NgramProposer()
    out = with_draft_precisions({"eagle3:d": prop, "ngram": ngram}, ["as-loaded", "int8"])
    assert list(out) == ["eagle3:d", "eagle3:d@int8", "ngram"]
    assert out["eagle3:d"] is prop and out["ngram"] is ngram
    assert isinstance(out["eagle3:d@int8"].draft.lm_head, Int8WeightLinear)
    only = with_draft_precisions({"eagle3:d": prop}, ["int8"])  # the first precision keeps the label
    assert list(only) == ["eagle3:d"] and isinstance(only["eagle3:d"].draft.lm_head, Int8WeightLinear)
    with pytest.raises(DraftsmithError, match="--draft-precision"):
        BenchConfig(verifier="x", out=tmp_path, drafter=["ngram"], draft_precision=["fp8"])
    with pytest.raises(DraftsmithError, match="--draft-precision"):
        BenchConfig(verifier="x", out=tmp_path, drafter=["ngram"], draft_precision=[])
    from draftsmith.cli import GenerateConfig

    with pytest.raises(DraftsmithError, match="--draft-precision"):
        GenerateConfig(verifier="x", prompt="hi", draft_precision="int4")


def test_load_draft_at_int8_from_a_saved_draft(tmp_path):
    from draft_factory import random_draft, tiny_verifier
    from draftsmith.drafters import build_proposer
    from draftsmith.export import save_draft

    verifier = tiny_verifier()
    path = save_draft(random_draft(verifier), tmp_path / "d", verifier_name="tiny", num_draft_tokens=3,
                      fingerprint="x", metrics={}, provenance={})
    as_loaded = build_proposer(str(path), verifier, None)
    q = build_proposer(str(path), verifier, None, draft_precision="int8")
    assert type(as_loaded.draft.lm_head) is torch.nn.Linear and isinstance(q.draft.lm_head, Int8WeightLinear)
    with pytest.raises(DraftsmithError, match="applies to an EAGLE-3 draft directory"):  # not silently ignored
        build_proposer("ngram", verifier, None, draft_precision="int8")
    assert isinstance(build_proposer("ngram", verifier, None), NgramProposer)
    prompt = list(range(2, 14))
    plain = generate(verifier, prompt, max_new_tokens=20, eos_token_id=[]).token_ids
    assert generate(verifier, prompt, proposer=q, max_new_tokens=20, num_draft_tokens=3,
                    eos_token_id=[]).token_ids == plain


def test_parameters_to_keeps_the_rotary_tables_in_float32():
    """The int4 copy goes to bfloat16 by its parameters only: ``Module.to(bfloat16)`` would round the
    rotary ``inv_freq`` buffers transformers keeps in float32 (control: it does)."""
    from draftsmith.models.quantize import parameters_to

    model = tiny_model("llama")
    inv = model.model.rotary_emb.inv_freq.clone()
    assert inv.dtype == torch.float32
    rounded = copy.deepcopy(model).to(torch.bfloat16)
    assert rounded.model.rotary_emb.inv_freq.dtype == torch.bfloat16  # the control
    q = parameters_to(copy.deepcopy(model), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in q.parameters())
    assert torch.equal(q.model.rotary_emb.inv_freq, inv)
