"""Proposers from what a user names: a drafter spec string (the CLI's ``--drafter``) or a draft directory."""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.decoding.cross_tokenizer import CrossTokenizerProposer
from draftsmith.decoding.proposers import DraftModelProposer, Eagle3Proposer, NgramProposer, Proposer
from draftsmith.errors import DraftsmithError
from draftsmith.models.quantize import quantize_draft
from draftsmith.models.speculators import read_config, read_draft, validate_against_verifier
from draftsmith.models.verifier import text_config

DRAFTER_HELP = ("ngram | ngram:MAX_N | model:SPEC (a smaller LM; with another tokenizer than the verifier's it "
                "drafts through text) | a draft directory (EAGLE-3, speculators format)")


def same_tokenizer(draft_tokenizer: object, verifier_tokenizer: object) -> bool:
    """Whether two tokenizers map every token to the same id."""
    return draft_tokenizer.get_vocab() == verifier_tokenizer.get_vocab()


def build_proposer(spec: str | None, verifier: torch.nn.Module, tokenizer: object,
                   dtype: str | torch.dtype | None = "auto", draft_precision: str = "as-loaded") -> Proposer | None:
    """Turn ``--drafter`` text into a proposer for ``verifier`` (None: plain decoding).

    ``draft_precision`` applies to an EAGLE-3 draft directory (:func:`load_draft`)."""
    if spec is None or spec in {"", "none"}:
        return None
    if draft_precision != "as-loaded" and not Path(spec).is_dir():
        raise DraftsmithError(f"--draft-precision {draft_precision} applies to an EAGLE-3 draft directory, "
                              f"not to --drafter {spec!r}")
    if spec == "ngram" or spec.startswith("ngram:"):
        max_n = spec.partition(":")[2]
        if max_n and not max_n.isdigit():
            raise DraftsmithError(f"--drafter {spec!r}: expected ngram:MAX_N with an integer MAX_N")
        return NgramProposer(max_ngram=int(max_n)) if max_n else NgramProposer()
    if spec.startswith("model:"):
        from draftsmith.models.verifier import load_verifier

        device = next(verifier.parameters()).device
        try:
            draft, draft_tok, _ = load_verifier(spec[len("model:"):], dtype=dtype, device=device)
        except DraftsmithError as e:  # its message names the model a "verifier"
            raise DraftsmithError(f"--drafter {spec!r}: the draft model: {e}") from None
        if same_tokenizer(draft_tok, tokenizer):
            proposer: Proposer = DraftModelProposer(draft)
        else:  # Universal Assisted Generation: the draft's text re-encoded into the verifier's tokens
            proposer = CrossTokenizerProposer(draft, draft_tok, tokenizer)
        proposer.check_compatible(verifier)
        return proposer
    if Path(spec).is_dir():
        return load_draft(spec, verifier, precision=draft_precision)
    if "/" in spec or spec.startswith("."):
        raise DraftsmithError(f"--drafter {spec!r}: no such directory (an EAGLE-3 draft directory; or {DRAFTER_HELP})")
    raise DraftsmithError(f"unknown --drafter {spec!r}; expected {DRAFTER_HELP}")


def load_draft(path: str | Path, verifier: torch.nn.Module, precision: str = "as-loaded") -> Eagle3Proposer:
    """Load a speculators-format EAGLE-3 draft for ``verifier``; return its proposer.

    The draft is validated against the verifier (hidden size, vocabulary, layer
    ids), put on its device and dtype, and given the verifier's input embedding
    when the file carries none. ``precision`` ``int8`` (CPU) multiplies its layer and
    head by int8 weights (:func:`draftsmith.models.quantize.quantize_draft`).
    """
    vc = text_config(verifier)
    cfg, _ = read_config(path, verifier_layers=vc.num_hidden_layers)
    validate_against_verifier(cfg, verifier, what=f"draft {str(path)!r}")
    p = next(verifier.parameters())
    draft = read_draft(path, device=p.device, dtype=p.dtype if p.is_floating_point() else None,
                       verifier_layers=vc.num_hidden_layers)
    if draft.embed_tokens_from_verifier:
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(verifier.get_input_embeddings().weight)
    proposer = Eagle3Proposer(quantize_draft(draft, precision))
    proposer.check_compatible(verifier)
    return proposer
