"""Subprocess for tests/test_pipeline.py: a pipeline run that is killed at a chosen point.

usage: pipeline_worker.py CONFIG.yaml [capture|train|bench] [INT|KILL|TERM]
Kills itself with the signal right after the 2nd shard (capture), the 2nd
checkpoint (train) or the 1st prompt every bench row timed (bench) is durably
written: the worst moment a real kill can hit.
"""

import os
import signal
import sys

from draftsmith.cli import main

config, where, sig = (sys.argv[1:] + [None, None])[:3]
# A process started in the background of a non-interactive shell (CI scripts, nohup ... &)
# inherits SIGINT as *ignored*, and Python then never raises KeyboardInterrupt. Ctrl-C in a
# terminal is what this test stands for, so restore that.
signal.signal(signal.SIGINT, signal.default_int_handler)
if where:
    count = {"n": 0}
    signum = getattr(signal, f"SIG{sig}")

    def after(fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            count["n"] += 1
            if count["n"] == (1 if where == "bench" else 2):
                os.kill(os.getpid(), signum)
            return out
        return wrapped

    if where == "capture":
        from draftsmith.data import capture

        capture.write_shard = after(capture.write_shard)
    elif where == "bench":
        from draftsmith.bench import resume

        resume.Checkpoint.add_unit = after(resume.Checkpoint.add_unit)
    else:
        from draftsmith.train import loop

        loop.atomic_write_bytes = after(loop.atomic_write_bytes)  # the loop writes bytes only for checkpoints
sys.exit(main(["pipeline", "run", config]))
