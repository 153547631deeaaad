"""torchrun worker for tests/test_train.py: train on 2 ranks, save each rank's weights."""

import os
import sys
from pathlib import Path

import torch

from conftest import tiny_model, verifier_samples
from draftsmith.train import loop as loop_mod
from draftsmith.train.loop import TrainConfig, train

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
verifier = tiny_model("llama", layers=4)
samples = verifier_samples(verifier, 6, gen_len=30, aux_layer_ids=(1, 2, 3))
real_build = loop_mod.build_draft


def build_and_record(*a, **k):
    d = real_build(*a, **k)
    if rank == 0:
        torch.save({k: v.clone() for k, v in d.state_dict().items()}, out / "init.pt")
    return d


loop_mod.build_draft = build_and_record
cfg = TrainConfig(verifier="tiny", out=str(out / "run"), draft_vocab_size=96, pack_tokens=64, lr=3e-3,
                  val_fraction=0.0, eval_every=1000, checkpoint_every=1000, precision="fp32", epochs=3,
                  device="cpu")
res = train(cfg, samples=samples, verifier=verifier, fingerprint="tinyfp", aux_layer_ids=[1, 2, 3], progress=False)
torch.save({k: v.clone() for k, v in res.draft.state_dict().items()}, out / f"rank{rank}.pt")

# --target-minutes: each rank's (fake) clock runs at its own speed, 2 s and 5 s a step; every rank
# follows rank 0's re-fit, or the ranks would part at a collective
import json  # noqa: E402
import types  # noqa: E402

clock = [0.0]
real_collate = loop_mod.collate


def timed_collate(*a, **k):
    clock[0] += 2.0 if rank == 0 else 5.0
    return real_collate(*a, **k)


loop_mod.collate = timed_collate
loop_mod.time = types.SimpleNamespace(perf_counter=lambda: clock[0])
timed = TrainConfig(verifier="tiny", out=str(out / "timed"), draft_vocab_size=96, pack_tokens=64, lr=3e-3,
                    val_fraction=0.0, eval_every=1000, checkpoint_every=1000, precision="fp32", epochs=20,
                    target_minutes=0.5, device="cpu")
res = train(timed, samples=samples, verifier=verifier, fingerprint="tinyfp", aux_layer_ids=[1, 2, 3], progress=False)
(out / f"timed{rank}.json").write_text(json.dumps({"steps": res.steps, "fits": res.metrics["fits"]}))
