"""Build a proposer from a drafter spec string (the CLI's ``--drafter``)."""

from __future__ import annotations

import torch

from draftsmith.decoding.proposers import DraftModelProposer, NgramProposer, Proposer
from draftsmith.errors import DraftsmithError

DRAFTER_HELP = ("ngram | ngram:MAX_N | model:SPEC (a smaller LM with the same tokenizer) "
                "| a draft directory (EAGLE-3, speculators format)")


def check_same_tokenizer(draft_tokenizer: object, verifier_tokenizer: object, what: str) -> None:
    """Raise if two tokenizers map tokens to different ids."""
    if draft_tokenizer.get_vocab() != verifier_tokenizer.get_vocab():
        raise DraftsmithError(f"{what} uses a different tokenizer than the verifier; "
                              "drafts must share the verifier's vocabulary")


def build_proposer(spec: str | None, verifier: torch.nn.Module, tokenizer: object,
                   dtype: str | torch.dtype | None = "auto") -> Proposer | None:
    """Turn ``--drafter`` text into a proposer for ``verifier`` (None: plain decoding)."""
    if spec is None or spec in {"", "none"}:
        return None
    if spec == "ngram" or spec.startswith("ngram:"):
        max_n = spec.partition(":")[2]
        if max_n and not max_n.isdigit():
            raise DraftsmithError(f"--drafter {spec!r}: expected ngram:MAX_N with an integer MAX_N")
        return NgramProposer(max_ngram=int(max_n)) if max_n else NgramProposer()
    if spec.startswith("model:"):
        from draftsmith.models.verifier import load_verifier

        device = next(verifier.parameters()).device
        draft, draft_tok, _ = load_verifier(spec[len("model:"):], dtype=dtype, device=device)
        check_same_tokenizer(draft_tok, tokenizer, f"draft model {spec[6:]!r}")
        proposer = DraftModelProposer(draft)
        proposer.check_compatible(verifier)
        return proposer
    from pathlib import Path

    if Path(spec).is_dir():
        from draftsmith.export import load_draft

        return load_draft(spec, verifier)
    raise DraftsmithError(f"unknown --drafter {spec!r}; expected {DRAFTER_HELP}")
