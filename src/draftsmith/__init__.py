"""draftsmith: train, verify and export EAGLE-3 speculative-decoding drafts for your own LLM."""

__version__ = "0.1.0"

from draftsmith.decoding.engine import GenerationOutput, generate  # noqa: E402
from draftsmith.drafters import load_draft  # noqa: E402
from draftsmith.errors import DraftsmithError  # noqa: E402
from draftsmith.export import save_draft  # noqa: E402
from draftsmith.models.speculators import read_draft  # noqa: E402
from draftsmith.models.verifier import fingerprint, load_verifier  # noqa: E402

__all__ = ["DraftsmithError", "GenerationOutput", "__version__", "fingerprint", "generate", "load_draft", "load_verifier",
           "read_draft", "save_draft"]
