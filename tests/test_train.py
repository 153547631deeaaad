"""Training: packing/mask alignment, overfitting, resume, DDP, warm start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model, verifier_samples
from draftsmith.train import loop as loop_mod
from draftsmith.train.loop import TrainConfig, train
from draftsmith.train.loss import step_mask
from draftsmith.train.packing import collate, pack_rows

AUX = [1, 2, 3]


def _verifier():
    return tiny_model("llama", layers=4)


@pytest.fixture(scope="module")
def samples():
    return verifier_samples(_verifier(), 6, gen_len=30, aux_layer_ids=tuple(AUX))


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(verifier="tiny", out=str(tmp_path / "run"), draft_vocab_size=96, pack_tokens=64, lr=3e-3,
                val_fraction=0.0, eval_every=1000, checkpoint_every=1000, precision="fp32", ttt_steps=3,
                warmup_ratio=0.0)
    base.update(kw)
    return TrainConfig(**base)


def _train(cfg, samples, **kw):
    return train(cfg, samples=samples, verifier=_verifier(), fingerprint="tinyfp", aux_layer_ids=AUX,
                 progress=False, **kw)


def test_packing_alignment_by_hand():
    """Two documents of 5 and 4 tokens: positions, targets and masks computed by hand."""
    s1 = {"input_ids": torch.tensor([10, 11, 12, 13, 14]), "loss_mask": torch.tensor([0, 0, 1, 1, 1]).bool(),
          "aux": torch.arange(5.0)[:, None].repeat(1, 3), "last": torch.arange(100.0, 105.0)[:, None]}
    s2 = {"input_ids": torch.tensor([20, 21, 22, 23]), "loss_mask": torch.tensor([0, 1, 1, 1]).bool(),
          "aux": torch.arange(5.0, 9.0)[:, None].repeat(1, 3), "last": torch.arange(200.0, 204.0)[:, None]}
    rows = pack_rows([s1, s2], [0, 1], pack_tokens=16)
    assert rows == [[0, 1]]
    b = collate([s1, s2], rows[0], 16)
    assert b.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23]]          # x_{t+1}
    assert b.position_ids.tolist() == [[1, 2, 3, 4, 1, 2, 3]]              # restart per document
    assert b.doc.tolist() == [[0, 0, 0, 0, 1, 1, 1]]
    assert b.next_tokens.tolist() == [[12, 13, 14, -1, 22, 23, -1]]        # x_{t+2}
    assert b.mask.tolist() == [[True, True, True, False, True, True, False]]  # x_{t+2} is assistant
    assert b.aux[0, :, 0].tolist() == [0, 1, 2, 3, 5, 6, 7]               # g_t
    assert b.last[0, :, 0].tolist() == [101, 102, 103, 104, 201, 202, 203]  # verifier at t+1
    assert b.attn_mask[0, 4].tolist() == [False] * 4 + [True] + [False] * 2
    # step 1 shifts by one inside each document; step 2 likewise
    assert step_mask(b.mask, b.doc, 1).tolist() == [[True, True, False, False, True, False, False]]
    assert step_mask(b.mask, b.doc, 2).tolist() == [[True, False, False, False, False, False, False]]
    # packing respects the budget: 4 + 3 positions do not fit in 5
    assert pack_rows([s1, s2], [0, 1], pack_tokens=5) == [[0], [1]]


def test_simulated_acceptance_counts_only_chains_inside_a_reply():
    """Chains of K = 3 steps, counted by hand: none may start in the prompt or cross a user turn."""
    def sample(ids, lm):
        n = len(ids)
        return {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(lm).bool(),
                "aux": torch.zeros(n, 3), "last": torch.zeros(n, 1)}

    # A: 4 prompt tokens, then a reply of 4. B: a reply of 2, a user turn of 2, a reply of 3.
    a = sample([10, 11, 12, 13, 14, 15, 16, 17], [0, 0, 0, 0, 1, 1, 1, 1])
    b = sample([20, 21, 22, 23, 24, 25, 26, 27, 28], [0, 0, 1, 1, 0, 0, 1, 1, 1])
    batch = collate([a, b], [0, 1], 32)
    assert batch.mask.tolist() == [[False, False, True, True, True, True, False] +
                                   [True, True, False, False, True, True, True, False]]
    # chains whose three targets x_{t+2}, x_{t+3}, x_{t+4} are all reply tokens: A at t = 2, 3; B at t = 4
    expect = [False, False, True, True, False, False, False] + [False] * 4 + [True] + [False] * 3
    assert loop_mod.chain_mask(batch, 3).tolist() == [expect]
    # a draft that always guesses right (identity vocabulary) is accepted at every step of those 3 chains
    V = 40
    d2t = torch.arange(V)
    nxt = batch.next_tokens.clamp(min=0)

    def perfect(j):
        return torch.nn.functional.one_hot(torch.cat([nxt[:, j:], torch.zeros_like(nxt[:, :j])], 1), V).float()

    acc, count = loop_mod.simulated_acceptance([perfect(j) for j in range(3)], batch, d2t)
    assert int(count) == 3 and acc.tolist() == [3, 3, 3]
    # negative control: a miss at step 1 of A's first chain (t = 2) stops that chain from step 1 on
    wrong = perfect(1)
    wrong[0, 2] = torch.nn.functional.one_hot(torch.tensor(0), V).float()
    acc, count = loop_mod.simulated_acceptance([perfect(0), wrong, perfect(2)], batch, d2t)
    assert int(count) == 3 and acc.tolist() == [3, 2, 2]


def test_overfits_fixed_batch(tmp_path, samples):
    """The draft can memorise one tiny batch: loss falls to near zero, accuracy to ~1."""
    cfg = _cfg(tmp_path, epochs=300, lr=3e-3, step_weight=1.0)
    res = _train(cfg, samples[:1])
    m = res.metrics
    first = json.loads(open(Path(cfg.out) / "metrics.jsonl").readline())
    assert m["loss"] < 0.05 * first["loss"]
    assert m["step_loss"][0] < 0.05
    assert min(m["step_acc"]) > 0.95


def test_resume_reproduces_uninterrupted_run(tmp_path, samples, monkeypatch):
    full = _cfg(tmp_path / "a", epochs=6, checkpoint_every=2)
    _train(full, samples)
    ref = torch.load(sorted((Path(full.out) / "checkpoints").glob("step-*.pt"))[-1], weights_only=False)

    cut = _cfg(tmp_path / "b", epochs=6, checkpoint_every=2)
    calls = {"n": 0}
    real = loop_mod.collate

    def interrupting(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(loop_mod, "collate", interrupting)
    with pytest.raises(KeyboardInterrupt):
        _train(cut, samples)
    assert (Path(cut.out) / "training.png").is_file()  # the interrupted run's curves, drawn on the way out
    monkeypatch.setattr(loop_mod, "collate", real)
    _train(cut, samples)
    got = torch.load(sorted((Path(cut.out) / "checkpoints").glob("step-*.pt"))[-1], weights_only=False)
    assert got["step"] == ref["step"]
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    # the curves of the resumed run are the uninterrupted run's
    from draftsmith.train.curves import read_metrics

    a, b = read_metrics(Path(cut.out) / "metrics.jsonl"), read_metrics(Path(full.out) / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b])


def test_training_curves_draw_a_step_logged_twice_once(tmp_path):
    """After kill -9 the resumed run logs again the steps after its last checkpoint: the later records
    are the ones drawn, the abandoned attempt's beyond them dropped; a torn last line (the kill
    mid-write) is skipped."""
    from draftsmith.train.curves import plot_training, read_metrics

    recs = [{"step": 1, "loss": 3.0, "step_acc": [0.1, 0.0]}, {"step": 2, "loss": 2.0, "step_acc": [0.2, 0.1]},
            {"step": 2, "loss": 1.5, "step_acc": [0.3, 0.1], "val_acceptance_length": 1.4, "val_k": 2},
            {"step": 3, "loss": 1.0, "step_acc": [0.4, 0.2]}, {"step": 4, "loss": 0.9, "step_acc": [0.4, 0.2]},
            # killed after step 4, resumed from the checkpoint of step 2, stopped after step 3 (--max-minutes):
            # the abandoned step 4 is not the run's
            {"step": 3, "loss": 1.1, "step_acc": [0.4, 0.2], "val_acceptance_length": 1.5, "val_k": 2}]
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "lo')
    assert [(r["step"], r["loss"]) for r in read_metrics(f)] == [(1, 3.0), (2, 1.5), (3, 1.1)]
    assert plot_training(f, tmp_path / "t.png", "x").read_bytes()[:4] == b"\x89PNG"


def test_resume_refuses_other_config(tmp_path, samples):
    cfg = _cfg(tmp_path, epochs=1)
    _train(cfg, samples)
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="different configuration"):
        _train(_cfg(tmp_path, epochs=1, lr=1e-4), samples)


def test_draft_mlp_width_option(tmp_path, samples):
    """--draft-intermediate-size widens the draft's MLP, survives save/load, and is part of the config
    hash (a checkpoint of the default width does not resume at another width)."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.speculators import read_draft

    cfg = _cfg(tmp_path, epochs=1, draft_intermediate_size=80)
    res = _train(cfg, samples)
    assert res.draft.layers[0].mlp.gate_proj.weight.shape[0] == 80 != _verifier().config.intermediate_size
    again = read_draft(Path(cfg.out) / "draft", device="cpu", dtype=torch.float32)
    assert again.config.intermediate_size == 80
    assert loop_mod._config_hash(cfg) != loop_mod._config_hash(_cfg(tmp_path, epochs=1))
    with pytest.raises(DraftsmithError, match="different configuration"):
        _train(_cfg(tmp_path, epochs=1), samples)


