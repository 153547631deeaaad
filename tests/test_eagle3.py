"""EAGLE-3 draft: TTT unroll == step-by-step inference chain; engine integration."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model
from draftsmith import generate
from draftsmith.decoding.proposers import DraftModelProposer, Eagle3Proposer
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Draft


def _draft(verifier, vd=None, seed=0, **flags):
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=vd, aux_layer_ids=[0, 1, 1], **flags)
    d = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    if vd is not None:
        d.set_vocab(torch.arange(0, cfg.vocab_size, cfg.vocab_size // vd)[:vd])
    return d.eval()


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": False}, {"norm_output": True},
                                   {"norm_before_fc": True}, {"fc_norm": True}])
@pytest.mark.parametrize("chunk", [0, 4])
def test_ttt_matches_cached_chain(flags, chunk):
    """Step j of the TTT unroll at position t == the j-th cached draft step from t
    (attention in one block, and in query blocks of 4, 4, 2)."""
    torch.manual_seed(0)
    verifier = tiny_model("llama")
    d = _draft(verifier, **flags)
    d.ttt_attn_chunk = chunk
    L, steps, A, H = 10, 3, 3, 64
    aux = torch.randn(1, L, A * H)
    ids = torch.randint(0, 128, (1, L + steps))  # ids[t] = x_{t+1}
    pos = torch.arange(1, L + 1)[None]
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        ttt = d.forward_ttt(aux, ids[:, :L], pos, mask, steps)
        for t in (0, 4, L - 1):
            cache = d.new_cache(L + steps)
            logits, h = d.step(ids[:, : t + 1], d.fuse(aux[:, : t + 1]), pos[:, : t + 1], cache)
            cache.advance(t + 1)
            torch.testing.assert_close(logits[0, -1], ttt[0][0, t], atol=1e-5, rtol=1e-5)
            for j in range(1, steps):
                if t + j >= L:
                    break  # the unroll pads beyond the sequence
                logits, h = d.step(ids[:, t + j : t + j + 1], h[:, -1:], pos[:, t : t + 1] + j, cache)
                cache.advance(1)
                torch.testing.assert_close(logits[0, -1], ttt[j][0, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [0, 3])
def test_ttt_document_mask_isolates_documents(chunk):
    """Packed documents do not see each other: doc 2's logits equal a run on doc 2 alone."""
    torch.manual_seed(1)
    d = _draft(tiny_model("llama"))
    d.ttt_attn_chunk = chunk
    aux, ids = torch.randn(1, 9, 192), torch.randint(0, 128, (1, 9))
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1])
    pos = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 5]])
    mask = (doc[:, None] == doc[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    with torch.no_grad():
        packed = d.forward_ttt(aux, ids, pos, mask[None], 2)
        alone = d.forward_ttt(aux[:, 4:], ids[:, 4:], pos[:, 4:], torch.ones(5, 5, dtype=torch.bool).tril()[None], 2)
    torch.testing.assert_close(packed[0][:, 4:], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1][:, 4:8], alone[1][:, :4], atol=1e-5, rtol=1e-5)


def test_ttt_attention_blocks_match_one_block_with_gradients():
    """Blocked TTT attention (what training runs) == one [L, (j+1)L] SDPA, values and gradients,
    on a packed row of three documents whose length is no multiple of the block."""
    torch.manual_seed(2)
    d = _draft(tiny_model("llama")).train()
    L = 23
    aux, ids = torch.randn(1, L, 192), torch.randint(0, 128, (1, L))
    doc = torch.tensor([0] * 7 + [1] * 11 + [2] * 5)
    pos = torch.cat([torch.arange(1, 8), torch.arange(1, 12), torch.arange(1, 6)])[None]
    mask = ((doc[:, None] == doc[None, :]) & torch.ones(L, L, dtype=torch.bool).tril())[None]
    weights = torch.randn(4, 1, L, 128)
    results = []
    for chunk in (0, 5, 8):
        d.ttt_attn_chunk = chunk
        d.zero_grad()
        logits = d.forward_ttt(aux, ids, pos, mask, 4)
        sum((w * x).sum() for w, x in zip(weights, logits)).backward()
        results.append((torch.stack(logits), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    ref_logits, ref_grads = results[0]
    assert len(ref_grads) > 5
    for logits, grads in results[1:]:
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, atol=1e-4 * float(g.abs().max()), rtol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("vd", [None, 64])
@pytest.mark.parametrize("precision", ["as-loaded", "int8"])
def test_greedy_equivalence_eagle3(arch, vd, precision):
    """Speculative output equals plain decoding, with the draft as loaded and at int8 (its
    precision changes what it proposes, never what is output)."""
    from draftsmith.models.quantize import quantize_draft

    verifier = tiny_model(arch)
    d = _draft(verifier, vd=vd)
    d.config.aux_layer_ids = [0, 1, 2]
    prop = Eagle3Proposer(quantize_draft(d, precision))
    for seed in range(2):
        prompt = torch.randint(2, 128, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = generate(verifier, prompt, max_new_tokens=30, eos_token_id=[]).token_ids
        for k in (1, 4):
            out = generate(verifier, prompt, proposer=prop, max_new_tokens=30, num_draft_tokens=k, eos_token_id=[])
            assert out.token_ids == plain
            assert out.stats["drafts"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])  # mistral, gemma3: windows of 8
def test_greedy_equivalence_eagle3_in_the_cpp_layout(arch, monkeypatch):
    """Inside --weight-layout cpp (few-row Linear kernels, float32 and the int8 draft's; the eager steps'
    attention through the C++ kernel, windows included) speculative output still equals plain
    decoding in the same layout, which stays within the loaded model's greedy tokens here."""
    from draftsmith.models import cpu_linear
    from draftsmith.models.quantize import quantize_draft
    from draftsmith.models.verifier import weight_layouts

    from draftsmith.models import cpu_attention

    if not (cpu_linear.available() and cpu_attention.available()):
        pytest.fail("the C++ kernels do not build here")
    verifier = tiny_model(arch)
    d = _draft(verifier, vd=64)
    d.config.aux_layer_ids = [0, 1, 2]
    drafts = [d, quantize_draft(d, "int8")]
    calls = []  # the C++ attention, called from Python or inside the fused layer (llama_layer, not gemma3)
    for op in ("decode_attention", "llama_layer"):
        real = getattr(torch.ops.draftsmith, op)
        monkeypatch.setattr(torch.ops.draftsmith, op, lambda *a, real=real: calls.append(1) or real(*a))
    prompt = torch.randint(2, 128, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    loaded = generate(verifier, prompt, max_new_tokens=30, eos_token_id=[]).token_ids
    assert not calls  # outside the layout: SDPA
    with weight_layouts([verifier, *drafts], "cpp"):
        plain = generate(verifier, prompt, max_new_tokens=30, eos_token_id=[]).token_ids
        assert calls and plain == loaded
        for draft in drafts:
            prop = Eagle3Proposer(draft)
            for k in (1, 4):
                out = generate(verifier, prompt, proposer=prop, max_new_tokens=30, num_draft_tokens=k,
                               eos_token_id=[])
                assert out.token_ids == plain, (type(draft.lm_head).__name__, k)
                assert out.stats["drafts"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_bfloat16_speculative_output_is_plain_bfloat16_output_exactly_in_the_cpp_layout(arch, monkeypatch):
    """In bfloat16 a verify step's rows round differently from one-token steps' in ATen's kernels (the
    bench calls the divergences ties); inside --weight-layout cpp every Linear and the eager attention
    compute a row the same whatever the rows beside it, so speculative output is plain bfloat16
    output token for token, with an EAGLE-3 draft (as loaded and at int8, whose layers take the
    kernel's int8 form with bfloat16 activations) and a draft model at k = 1 and 4; the layout's
    kernels are in use, in bfloat16 (their calls counted)."""
    from draftsmith.models import cpu_attention, cpu_linear
    from draftsmith.models.quantize import quantize_draft
    from draftsmith.models.verifier import weight_layouts

    if not (cpu_linear.available() and cpu_attention.available()):
        pytest.fail("the C++ kernels do not build here")
    verifier = copy.deepcopy(tiny_model(arch)).to(torch.bfloat16)  # the cached one stays float32
    d = _draft(verifier, vd=64).to(torch.bfloat16)
    d.config.aux_layer_ids = [0, 1, 2]
    d8 = quantize_draft(d, "int8")
    calls: dict[str, list] = {"small_linear": [], "small_linear_i8": [], "rms_norm": []}
    for op, seen in calls.items():
        real = getattr(torch.ops.draftsmith, op)
        monkeypatch.setattr(torch.ops.draftsmith, op, lambda *a, real=real, seen=seen: seen.append(a[0].dtype) or real(*a))
    with weight_layouts([verifier, d, d8], "cpp"):
        for seed in range(2):
            prompt = torch.randint(2, 128, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
            plain = generate(verifier, prompt, max_new_tokens=30, eos_token_id=[]).token_ids
            assert calls["small_linear"] and set(calls["small_linear"]) == {torch.bfloat16}
            for prop in (Eagle3Proposer(d), Eagle3Proposer(d8), DraftModelProposer(verifier)):
                for k in (1, 4):
                    out = generate(verifier, prompt, proposer=prop, max_new_tokens=30, num_draft_tokens=k,
                                   eos_token_id=[])
                    assert out.token_ids == plain, (type(prop).__name__, k, seed)
                    assert out.stats["drafts"] > 0
    assert set(calls["small_linear_i8"]) == {torch.bfloat16} and set(calls["rms_norm"]) == {torch.bfloat16}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "llama-hd64"])
def test_cached_steps_read_rope_rows_bitwise_the_modules(arch):
    """A cached step's rope on the CPU comes from a table the rotary module computed once: bitwise the
    module's own call at every position, after the table grows, and not used under autograd."""
    from transformers import LlamaConfig

    if arch == "llama-hd64":
        verifier_config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      rope_theta=100000.0)
        d = Eagle3Draft(Eagle3Config.from_verifier(verifier_config, draft_vocab_size=64, aux_layer_ids=[0, 1, 1]))
    else:
        d = _draft(tiny_model(arch), vd=64)
    e = torch.randn(1, 3, d.config.hidden_size)
    with torch.inference_mode():
        for pos in ([0, 1, 2], [511], [700, 701, 702], [5], [3000, 3001]):
            p = torch.tensor([pos])
            got, want = d._rope_at(p, e[:, :len(pos)]), d.rope(p, e[:, :len(pos)])
            assert all(torch.equal(a, b) for a, b in zip(got, want)), pos
        assert d._rope_table[0].shape[1] >= 3002
        # the control: a neighbouring row of the table is not the position's
        assert not torch.equal(d._rope_table[0][:, 701], d.rope(torch.tensor([[700]]), e[:, :1])[0][:, 0])
    d._rope_table = None
    with torch.enable_grad():
        d._rope_at(torch.tensor([[4]]), e[:, :1])
    assert d._rope_table is None  # under autograd (training) the module itself


def test_set_vocab_offsets():
    d = _draft(tiny_model("llama"), vd=4)
    d.set_vocab(torch.tensor([3, 10, 11, 100]))
    assert d.d2t.tolist() == [3, 9, 9, 97]
    assert d.t2d.sum() == 4 and d.t2d[[3, 10, 11, 100]].all()
    assert d.draft_to_target.tolist() == [3, 10, 11, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_bitwise_the_written_out_formula_on_cpu(dtype):
    from draftsmith.models.eagle3 import RMSNorm

    torch.manual_seed(3)
    norm = RMSNorm(576, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    x = (3 * torch.randn(2, 7, 576)).to(dtype)
    xf = x.float()
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), ref)
        # negative control: another eps is not bitwise the same
        other = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert not torch.equal(norm(x), other)


# ----------------------------------------------------------------------------- early stop (min_confidence)
class _ScriptedTops(Eagle3Proposer):
    """Reports a fixed top probability per draft position instead of the draft's own; records
    (k asked, tokens proposed) per call."""

    def __init__(self, draft, tops, **kw):
        super().__init__(draft, **kw)
        self.tops, self.i, self.calls = tops, 0, []

    def propose(self, ctx, k, sampling, generator):
        self.i = 0
        out = super().propose(ctx, k, sampling, generator)
        self.calls.append((k, out.tokens.shape[0]))
        return out

    def _choose(self, logits, sampling, generator):
        tok, q, _ = super()._choose(logits, sampling, generator)
        top = self.tops[min(self.i, len(self.tops) - 1)]
        self.i += 1
        return tok, q, top


@pytest.mark.parametrize("floor, proposed", [(0.4, 3), (0.42, 2), (0.46, 1), ((0.95, 0.0), 0),
                                             ((0.5, 0.45, 0.41), 2), (0.0, 3)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_confidence_stop_counts_the_cumulative_confidence(floor, proposed, temperature):
    """Known answer: tops 0.9, 0.5, 0.9 give cumulative confidences 0.9, 0.45, 0.405; token i is
    proposed while its cumulative confidence is at least the floor of position i (the last repeats)."""
    verifier = tiny_model("llama")
    prop = _ScriptedTops(_draft(verifier, vd=64), [0.9, 0.5, 0.9], min_confidence=floor)
    out = generate(verifier, [5, 6, 7], proposer=prop, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[],
                   temperature=temperature, seed=0)
    assert prop.calls and all(got == min(proposed, k) for k, got in prop.calls)
    assert out.stats["draft_tokens"] == sum(got for _, got in prop.calls)
    assert out.stats["drafts"] == sum(got > 0 for _, got in prop.calls)


def test_confidence_floor_is_checked():
    verifier = tiny_model("llama")
    for bad in (-0.1, 1.5, (), (0.2, 2.0)):
        with pytest.raises(DraftsmithError, match="--draft-confidence"):
            Eagle3Proposer(_draft(verifier), min_confidence=bad)


class _RecordsTops(Eagle3Proposer):
    def _choose(self, logits, sampling, generator):
        tok, q, top = super()._choose(logits, sampling, generator)
        self.tops.append(top)
        return tok, q, top


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("floor", ["median", "median, then 0", 1.0])
def test_confidence_stop_keeps_greedy_output(arch, floor):
    """Stopping early changes how many tokens are verified per round, never the output: rounds with
    no draft are plain one-token steps, the others verify a shorter draft."""
    verifier = tiny_model(arch)
    d = _draft(verifier)
    d.config.aux_layer_ids = [0, 1, 2]
    prompts = [torch.randint(2, 128, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    if floor != 1.0:  # this random draft's median top probability splits the rounds
        rec = _RecordsTops(d, min_confidence=1e-9)
        rec.tops = []
        generate(verifier, prompts[0], proposer=rec, max_new_tokens=30, num_draft_tokens=1, eos_token_id=[])
        median = sorted(rec.tops)[len(rec.tops) // 2]
        floor = median if floor == "median" else (median, 0.0)
    prop = Eagle3Proposer(d, min_confidence=floor)
    empty = drafted = 0
    for prompt in prompts:
        plain = generate(verifier, prompt, max_new_tokens=30, eos_token_id=[]).token_ids
        out = generate(verifier, prompt, proposer=prop, max_new_tokens=30, num_draft_tokens=3, eos_token_id=[])
        assert out.token_ids == plain
        rounds = out.stats["verifier_forwards"] - 1
        empty += rounds - out.stats["drafts"]
        drafted += out.stats["drafts"]
    if floor == 1.0:
        assert drafted == 0  # a draft is never sure of a whole proposal: every round is a plain step
    else:
        assert empty > 0 and drafted > 0  # the floor splits the rounds (the test is not vacuous)


class _PeeksAtToken(Eagle3Proposer):
    """A wrong stop rule (negative control): it reads the sampled token, proposing token 0 only."""

    def _choose(self, logits, sampling, generator):
        tok, q, _ = super()._choose(logits, sampling, generator)
        return tok, q, 1.0 if int(tok) == 0 else 0.0


def _eagle3_sequence_counts(proposer_cls, floor, params, n):
    import numpy as np

    from test_sampling import SEQ_LEN, SEQ_V

    verifier = tiny_model("llama", seed=5, vocab=SEQ_V, scale=1.0)
    prop = proposer_cls(_draft(verifier, seed=6), min_confidence=floor)
    counts, rounds = np.zeros(SEQ_V ** SEQ_LEN), {"empty": 0, "drafted": 0}
    for i in range(n):
        out = generate(verifier, [2, 3, 1], proposer=prop, max_new_tokens=SEQ_LEN, num_draft_tokens=2,
                       temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=i,
                       eos_token_id=[])
        a, b, c = out.token_ids
        counts[(a * SEQ_V + b) * SEQ_V + c] += 1
        rounds["drafted"] += out.stats["drafts"]
        rounds["empty"] += out.stats["verifier_forwards"] - 1 - out.stats["drafts"]
    return verifier, counts, rounds


def test_confidence_stop_keeps_the_sampled_distribution():
    """Sampling with a stop rule that reads the draft's distribution only (its top probability, known
    before the token is drawn) keeps the verifier's exact joint distribution (chi-square)."""
    from test_sampling import P_THRESHOLD, SEQ_N, _chi2_pooled, _exact_sequence_dist

    from draftsmith.decoding.sampling import SamplingParams

    params = SamplingParams(1.0)
    verifier, counts, rounds = _eagle3_sequence_counts(Eagle3Proposer, 0.5, params, SEQ_N)
    assert rounds["empty"] > 0.1 * rounds["drafted"] > 0  # the floor stops some rounds, not all
    assert _chi2_pooled(counts, _exact_sequence_dist(verifier, [2, 3, 1], params)) > P_THRESHOLD


def test_confidence_stop_negative_control_rule_that_reads_the_token():
    """A stop rule that reads the sampled token biases the output; the same test catches it."""
    from test_sampling import P_THRESHOLD, SEQ_N, _chi2_pooled, _exact_sequence_dist

    from draftsmith.decoding.sampling import SamplingParams

    params = SamplingParams(1.0)
    verifier, counts, _ = _eagle3_sequence_counts(_PeeksAtToken, 0.5, params, SEQ_N)  # 2_000, as before
    assert _chi2_pooled(counts, _exact_sequence_dist(verifier, [2, 3, 1], params)) < P_THRESHOLD


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": False}, {"qk_norm": True}, {"int8": True},
                                   {"attention_bias": True}, {"attention_bias": True, "int8": True}])
def test_fused_draft_step_is_bitwise_the_modules_step(dtype, flags, monkeypatch):
    """Inside ``--weight-layout cpp`` an EAGLE-3 draft's eager step runs its layer as one ``llama_layer``
    call (calls counted) with its float or int8 weights: logits, carried hidden states and the cache's
    keys and values are bitwise the module-by-module step's, over a first step of several positions
    and a chain of one-position steps; outside the layout no fused arguments exist (the control)."""
    from draftsmith.models.quantize import quantize_draft
    from draftsmith.models.verifier import weight_layout

    flags = dict(flags)
    int8 = flags.pop("int8", False)
    d = _draft(tiny_model("llama"), vd=64, **flags).to(dtype)
    with torch.no_grad():  # norm weights and biases unlike one another (random init leaves them 1 and 0)
        for p in d.parameters():
            if p.dim() == 1 and p.is_floating_point():
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    if int8:
        d = quantize_draft(d, "int8")
    assert d.fused_args() is None
    from draftsmith.models import cpu_linear

    assert cpu_linear.available()
    real, calls = torch.ops.draftsmith.llama_layer, []
    monkeypatch.setattr(torch.ops.draftsmith, "llama_layer", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    H = d.config.hidden_size
    with weight_layout(d, "cpp"), torch.inference_mode():
        fused = d.fused_args()
        assert fused is not None and (fused[1][0] is not None) == int8
        caches = [d.new_cache(16), d.new_cache(16)]
        ids, hidden = torch.randint(0, 128, (1, 4), generator=g), torch.randn(1, 4, H, generator=g).to(dtype)
        pos = torch.arange(1, 5)[None]
        for n in range(5):
            outs = [d.step(ids, hidden, pos, c, fused=f) for c, f in zip(caches, (fused, None))]
            for c in caches:
                c.advance(ids.shape[1])
            assert all(torch.equal(a, b) for a, b in zip(*outs)), n
            if n < 3:  # a chain of one-position steps
                ids, hidden, pos = outs[0][0][:, -1:].argmax(-1), outs[0][1][:, -1:], pos[:, -1:] + 1
            else:  # then a round's first step: the 3 positions a verify accepted
                ids = torch.randint(0, 128, (1, 3), generator=g)
                hidden, pos = torch.randn(1, 3, H, generator=g).to(dtype), pos[:, -1:] + torch.arange(1, 4)
        for x, y in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
            assert torch.equal(x[:, :, :11], y[:, :, :11])
    assert len(calls) == 4  # the first step (4 positions, none cached) attends by SDPA: the module path
