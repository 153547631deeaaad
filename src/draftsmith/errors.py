"""User-facing errors.

Anything raised as a :class:`DraftsmithError` is a problem with the user's input
or environment (a bad spec, a missing file, a foreign shard). The CLI prints it
as one line and exits non-zero; everything else is a bug and keeps its traceback.
"""


class DraftsmithError(Exception):
    """A problem the user can fix; the message says what and how."""


class GateFailed(DraftsmithError):
    """The draft was measured and did not pay off (not an error in the run)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``kill``, Kubernetes and batch schedulers send before SIGKILL), raised as an
    interrupt so every step takes its Ctrl-C path: checkpoint, partial report, clean exit."""


def interruption(e: BaseException) -> str:
    """How a run was stopped, for its messages and partial reports."""
    return "interrupted (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)"