def test_validation_acceptance_improves(tmp_path, samples):
    """Validation acceptance is measured during training and the best checkpoint is the one kept.

    A random tiny verifier's continuations cannot be generalised from four samples, so the
    validation rows here are copies of training rows: what is learned shows up on them.
    """
    cfg = _cfg(tmp_path, epochs=15, val_fraction=0.3, eval_every=10)
    res = _train(cfg, samples * 3)
    lines = [json.loads(x) for x in open(Path(cfg.out) / "metrics.jsonl")]
    vals = [r["val_acceptance_length"] for r in lines if "val_acceptance_length" in r]
    assert len(vals) >= 3 and max(vals) > vals[0] + 0.5, vals
    assert res.best_acceptance_length == max(vals)
    assert (Path(cfg.out) / "draft" / "config.json").is_file()
    png = Path(res.metrics["plot"])
    assert png == Path(cfg.out) / "training.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from draftsmith.train.curves import plot_training

    (tmp_path / "empty.jsonl").write_text("")
    assert plot_training(tmp_path / "empty.jsonl", tmp_path / "none.png") is None  # nothing trained: no picture
    assert not (tmp_path / "none.png").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun gloo test needs linux")
def test_torchrun_two_ranks_identical(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1] / "src")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           str(Path(__file__).parent / "ddp_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    w0 = torch.load(tmp_path / "rank0.pt")
    w1 = torch.load(tmp_path / "rank1.pt")
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    # the weights moved (training happened)
    assert not torch.equal(w0["fc.weight"], torch.load(tmp_path / "init.pt")["fc.weight"])
    # --target-minutes: 30 s at rank 0's 2 s a step is 15 steps on both ranks (rank 1's clock says 6)
    t0, t1 = (json.loads((tmp_path / f"timed{r}.json").read_text()) for r in (0, 1))
    assert t0 == t1 and t0["steps"] == 15 and t0["fits"][0]["seconds_per_step"] == 2.0


def test_train_lm_head_option(tmp_path, samples):
    """The lm_head stays the verifier's rows unless --train-lm-head; with it, the rows move, the
    draft on disk carries them, and the option is part of the config hash."""
    from draftsmith.models.speculators import read_draft

    def rows(d):
        return _verifier().get_output_embeddings().weight[d.draft_to_target].float()

    frozen = _train(_cfg(tmp_path / "a", epochs=1), samples).draft
    torch.testing.assert_close(frozen.lm_head.weight, rows(frozen))
    cfg = _cfg(tmp_path / "b", epochs=1, train_lm_head=True)
    res = _train(cfg, samples)
    assert (res.draft.lm_head.weight - rows(res.draft)).abs().max() > 1e-3
    saved = read_draft(Path(cfg.out) / "draft", device="cpu", dtype=torch.float32)
    assert (saved.lm_head.weight - rows(saved)).abs().max() > 1e-3
    assert loop_mod._config_hash(cfg) != loop_mod._config_hash(_cfg(tmp_path / "b", epochs=1))


def test_config_hash_is_what_changes_the_result():
    """A checkpoint resumes only into a run whose result it belongs to: each result setting changes
    the config hash; logging cadence, device and output path do not; one data directory hashes
    alike given as a string or as a one-item list."""
    import dataclasses

    base = TrainConfig(verifier="v", data="d")
    h = loop_mod._config_hash
    assert h(base) == h(TrainConfig(verifier="v", data=["d"]))
    assert h(base) == h(dataclasses.replace(base, eval_every=7, checkpoint_every=3, device="cpu", out="o"))
    changed = {"verifier": "w", "data": ["d", "e"], "draft_vocab_size": 8, "draft_intermediate_size": 64,
               "ttt_steps": 5, "step_weight": 0.5, "epochs": 2.0, "max_steps": 9, "lr": 3e-4, "weight_decay": 0.1,
               "warmup_ratio": 0.1, "min_lr_ratio": 0.5, "grad_clip": 0.5, "pack_tokens": 512, "grad_accum": 2,
               "val_fraction": 0.1, "init_from": "i", "vocab_data": ["d"], "train_lm_head": True,
               "precision": "fp32", "seed": 1}
    for name, value in changed.items():
        assert h(dataclasses.replace(base, **{name: value})) != h(base), name
    warm = dataclasses.replace(base, init_from="i")
    assert h(dataclasses.replace(warm, extend_vocab=True)) != h(warm)


def test_grow_vocab_by_hand():
    """Kept ids stay, then the most frequent missing ids join (ties: lower id first)."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.vocab import grow_vocab

    counts = torch.tensor([0, 5, 3, 0, 9, 1, 5, 0])
    assert grow_vocab(counts, torch.tensor([0, 3]), 4).tolist() == [0, 1, 3, 4]
    assert grow_vocab(counts, torch.tensor([0, 3]), 5).tolist() == [0, 1, 3, 4, 6]  # 1 and 6 tie at 5
    assert grow_vocab(counts, torch.tensor([0, 3]), 2).tolist() == [0, 3]
    with pytest.raises(DraftsmithError, match="can only be extended"):
        grow_vocab(counts, torch.tensor([0, 3, 5]), 2)


def test_extend_vocab_warm_start(tmp_path, samples):
    """--extend-vocab grows a warm-started draft's vocabulary: the old tokens keep their logits
    exactly, the new rows are the verifier's, and the grown draft trains and saves."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.speculators import read_draft
    from draftsmith.models.vocab import grow_vocab, token_counts

    base = _train(_cfg(tmp_path / "a", epochs=1, draft_vocab_size=40), samples)
    old = read_draft(Path(base.draft_dir), device="cpu", dtype=torch.float32)
    counts = token_counts(samples, 128)
    vocab = grow_vocab(counts, old.draft_to_target, 100)
    with torch.no_grad():  # as if trained with --train-lm-head: the old rows are not the verifier's
        old.lm_head.weight.add_(torch.randn_like(old.lm_head.weight))
    grown = loop_mod.extend_draft_vocab(old, _verifier(), vocab)
    assert grown.config.draft_vocab_size == 100 and torch.isin(old.draft_to_target, grown.draft_to_target).all()
    head = _verifier().get_output_embeddings().weight
    new = ~torch.isin(grown.draft_to_target, old.draft_to_target)
    assert int(new.sum()) == 60
    torch.testing.assert_close(grown.lm_head.weight[new], head[grown.draft_to_target[new]].float())
    h = torch.randn(3, old.config.hidden_size)
    old_logits = old.head(h)[0]
    new_logits = grown.head(h)[0]
    torch.testing.assert_close(new_logits[:, torch.searchsorted(grown.draft_to_target, old.draft_to_target)],
                               old_logits)

    cfg = _cfg(tmp_path / "b", epochs=1, draft_vocab_size=100, init_from=str(base.draft_dir), extend_vocab=True)
    res = _train(cfg, samples)
    saved = read_draft(Path(cfg.out) / "draft", device="cpu", dtype=torch.float32)
    assert saved.config.draft_vocab_size == 100
    assert torch.isin(old.draft_to_target, saved.draft_to_target).all()
    assert res.draft.layers[0].mlp.gate_proj.weight.shape == old.layers[0].mlp.gate_proj.weight.shape
    # without the option the warm start keeps the old vocabulary, and the option changes the hash
    kept = _train(_cfg(tmp_path / "c", epochs=1, draft_vocab_size=100, init_from=str(base.draft_dir)), samples)
    assert kept.draft.config.draft_vocab_size == 40
    assert loop_mod._config_hash(cfg) != loop_mod._config_hash(
        _cfg(tmp_path / "b", epochs=1, draft_vocab_size=100, init_from=str(base.draft_dir)))
    with pytest.raises(DraftsmithError, match="needs --init-from"):
        _cfg(tmp_path / "d", extend_vocab=True)


class _Clock:
    """A fake ``time`` for the training loop: each training row advances it by ``per_row()`` seconds."""

    def __init__(self, per_row):
        self.now, self.per_row = 0.0, per_row

    def perf_counter(self) -> float:
        return self.now


def _timed_train(cfg, samples, monkeypatch, per_row):
    import types

    clock = _Clock(per_row)
    real = loop_mod.collate

    def slow_collate(*a, **k):
        clock.now += clock.per_row(clock.now)
        return real(*a, **k)

    monkeypatch.setattr(loop_mod, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(loop_mod, "collate", slow_collate)
    res = _train(cfg, samples)
    return res, clock.now


def test_target_minutes_fills_the_time_from_the_loops_own_speed(tmp_path, samples, monkeypatch):
    """2 s per step and one minute asked: 30 steps, whatever --epochs would have allowed (120 steps
    here). A slow first step (one-time warm-up) is not timed; a speed that halves between re-fits
    is caught at the planned end. Negative controls: without --target-minutes the loop trains its
    20 epochs; --epochs still caps the steps."""
    spe = len(loop_mod.pack_rows(samples, list(range(len(samples))), 64))
    cap = 20 * spe
    assert cap > 60
    res, seconds = _timed_train(_cfg(tmp_path / "a", epochs=20, target_minutes=1.0), samples, monkeypatch,
                                lambda now: 2.0)
    assert res.steps == 30 and seconds == pytest.approx(60.0)
    fits = res.metrics["fits"]
    assert [f["step"] for f in fits] == [3, 15] and fits[0]["seconds_per_step"] == pytest.approx(2.0)
    assert [f["total_steps"] for f in fits] == [30, 30]
    lines = [json.loads(x) for x in open(Path(tmp_path / "a" / "run" / "metrics.jsonl"))]
    assert lines[-1]["lr"] == pytest.approx(3e-3 * 0.1)  # the cosine schedule ends on the re-fitted last step

    res, seconds = _timed_train(_cfg(tmp_path / "b", epochs=20, target_minutes=1.0), samples, monkeypatch,
                                lambda now: 10.0 if now == 0 else 1.0)
    assert res.steps == 51 and seconds == pytest.approx(60.0)  # priced at 10 s per step it would stop at 6

    res, seconds = _timed_train(_cfg(tmp_path / "c", epochs=20, target_minutes=1.0), samples, monkeypatch,
                                lambda now: 2.0 if now < 20 else 1.0)
    assert 60 <= seconds <= 61 and res.steps == 50  # 10 steps at 2 s, 40 at 1 s
    assert [f["total_steps"] for f in res.metrics["fits"]] == [30, 41, 50]

    res, seconds = _timed_train(_cfg(tmp_path / "d", epochs=20), samples, monkeypatch, lambda now: 2.0)
    assert res.steps == cap and res.metrics["fits"] == []
    res, _ = _timed_train(_cfg(tmp_path / "e", epochs=2, target_minutes=1.0), samples, monkeypatch,
                          lambda now: 2.0)
    assert res.steps == 2 * spe < 30


def test_target_minutes_counts_the_time_before_a_resume(tmp_path, samples, monkeypatch):
    """Interrupted after 12 steps (24 s of one minute): the resumed run re-fits only at 50%, counts the
    24 s it already trained, and ends at the same 30 steps as an uninterrupted run."""
    cfg = _cfg(tmp_path, epochs=20, target_minutes=1.0, checkpoint_every=4)
    calls = {"n": 0}

    def per_row(now):
        calls["n"] += 1
        if calls["n"] == 13:
            raise KeyboardInterrupt
        return 2.0

    with pytest.raises(KeyboardInterrupt):
        _timed_train(cfg, samples, monkeypatch, per_row)
    state = torch.load(sorted((Path(cfg.out) / "checkpoints").glob("step-*.pt"))[-1], weights_only=False)
    assert state["step"] == 12 and state["seconds"] == pytest.approx(24.0)
    assert state["scheduler"]["lr_lambdas"][0]["total"] == 30  # the re-fitted schedule is in the checkpoint
    res, seconds = _timed_train(cfg, samples, monkeypatch, lambda now: 2.0)
    assert res.steps == 30 and seconds == pytest.approx(36.0)
    assert [f["step"] for f in res.metrics["fits"]] == [15]


def test_a_cuda_device_named_without_an_index_gets_this_process_gpu(monkeypatch):
    """``--device cuda`` (what the GPU check passes) names no index, and ``torch.cuda.set_device``
    refuses such a device: the trainer resolves it to LOCAL_RANK's GPU (0 alone) first. Checked on
    a CPU through torch's own index check, the one ``set_device`` runs before touching a GPU."""
    from torch.cuda._utils import _get_device_index

    with pytest.raises(ValueError):  # control: what set_device saw before the fix
        _get_device_index(torch.device("cuda"))
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_to.append(_get_device_index(d)))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert loop_mod._Dist("cuda").device == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert loop_mod._Dist("cuda").device == torch.device("cuda", 1)
    assert loop_mod._Dist("cuda:3").device == torch.device("cuda", 3)  # an index given is kept
    assert set_to == [0, 1, 3]
    assert loop_mod.train_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loop_mod.train_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loop_mod.train_device("auto") == torch.device("cuda", 1)
