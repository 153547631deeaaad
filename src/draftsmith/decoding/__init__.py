"""Speculative decoding: shared sampling transform, verification, drafters, engine."""

from draftsmith.decoding.cross_tokenizer import CrossTokenizerProposer
from draftsmith.decoding.engine import GenerationOutput, generate
from draftsmith.decoding.proposers import (DraftContext, DraftModelProposer, Eagle3Proposer, NgramProposer, Proposal,
                                          Proposer)
from draftsmith.decoding.sampling import SamplingParams, logits_to_probs

__all__ = ["CrossTokenizerProposer", "DraftContext", "DraftModelProposer", "Eagle3Proposer", "GenerationOutput", "NgramProposer", "Proposal",
           "Proposer", "SamplingParams", "generate", "logits_to_probs"]
