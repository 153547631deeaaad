"""Random EAGLE-3 drafts and tiny saved verifiers for the export and interop tests."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import tiny_model
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Draft

LAYERS = 8  # aux ids [2, n//2, n-3] = [2, 4, 5]: speculators wants them distinct
VOCAB = 128
DRAFT_VOCAB = 48


def tiny_verifier(seed: int = 0, layers: int = LAYERS, vocab: int = VOCAB):
    return tiny_model("llama", seed=seed, vocab=vocab, layers=layers)


def save_verifier(model, path: Path) -> Path:
    """Save a verifier as a local HF directory (what config.json's name_or_path can point at)."""
    if not (path / "config.json").is_file():
        model.save_pretrained(path)
    return path


def random_draft(verifier, vd: int | None = DRAFT_VOCAB, seed: int = 0, aux_layer_ids=None,
                 **flags) -> Eagle3Draft:
    """A draft whose every tensor (norm weights included) is random, so each flag matters."""
    cfg = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=vd or verifier.config.vocab_size,
                                     aux_layer_ids=aux_layer_ids, **flags)
    g = torch.Generator().manual_seed(seed)
    d = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    V = cfg.vocab_size
    if cfg.draft_vocab_size < V:
        ids = torch.randperm(V, generator=g)[: cfg.draft_vocab_size].sort().values
        d.set_vocab(ids)
    return d.eval()


def ttt_inputs(cfg: Eagle3Config, L: int = 12, seed: int = 0):
    """aux [1, L, A*H], ids [1, L], positions 1..L, causal mask: speculators' forward defaults."""
    g = torch.Generator().manual_seed(seed)
    A, Ht = len(cfg.aux_layer_ids), cfg.verifier_hidden_size
    aux = torch.randn(1, L, A * Ht, generator=g) * 2.0
    ids = torch.randint(0, cfg.vocab_size, (1, L), generator=g)
    pos = torch.arange(1, L + 1)[None]
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None]
    return aux, ids, pos, mask
