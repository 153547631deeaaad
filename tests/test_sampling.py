"""Losslessness of speculative sampling: exact algebra, Monte Carlo, sequences, negative controls.

Every statistical check here is also run on deliberately broken samplers (always
accept; a softmax q for a deterministic drafter; q taken before the top-k/top-p
transform) and must reject them: a check that cannot fail proves nothing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats as sps

from conftest import tiny_model
from draftsmith import generate
from draftsmith.decoding import DraftModelProposer, SamplingParams, logits_to_probs
from draftsmith.decoding import engine as engine_mod
from draftsmith.decoding.sampling import sample
from draftsmith.decoding.verify import rejection_sample, residual_distribution

V = 8
P_THRESHOLD = 1e-4  # chi-square p-value below which a sampler is declared wrong


def _dists(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    pl, ql = torch.randn(V, generator=g, dtype=dtype) * 1.5, torch.randn(V, generator=g, dtype=dtype) * 1.5
    return pl, ql


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5),
                                    SamplingParams(1.3, top_p=0.8), SamplingParams(1.0, top_k=6, top_p=0.9)])
@pytest.mark.parametrize("seed", range(5))
def test_exact_algebra(params, seed):
    """q·min(1, p/q) + (1 − Σ min(p, q))·norm((p − q)+) = p, exactly in float64."""
    pl, ql = _dists(seed)
    p, q = logits_to_probs(pl, params), logits_to_probs(ql, params)
    accept = torch.where(q > 0, q * torch.clamp(p / q, max=1.0), torch.zeros_like(q))
    reject_mass = 1.0 - torch.minimum(p, q).sum()
    emitted = accept + reject_mass * residual_distribution(p, q)
    torch.testing.assert_close(emitted, p, rtol=0, atol=1e-14)


def test_exact_algebra_one_hot_q():
    """A deterministic drafter (one-hot q) is also exact."""
    p = logits_to_probs(_dists(0)[0], SamplingParams(1.0))
    for d in range(V):
        q = torch.zeros(V, dtype=torch.float64)
        q[d] = 1
        emitted = q * torch.clamp(p / q.clamp_min(1e-300), max=1.0) * (q > 0) \
            + (1 - torch.minimum(p, q).sum()) * residual_distribution(p, q)
        torch.testing.assert_close(emitted, p, rtol=0, atol=1e-14)


def test_transform_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    p = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p[:2].sum(), torch.tensor(1.0, dtype=torch.float64))
    full = logits.softmax(-1)
    p = logits_to_probs(logits, SamplingParams(1.0, top_p=float(full[0] + 1e-9)))
    assert (p > 0).tolist() == [True, True, False, False, False]  # smallest set reaching top_p
    assert logits_to_probs(logits, SamplingParams(0.0)).tolist() == [1, 0, 0, 0, 0]


# --------------------------------------------------------------------- Monte Carlo, one position
def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    mask = p > 0
    if counts[~mask].sum() > 0:  # a token of probability zero was emitted
        return 0.0
    return float(sps.chisquare(counts[mask], p[mask] / p[mask].sum() * counts.sum()).pvalue)


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def _correct(d, p, q, g):
    return rejection_sample(d, p, q, g)


def _always_accept(d, p, q, g):
    return d.shape[0], int(sample(p[d.shape[0]], g))


def _run_position(sampler, p1, q1, q_passed, deterministic_draft, n, seed=0):
    """Emit the first token n times: draft d ~ q1, verify with p1 (+ bonus row)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.stack([p1, p1])  # [2, V]: position 1 and the bonus position
    drafts = sample(q1.expand(n, V), g) if not deterministic_draft else torch.full((n,), int(q1.argmax()))
    counts = np.zeros(V)
    for i in range(n):
        m, tok = sampler(drafts[i : i + 1], p, q_passed, g)
        counts[int(drafts[i]) if m == 1 else tok] += 1
    return counts


# Samples per Monte Carlo test, and per negative control: each control is a wrong sampler that the same
# test must reject with no more samples than a correct one draws (100_000 / 4_000 before 2026-12-07:
# 2.5 min of the suite on an AVX2-only EPYC; the controls kept their counts).
N_MC = 50_000
N_MC_CONTROL = 25_000


@pytest.fixture(scope="module")
def mc_setup():
    params = SamplingParams(0.9, top_k=6)
    pl, ql = _dists(11, torch.float32)
    return params, logits_to_probs(pl, params), logits_to_probs(ql, params), ql


def test_monte_carlo_single_position(mc_setup):
    params, p, q, _ = mc_setup
    counts = _run_position(_correct, p, q, q[None], False, N_MC)
    pn = p.double().numpy()
    assert _chi2(counts, pn) > P_THRESHOLD
    # E[TV] <= 0.5 * sum sqrt(p(1-p)/N) <= 0.5*sqrt(V/N); allow 2x that
    assert _tv(counts, pn) < np.sqrt(V / N_MC)


