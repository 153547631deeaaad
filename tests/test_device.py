"""Device tests: the decode loop, the EAGLE-3 draft, sampling and training on the best device here.

On a CUDA machine (``benchmarks/gpu_check.sh``) these run on the GPU in bfloat16 and
float32; on a CPU they run on the CPU, so CI covers the same code paths. Nothing in
them names a device or a dtype except through the ``device`` fixture.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import perturbed_copy, tiny_model, verifier_samples
from draft_factory import random_draft
from draftsmith import generate
from draftsmith.bench.verdict import compare_outputs, count_kinds, model_scorer
from draftsmith.decoding import DraftModelProposer, NgramProposer
from draftsmith.decoding.sampling import SamplingParams, logits_to_probs
from draftsmith.decoding.verify import rejection_sample

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    return copy.deepcopy(model).to(device=device, dtype=dtype).eval()


def _prompts(n: int, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (10,), generator=g).tolist() * 2 for _ in range(n)]


def test_greedy_float32_identical_for_every_drafter(device):
    base = tiny_model("llama", layers=8)
    verifier = _on(base, device, torch.float32)
    drafters = {"perfect": DraftModelProposer(verifier),
                "partial": DraftModelProposer(_on(perturbed_copy(base, 0.05), device, torch.float32)),
                "random": DraftModelProposer(_on(tiny_model("llama", seed=5), device, torch.float32)),
                "ngram": NgramProposer()}
    for p in _prompts(3):
        plain = generate(verifier, p, max_new_tokens=32, eos_token_id=[]).token_ids
        for name, d in drafters.items():
            out = generate(verifier, p, proposer=d, max_new_tokens=32, num_draft_tokens=4, eos_token_id=[])
            assert out.token_ids == plain, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eagle3_draft_outputs_equal_up_to_ties(device, dtype):
    """A random EAGLE-3 draft on the device: outputs equal plain decoding, up to ties in bfloat16."""
    from draftsmith.drafters import load_draft
    from draftsmith.export import save_draft

    base = tiny_model("llama", layers=8)
    verifier = _on(base, device, dtype)
    score = model_scorer(verifier)
    score32 = model_scorer(_on(base, device, torch.float32))
    verdicts = []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        save_draft(random_draft(base), tmp, num_draft_tokens=3)
        proposer = load_draft(tmp, verifier)
        for p in _prompts(4):
            plain = generate(verifier, p, max_new_tokens=24, eos_token_id=[]).token_ids
            spec = generate(verifier, p, proposer=proposer, max_new_tokens=24, num_draft_tokens=3, eos_token_id=[])
            assert spec.stats["drafts"] > 0
            verdicts.append(compare_outputs(p, plain, spec.token_ids, score=score, dtype=dtype, score_float32=score32))
    kinds = count_kinds(verdicts)
    assert kinds["mismatch"] == 0, verdicts
    if dtype == torch.float32:
        assert kinds["identical"] == len(verdicts)


def test_compiled_eagle3_rounds_equal_eager_plain_decoding(device):
    """``--compile`` on the device (CUDA graphs on a GPU, in bfloat16 as served there; the CPU's tiers,
    float32, here): an EAGLE-3 draft at k = 3 gives plain eager decoding's tokens up to ties, and a
    second request compiles nothing (every verify and draft length was warmed before the first one's
    clock started)."""
    from draftsmith.drafters import load_draft
    from draftsmith.export import save_draft

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = tiny_model("llama", layers=8)
    verifier = _on(base, device, dtype)
    score, score32 = model_scorer(verifier), model_scorer(_on(base, device, torch.float32))
    import tempfile

    verdicts, compiles = [], []
    with tempfile.TemporaryDirectory() as tmp:
        save_draft(random_draft(base), tmp, num_draft_tokens=3)
        proposer = load_draft(tmp, verifier)
        for p in _prompts(2):
            plain = generate(verifier, p, max_new_tokens=24, eos_token_id=[]).token_ids
            spec = generate(verifier, p, proposer=proposer, max_new_tokens=24, num_draft_tokens=3, eos_token_id=[],
                            compile=True)
            assert spec.stats["drafts"] > 0
            compiles.append(spec.stats["compile_seconds"])
            verdicts.append(compare_outputs(p, plain, spec.token_ids, score=score, dtype=dtype, score_float32=score32))
    kinds = count_kinds(verdicts)
    assert kinds["mismatch"] == 0, verdicts
    if dtype == torch.float32:
        assert kinds["identical"] == len(verdicts)
    assert compiles[0] > 0 and compiles[1] == 0, compiles


def test_rejection_sampling_distribution_on_device(device):
    """One position, 20k chains of one drafted token: the emitted token follows p (TV < 0.02; the
    expected TV at this N is ~0.008)."""
    g = torch.Generator(device=device).manual_seed(0)
    V, N = 8, 20_000
    p = torch.softmax(torch.randn(2, V, device=device, generator=g), -1)
    q = torch.softmax(torch.randn(1, V, device=device, generator=g), -1)
    counts = torch.zeros(V, device=device)
    for d in torch.multinomial(q[0], N, replacement=True, generator=g).tolist():
        n, tok = rejection_sample(torch.tensor([d], device=device), p, q, g)
        counts[d if n == 1 else tok] += 1
    freq = counts / counts.sum()
    assert float((freq - p[0]).abs().sum() / 2) < 0.02
    # negative control: always accepting the draft gives q, not p
    assert float((q[0] - p[0]).abs().sum() / 2) > 0.05


def test_sampling_transform_on_device(device):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0], device=device)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs.device.type == device.type and float(probs[2:].sum()) == 0.0
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_steps_on_device(tmp_path, device, precision):
    from draftsmith.train.loop import TrainConfig, train

    verifier = tiny_model("llama", layers=4)
    samples = verifier_samples(verifier, 4, gen_len=24, aux_layer_ids=(1, 2, 3))
    cfg = TrainConfig(verifier="tiny", out=str(tmp_path / "run"), draft_vocab_size=96, pack_tokens=64, lr=3e-3,
                      val_fraction=0.0, eval_every=1000, checkpoint_every=1000, precision=precision, ttt_steps=3,
                      warmup_ratio=0.0, epochs=20, device=str(device))
    res = train(cfg, samples=samples, verifier=verifier, fingerprint="tinyfp", aux_layer_ids=[1, 2, 3],
                progress=False)
    import json
    from pathlib import Path

    first = json.loads(open(Path(cfg.out) / "metrics.jsonl").readline())
    assert res.metrics["loss"] < 0.7 * first["loss"]
    assert (res.draft_dir / "model.safetensors").is_file()