def test_monte_carlo_deterministic_drafter():
    """n-gram style drafter: q is one-hot on the proposal (q=None)."""
    params = SamplingParams(1.0)
    p = logits_to_probs(_dists(3, torch.float32)[0], params)
    q_onehot = torch.zeros(V)
    q_onehot[2] = 1
    counts = _run_position(_correct, p, q_onehot, None, True, N_MC)
    assert _chi2(counts, p.double().numpy()) > P_THRESHOLD


def test_negative_control_always_accept(mc_setup):
    params, p, q, _ = mc_setup
    counts = _run_position(_always_accept, p, q, q[None], False, N_MC_CONTROL)
    assert _chi2(counts, p.double().numpy()) < P_THRESHOLD


def test_negative_control_softmax_q_for_deterministic_drafter():
    params = SamplingParams(1.0)
    pl, ql = _dists(3, torch.float32)
    p = logits_to_probs(pl, params)
    q_soft = logits_to_probs(ql, params)  # wrong: the drafter proposed argmax(ql) deterministically
    q_soft_at = q_soft.clone()
    counts = _run_position(_correct, p, q_soft_at, q_soft_at[None], True, N_MC_CONTROL)
    assert _chi2(counts, p.double().numpy()) < P_THRESHOLD


def test_negative_control_q_before_transform(mc_setup):
    params, p, q, ql = mc_setup
    q_raw = logits_to_probs(ql, SamplingParams(params.temperature))  # skipped top-k: not the shared transform
    counts = _run_position(_correct, p, q, q_raw[None], False, N_MC_CONTROL)
    assert _chi2(counts, p.double().numpy()) < P_THRESHOLD


# --------------------------------------------------------------------- sequence level
SEQ_V, SEQ_N, SEQ_LEN = 4, 2_000, 3
SEQ_N_CONTROL = 1_333  # the sequence-level controls' samples (SEQ_N // 3 before)


@pytest.fixture(scope="module")
def seq_models():
    verifier = tiny_model("llama", seed=5, vocab=SEQ_V, scale=1.0)
    draft = tiny_model("llama", seed=6, vocab=SEQ_V, scale=1.0)
    return verifier, draft


def _exact_sequence_dist(model, prompt, params):
    """P(x1..x3 | prompt) by enumeration of the verifier's conditionals."""
    probs = {}
    with torch.no_grad():
        for prefix in itertools.chain([()], ((a,) for a in range(SEQ_V)),
                                      itertools.product(range(SEQ_V), repeat=2)):
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            probs[prefix] = logits_to_probs(logits.double(), params).numpy()
    dist = np.zeros((SEQ_V,) * SEQ_LEN)
    for a, b, c in itertools.product(range(SEQ_V), repeat=3):
        dist[a, b, c] = probs[()][a] * probs[(a,)][b] * probs[(a, b)][c]
    return dist.reshape(-1)


def _sample_sequences(verifier, draft, prompt, params, n):
    counts = np.zeros(SEQ_V ** SEQ_LEN)
    proposer = DraftModelProposer(draft)
    for i in range(n):
        out = generate(verifier, prompt, proposer=proposer, max_new_tokens=SEQ_LEN, num_draft_tokens=2,
                       temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       seed=i, eos_token_id=[])
        a, b, c = out.token_ids
        counts[(a * SEQ_V + b) * SEQ_V + c] += 1
    return counts


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=4, top_p=0.9)])
def test_sequence_distribution(seq_models, params):
    """The first 3 tokens of generate(drafter) follow the verifier's exact joint distribution."""
    verifier, draft = seq_models
    prompt = [2, 3, 1]
    exact = _exact_sequence_dist(verifier, prompt, params)
    counts = _sample_sequences(verifier, draft, prompt, params, SEQ_N)
    assert _chi2_pooled(counts, exact) > P_THRESHOLD


def _chi2_pooled(counts, p, min_expected=5.0):
    """Chi-square with rare cells pooled (keeps the asymptotics valid)."""
    if counts[p == 0].sum() > 0:
        return 0.0
    exp = p * counts.sum()
    big = exp >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    return float(sps.chisquare(obs[keep], ex[keep] * obs[keep].sum() / ex[keep].sum()).pvalue)


def test_sequence_negative_control_always_accept(seq_models, monkeypatch):
    verifier, draft = seq_models
    params = SamplingParams(1.0)
    # the engine's device-side verification, replaced by one that accepts every draft
    monkeypatch.setattr(engine_mod, "rejection_verify", lambda d, p, q, g: torch.tensor(_always_accept(d, p, q, g)))
    prompt = [2, 3, 1]
    exact = _exact_sequence_dist(verifier, prompt, params)
    counts = _sample_sequences(verifier, draft, prompt, params, SEQ_N_CONTROL)
    assert _chi2_pooled(counts, exact) < P_THRESHOLD
