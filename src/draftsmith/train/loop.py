"""EAGLE-3 training: packed TTT unroll, AdamW, warmup + cosine, checkpoint/resume, DDP.

Runs as one process or under ``torchrun --nproc_per_node N`` (gloo on CPU, nccl on
CUDA). Rows are dealt round-robin to ranks and gradients averaged, so N ranks with
``grad_accum`` a train exactly like one rank with ``grad_accum`` N*a. Rank 0 writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

import torch

from draftsmith.config import check_ranges, opt, to_dict
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Draft
from draftsmith.models.vocab import coverage, grow_vocab, select_vocab, token_counts
from draftsmith.train.loss import shift_left, step_mask, ttt_loss
from draftsmith.train.packing import PackedBatch, collate, pack_rows
from draftsmith.utils import (atomic_write_bytes, atomic_write_json, command_line, cpu_fast_bf16, environment_info,
                              progress_bar)

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    """How to train an EAGLE-3 draft: the pipeline's ``train`` section and `draftsmith train`'s options."""

    draft_vocab_size: int = opt(32000, "draft vocabulary size (capped at the verifier's)")
    draft_intermediate_size: int | None = opt(None, "MLP width of the draft's decoder layer (default: the "
                                              "verifier's intermediate size)")
    ttt_steps: int = opt(3, "training-time-test unroll length (1-7)")
    step_weight: float = opt(0.8, "loss weight of unroll step j is step_weight**j")
    epochs: float = opt(1.0, "passes over the training rows")
    max_steps: int | None = opt(None, "stop after this many optimizer steps")
    max_minutes: float | None = opt(None, "stop after this many minutes of training (a checkpoint and the best "
                                          "draft so far are kept; the result says the run was cut)")
    target_minutes: float | None = opt(None, "size training to about this many minutes: it times its own steps "
                                       "(at 10%% and 50%% of them) and sets its step count and LR schedule to "
                                       "fill them; --epochs is then the most it trains")
    lr: float = opt(1e-3, "peak learning rate (AdamW)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_ratio: float = opt(0.05, "fraction of steps spent warming up linearly")
    min_lr_ratio: float = opt(0.1, "cosine decay ends at lr * min_lr_ratio")
    grad_clip: float = opt(1.0, "gradient norm clip")
    pack_tokens: int = opt(1024, "positions per packed row (each position attends over its row)")
    grad_accum: int = opt(1, "rows per optimizer step (per rank)")
    val_fraction: float = opt(0.05, "fraction of samples held out to pick the best checkpoint")
    eval_every: int = opt(100, "optimizer steps between validations")
    eval_steps: int = opt(5, "draft length k of the simulated validation acceptance")
    checkpoint_every: int = opt(50, "optimizer steps between resumable checkpoints")
    init_from: str | None = opt(None, "warm-start from this draft directory (keeps its vocabulary unless "
                                "--extend-vocab)")
    extend_vocab: bool = opt(False, "with --init-from: grow the draft's vocabulary to --draft-vocab-size, adding "
                             "the tokens of this data it lacks, most frequent first (their lm_head rows start "
                             "as the verifier's)")
    train_lm_head: bool = opt(False, "also train the draft's lm_head (it starts as the verifier's rows and is "
                              "frozen by default)")
    precision: Literal["auto", "fp32", "bf16"] = opt("auto", "bf16 autocast on CUDA and on CPUs with AMX or "
                                                              "AVX-512 BF16 (1.5x fp32 on Zen 4), else fp32")
    seed: int = opt(0, "seed for initialisation and data order")

    def __post_init__(self) -> None:
        if not 1 <= self.ttt_steps <= 7:
            raise DraftsmithError(f"--ttt-steps must be in 1..7, got {self.ttt_steps}")
        check_ranges(self, {
            "--lr": (self.lr > 0, "> 0"), "--epochs": (self.epochs > 0, "> 0"),
            "--pack-tokens": (self.pack_tokens >= 8, ">= 8"), "--grad-accum": (self.grad_accum >= 1, ">= 1"),
            "--draft-vocab-size": (self.draft_vocab_size >= 1, ">= 1"),
            "--val-fraction": (0 <= self.val_fraction < 1, "in [0, 1)"), "--eval-every": (self.eval_every >= 1, ">= 1"),
            "--checkpoint-every": (self.checkpoint_every >= 1, ">= 1"), "--step-weight": (self.step_weight > 0, "> 0"),
            "--eval-steps": (self.eval_steps >= 1, ">= 1"), "--weight-decay": (self.weight_decay >= 0, ">= 0"),
            "--seed": (self.seed >= 0, ">= 0"), "--warmup-ratio": (0 <= self.warmup_ratio < 1, "in [0, 1)"),
            "--min-lr-ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1]"), "--grad-clip": (self.grad_clip > 0, "> 0"),
            "--max-steps": (self.max_steps is None or self.max_steps >= 1, ">= 1"),
            "--max-minutes": (self.max_minutes is None or self.max_minutes > 0, "> 0"),
            "--target-minutes": (self.target_minutes is None or self.target_minutes > 0, "> 0"),
            "--draft-intermediate-size": (self.draft_intermediate_size is None or self.draft_intermediate_size >= 1,
                                          ">= 1")})
        if self.extend_vocab and not self.init_from:
            raise DraftsmithError("--extend-vocab grows a warm-started draft's vocabulary: it needs --init-from "
                                  "(a fresh draft takes --draft-vocab-size as it is)")


@dataclass(kw_only=True)
class TrainConfig(TrainSettings):
    """Train an EAGLE-3 draft on hidden states captured from the verifier."""

    verifier: str = opt(help="verifier the data was captured from: HF dir, .gguf file, or alias")
    data: list[str] | None = opt(None, "directory of captured shards (from `draftsmith data`); several are "
                                 "trained on together, e.g. an earlier capture plus fresh replies "
                                 "(`draftsmith data --skip-conversations N`)")
    out: str = opt("runs/draft", "output directory: checkpoints, metrics.jsonl, the draft")
    vocab_data: list[str] | None = opt(None, "capture directories whose reply tokens choose the draft vocabulary "
                                       "(default: the training samples of --data), e.g. every capture so far "
                                       "while training on the latest ones")
    num_draft_tokens: int = opt(5, "speculative tokens written into the exported config")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")

    def __post_init__(self) -> None:
        if isinstance(self.data, (str, Path)):  # one directory, as the pipeline passes it
            self.data = [str(self.data)]
        if isinstance(self.vocab_data, (str, Path)):
            self.vocab_data = [str(self.vocab_data)]
        super().__post_init__()
        if self.num_draft_tokens < 1:
            raise DraftsmithError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")


# Fields that change the result; the rest (logging cadence, device) may differ on resume.
_RESULT_FIELDS = ("verifier", "data", "draft_vocab_size", "draft_intermediate_size", "ttt_steps", "step_weight",
                  "epochs", "max_steps", "lr", "weight_decay", "warmup_ratio", "min_lr_ratio", "grad_clip",
                  "pack_tokens", "grad_accum", "val_fraction", "init_from", "extend_vocab", "vocab_data",
                  "train_lm_head", "precision", "seed")


@dataclass
class TrainResult:
    draft_dir: Path
    best_acceptance_length: float
    steps: int
    seconds: float
    metrics: dict[str, Any]
    draft: Eagle3Draft  # the final in-memory weights (the best ones are in ``draft_dir``)


# ----------------------------------------------------------------------------- helpers
def train_device(spec: str) -> torch.device:
    """The device a training process runs on: ``auto`` is CUDA where there is one, else the CPU; a CUDA
    device named without an index (``cuda``) is this process's GPU, ``LOCAL_RANK`` under torchrun and
    0 alone (``torch.cuda.set_device`` refuses a device without an index)."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


class _Dist:
    """Rank/world and collective helpers; a no-op outside torchrun."""

    def __init__(self, device_spec: str) -> None:
        import torch.distributed as dist

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.dist = dist
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() and device_spec != "cpu" else "gloo")
        self.device = train_device(device_spec)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            self.dist.barrier()

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return t.tolist()


def _use_bf16(precision: str, device: torch.device) -> bool:
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_fast_bf16()


def _final_norm(verifier: torch.nn.Module) -> torch.nn.Module | None:
    decoder = verifier.get_decoder() if hasattr(verifier, "get_decoder") else None
    return getattr(decoder, "norm", None)


def build_draft(verifier: torch.nn.Module, draft_vocab: torch.Tensor, seed: int,
                aux_layer_ids: list[int] | None = None, **overrides: Any) -> Eagle3Draft:
    """A fresh draft for ``verifier``: random layer, embeddings and lm_head rows copied from it.

    Args:
        verifier: the HF causal LM.
        draft_vocab: ``[Vd]`` sorted verifier ids the draft predicts over.
        seed: initialisation seed.
        aux_layer_ids: verifier layers feeding the draft (default [2, n//2, n-3]).
    """
    cfg = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=draft_vocab.shape[0],
                                     aux_layer_ids=aux_layer_ids, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = Eagle3Draft(cfg)
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if p.dim() == 2 and name not in {"embed_tokens.weight", "lm_head.weight"}:
                    p.normal_(0.0, 0.02)
    draft.set_vocab(draft_vocab)
    with torch.no_grad():
        emb = verifier.get_input_embeddings().weight
        draft.embed_tokens.weight.copy_(emb.float())
        head = verifier.get_output_embeddings().weight
        draft.lm_head.weight.copy_(head[draft.draft_to_target.to(head.device)].float())
        norm = _final_norm(verifier)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == draft.norm.weight.shape:
            # Gemma's norms scale by (1 + w); start the draft norm at the verifier's effective scale.
            scale = norm.weight.float() + (1.0 if "gemma" in verifier.config.model_type else 0.0)
            draft.norm.weight.copy_(scale)
    draft.lm_head.weight.requires_grad_(False)  # frozen: the verifier's own rows (as speculators does)
    return draft


def extend_draft_vocab(draft: Eagle3Draft, verifier: torch.nn.Module, vocab: torch.Tensor) -> Eagle3Draft:
    """``draft`` over the larger vocabulary ``vocab`` (sorted verifier ids containing the draft's own).

    Every weight but the lm_head carries over; the lm_head keeps the draft's rows for its old
    tokens (trained or not) and takes the verifier's rows for the new ones.
    """
    import dataclasses

    old = draft.draft_to_target
    if not torch.isin(old, vocab).all():
        raise DraftsmithError("the new draft vocabulary must contain the old one")
    if vocab.numel() == old.numel():
        return draft
    grown = Eagle3Draft(dataclasses.replace(draft.config, draft_vocab_size=int(vocab.numel())))
    state = {k: v for k, v in draft.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    grown.load_state_dict(state, strict=False)
    grown.set_vocab(vocab)
    with torch.no_grad():
        head = verifier.get_output_embeddings().weight
        grown.lm_head.weight.copy_(head[vocab.to(head.device)].float())
        grown.lm_head.weight[torch.searchsorted(vocab, old)] = draft.lm_head.weight.float()
    grown.lm_head.weight.requires_grad_(draft.lm_head.weight.requires_grad)
    return grown.to(draft.lm_head.weight.dtype)


def _target_head(verifier: torch.nn.Module, draft: Eagle3Draft) -> tuple[torch.Tensor, float | None]:
    """Verifier lm_head rows of the draft vocabulary [Vd, Ht] and its logit softcap, if any."""
    head = verifier.get_output_embeddings().weight.detach()
    rows = head[draft.draft_to_target.to(head.device)].float().clone()
    cfg = verifier.config.get_text_config() if hasattr(verifier.config, "get_text_config") else verifier.config
    return rows, getattr(cfg, "final_logit_softcapping", None)


def target_logits(last: torch.Tensor, rows: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = last.to(rows.dtype) @ rows.T
    return softcap * torch.tanh(logits / softcap) if softcap else logits


def train_flops_per_token(cfg: Eagle3Config, steps: int, mean_context: float, train_head: bool = False) -> float:
    """Approximate FLOPs of one training position (forward 2x, backward 4x params; a frozen lm_head
    2x forward + 2x input gradient, a trained one 2x more for its weight gradient)."""
    H, Ht, A = cfg.hidden_size, cfg.verifier_hidden_size, len(cfg.aux_layer_ids)
    nh, nkv, hd, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * inter
    attn = 2 * mean_context * nh * hd
    head = H * cfg.draft_vocab_size
    fwd_trained = 2 * (A * Ht * H + steps * (layer + attn))
    return 3 * fwd_trained + steps * (6 if train_head else 4) * head + 2 * head  # + the target logits


def chain_mask(batch: PackedBatch, K: int) -> torch.Tensor:
    """Positions whose K chain steps all have a target among their document's assistant tokens.

    Every step is checked: a position just before a reply has its last steps' targets
    inside the reply but its first ones in the prompt, and one that spans a user turn
    between two replies has its middle ones there.
    """
    full = batch.mask.clone()
    for j in range(1, K):
        full &= step_mask(batch.mask, batch.doc, j)
    return full


def simulated_acceptance(step_logits: list[torch.Tensor], batch: PackedBatch,
                         draft_to_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain acceptance under teacher forcing: counts ``[K]`` of accepted-at-j and the chain count.

    A position contributes when all K steps have a target inside its document's
    assistant tokens (:func:`chain_mask`); its step j is accepted if steps 0..j all
    equal the verifier's token.
    """
    K = len(step_logits)
    full = chain_mask(batch, K)
    ok = torch.ones_like(full)
    accepted = torch.zeros(K, dtype=torch.long)
    for j, logits in enumerate(step_logits):
        guess = draft_to_target[logits.argmax(-1)]
        ok = ok & (guess == shift_left(batch.next_tokens, j, fill=-1))
        accepted[j] = int((ok & full).sum())
    return accepted, full.sum().cpu()


@dataclass
class Schedule:
    """Linear warm-up over ``warmup_ratio`` of ``total`` steps, then cosine decay to ``min_ratio``.

    A callable object, not a closure: LambdaLR saves its attributes in the checkpoint, so a
    ``total`` re-fitted while training (:class:`TimeFit`) survives a resume.
    """

    total: int
    warmup_ratio: float
    min_ratio: float

    def __call__(self, step: int) -> float:
        warmup = max(1, int(self.warmup_ratio * self.total))
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.total - warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


#: fractions of ``--target-minutes`` at which training re-times itself, and the share of the time
#: that may be left when it reaches its planned steps before it re-times once more
REFIT_AT = (0.1, 0.5)
END_SLACK = 0.1


class TimeFit:
    """``--target-minutes``: the step count re-fitted from the loop's own speed.

    The steps since the last re-fit are timed (the speed now; the first step of an attempt pays
    one-time warm-up and is not timed). Re-fits at :data:`REFIT_AT` of the time, and once more
    when the planned steps are done with more than :data:`END_SLACK` of it left and ``cap`` not
    reached (the schedule then restarts its decay from where the longer run would be). A resumed
    run counts ``earlier_seconds`` and skips the re-fits already past.
    """

    def __init__(self, minutes: float, cap: int, earlier_seconds: float = 0.0) -> None:
        self.target, self.cap = 60.0 * minutes, cap
        self.marks = [f for f in REFIT_AT if earlier_seconds < f * self.target]
        self.t: float | None = None  # when the timed steps began, and the step count then
        self.step = 0
        self.fits: list[dict[str, Any]] = []

    def due(self, now: float, elapsed: float, step: int, total: int) -> bool:
        if self.t is None:
            self.t, self.step = now, step
            return False
        if step <= self.step:
            return False
        if self.marks and elapsed >= self.marks[0] * self.target:
            return True
        return step >= total and total < self.cap and elapsed < (1 - END_SLACK) * self.target

    def refit(self, now: float, step: int, elapsed: float, timed: float, steps_timed: int) -> int:
        """The new step count: what fills the time left at the speed of the ``steps_timed`` steps
        that took ``timed`` seconds, at most ``cap``, at least ``step``."""
        per_step = timed / max(steps_timed, 1)
        total = max(step, min(self.cap, step + int(max(self.target - elapsed, 0.0) / max(per_step, 1e-9))))
        self.fits.append({"step": step, "seconds": round(elapsed, 1), "seconds_per_step": round(per_step, 4),
                          "total_steps": total})
        while self.marks and elapsed >= self.marks[0] * self.target:
            self.marks.pop(0)
        self.t, self.step = now, step
        return total


def draw_curves(out: Path, title: str = "") -> Path | None:
    """``OUT/training.png`` from ``OUT/metrics.jsonl`` (:mod:`draftsmith.train.curves`); a plot that
    fails is logged, never raised: the trained draft matters more than its picture."""
    from draftsmith.train.curves import PLOT, plot_training

    try:
        (out / PLOT).unlink(missing_ok=True)  # never an earlier attempt's picture under this run's name
        return plot_training(out / "metrics.jsonl", out / PLOT, title)
    except Exception as e:  # noqa: BLE001
        log.warning("could not draw %s: %s", out / PLOT, e)
        return None


def _split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic sample split by a hash of (seed, index)."""
    train, val = [], []
    for i in range(n):
        h = int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:4], "big") / 2**32
        (val if h < fraction else train).append(i)
    if fraction > 0 and not val and n > 1:
        val.append(train.pop())
    return train, val


def _config_hash(cfg: TrainConfig) -> str:
    d = to_dict(cfg)
    return hashlib.sha256(json.dumps({k: d[k] for k in _RESULT_FIELDS}, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the loop
def train(cfg: TrainConfig, samples: list[dict] | None = None, verifier: torch.nn.Module | None = None,
          fingerprint: str | None = None, aux_layer_ids: list[int] | None = None,
          progress: bool = True) -> TrainResult:
    """Train a draft; resumes from ``cfg.out`` when it holds a checkpoint of the same config.

    Args:
        cfg: the training configuration.
        samples: captured samples (online mode); default: the shards of every ``cfg.data`` directory.
        verifier: the loaded verifier (default: loaded from ``cfg.verifier``).
        fingerprint: the verifier's fingerprint (default: computed on load).
        aux_layer_ids: verifier layers the samples' ``aux`` holds (default: the shards'
            manifest, else [2, n//2, n-3]).
        progress: show a progress bar on rank 0.
    """
    from draftsmith.models.speculators import read_draft, write_draft
    from draftsmith.models.verifier import load_verifier

    dist = _Dist(cfg.device)
    out = Path(cfg.out)
    if verifier is None:
        verifier, _, fingerprint = load_verifier(cfg.verifier, dtype="auto", device=dist.device)
    if samples is None:
        if not cfg.data:
            raise DraftsmithError("--data is required (a directory of captured shards)")
        from draftsmith.data.shards import load_capture_dirs

        samples, captured_layers = load_capture_dirs(cfg.data, fingerprint)
        if aux_layer_ids is None:  # the draft must read the layers the shards hold, not the default ones
            aux_layer_ids = captured_layers
        elif list(aux_layer_ids) != captured_layers:
            raise DraftsmithError(f"aux layers {list(aux_layer_ids)} were asked for but {cfg.data} hold "
                                  f"{captured_layers}")
    if not samples:
        raise DraftsmithError("no training samples")
    train_idx, val_idx = _split(len(samples), cfg.val_fraction, cfg.seed)
    if not train_idx:
        raise DraftsmithError("no training samples left after the validation split")

    def vocab_counts() -> torch.Tensor:
        """Reply-token counts that choose the vocabulary: ``cfg.vocab_data``, else the training samples."""
        if cfg.vocab_data:
            from draftsmith.data.shards import load_shards

            chosen: Iterable[dict] = (s for d in cfg.vocab_data for s in load_shards(Path(d), fingerprint))
        else:
            chosen = (samples[i] for i in train_idx)
        return token_counts(chosen, verifier.get_output_embeddings().weight.shape[0])  # one shard in memory

    # draft: warm start (keeps its vocabulary unless extend_vocab) or fresh from the verifier
    if cfg.init_from:
        draft = read_draft(cfg.init_from, device="cpu", dtype=torch.float32)
        vocab_cov = None
        if cfg.extend_vocab:
            counts = vocab_counts()
            draft = extend_draft_vocab(draft, verifier, grow_vocab(counts, draft.draft_to_target,
                                                                   min(cfg.draft_vocab_size, counts.shape[0])))
            vocab_cov = coverage(counts, draft.draft_to_target)
    else:
        counts = vocab_counts()
        vocab = select_vocab(counts, min(cfg.draft_vocab_size, counts.shape[0]))
        vocab_cov = coverage(counts, vocab)
        width = {"intermediate_size": cfg.draft_intermediate_size} if cfg.draft_intermediate_size else {}
        draft = build_draft(verifier, vocab, cfg.seed, aux_layer_ids=aux_layer_ids,
                            num_draft_tokens=cfg.num_draft_tokens, verifier_name=cfg.verifier, **width)
    if aux_layer_ids is not None and list(draft.config.aux_layer_ids) != list(aux_layer_ids):
        raise DraftsmithError(f"the samples hold aux layers {list(aux_layer_ids)} but the draft reads "
                              f"{draft.config.aux_layer_ids}")
    draft.lm_head.weight.requires_grad_(cfg.train_lm_head)
    draft.config.num_draft_tokens = cfg.num_draft_tokens
    draft.config.verifier_name = draft.config.verifier_name or cfg.verifier
    from draftsmith.decoding.proposers import Eagle3Proposer

    Eagle3Proposer(draft).check_compatible(verifier)
    rows_w, softcap = _target_head(verifier, draft)
    device = dist.device
    draft.to(device)
    rows_w = rows_w.to(device)
    d2t_full = draft.draft_to_target
    bf16 = _use_bf16(cfg.precision, device)

    train_params = [p for p in draft.parameters() if p.requires_grad]
    model: torch.nn.Module = draft
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(draft, device_ids=[device.index] if device.type == "cuda" else None)
    optim = torch.optim.AdamW(train_params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    # schedule: rows per epoch are fixed by the data, so the step count is known up front
    rows0 = pack_rows(samples, train_idx, cfg.pack_tokens)
    per_step = cfg.grad_accum * dist.world
    steps_per_epoch = len(rows0) // per_step
    if steps_per_epoch == 0:
        raise DraftsmithError(f"{len(rows0)} packed rows cannot fill one optimizer step of {per_step} rows; "
                              "lower --grad-accum / --pack-tokens or add data")
    cap_steps = max(1, int(cfg.epochs * steps_per_epoch))
    if cfg.max_steps:
        cap_steps = min(cap_steps, cfg.max_steps)
    schedule = Schedule(cap_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, schedule)
    val_rows = pack_rows(samples, val_idx, cfg.pack_tokens)
    weights = [cfg.step_weight ** j for j in range(cfg.ttt_steps)]

    # resume
    ckpt_dir = out / "checkpoints"
    chash = _config_hash(cfg)
    step, best, earlier_seconds = 0, -1.0, 0.0
    latest = ckpt_dir / "latest.json"
    if latest.is_file():
        info = json.loads(latest.read_text())
        if info.get("config_hash") != chash:
            raise DraftsmithError(f"{out} holds a training run with a different configuration; "
                                  "use another --out or delete it")
        state = torch.load(ckpt_dir / info["file"], map_location=device, weights_only=False)
        draft.load_state_dict(state["model"])
        optim.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, best = state["step"], state["best"]
        earlier_seconds = float(state.get("seconds", 0.0))  # training time of the attempts before this one
        log.info("resumed from %s at step %d", info["file"], step)
    if dist.main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "train_config.json", {
            "config": to_dict(cfg), "config_hash": chash, "verifier_fingerprint": fingerprint,
            "num_samples": len(samples), "train_samples": len(train_idx), "val_samples": len(val_idx),
            "vocab_coverage": vocab_cov, "total_steps": schedule.total, "world_size": dist.world,
            "precision": "bf16" if bf16 else "fp32", "environment": environment_info(),
            "command": command_line()})

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def evaluate() -> dict[str, Any]:
        draft.eval()
        K = max(cfg.eval_steps, cfg.ttt_steps)
        acc = torch.zeros(K, dtype=torch.long)
        n = torch.zeros((), dtype=torch.long)
        with torch.no_grad(), autocast():
            for r in val_rows[dist.rank::dist.world]:
                b = collate(samples, r, cfg.pack_tokens).to(device)
                logits = draft.forward_ttt(b.aux.float(), b.input_ids, b.position_ids, b.attn_mask, K)
                a, c = simulated_acceptance(logits, b, d2t_full)
                acc += a
                n += c
        tot = dist.all_sum([float(n)] + acc.tolist())
        draft.train()
        per_pos = [x / tot[0] if tot[0] else 0.0 for x in tot[1:]]
        return {"val_acceptance_length": 1.0 + sum(per_pos), "val_per_position_acceptance": per_pos,
                "val_positions": int(tot[0]), "val_k": K}

    def save_checkpoint() -> None:
        if not dist.main:
            return
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:07d}.pt"
        import io

        buf = io.BytesIO()
        torch.save({"model": draft.state_dict(), "optimizer": optim.state_dict(),
                    "scheduler": sched.state_dict(), "step": step, "best": best,
                    "seconds": time.perf_counter() - t_start}, buf)
        atomic_write_bytes(ckpt_dir / name, buf.getvalue())
        atomic_write_json(latest, {"file": name, "step": step, "config_hash": chash})
        for old in sorted(ckpt_dir.glob("step-*.pt"))[:-2]:
            old.unlink()

    def save_best(metrics: dict[str, Any]) -> None:
        if dist.main:
            write_draft(draft, out / "draft", verifier_name=draft.config.verifier_name,
                        num_draft_tokens=cfg.num_draft_tokens, fingerprint=fingerprint,
                        provenance={"train_config": to_dict(cfg), "step": step, "command": command_line()},
                        metrics=metrics)

    metrics_f = open(out / "metrics.jsonl", "a") if dist.main else None
    draft.train()
    bar = progress_bar(schedule.total, "train", "step", progress and dist.main, initial=step)
    t_start = time.perf_counter() - earlier_seconds  # resumed: the earlier attempts' time counts
    fit = TimeFit(cfg.target_minutes, cap_steps, earlier_seconds) if cfg.target_minutes else None
    tokens_seen = 0
    mean_ctx = cfg.pack_tokens / 4
    flops_tok = train_flops_per_token(draft.config, cfg.ttt_steps, mean_ctx, cfg.train_lm_head)
    last_metrics: dict[str, Any] = {}
    cut: dict[str, Any] | None = None  # set when --max-minutes stops the run before its planned steps
    try:
        while step < schedule.total and cut is None:
            epoch, in_epoch = divmod(step, steps_per_epoch)
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
            order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=g).tolist()]
            rows = pack_rows(samples, order, cfg.pack_tokens)[: steps_per_epoch * per_step]
            for s in range(in_epoch, steps_per_epoch):
                if step >= schedule.total:
                    break
                t0 = time.perf_counter()
                mine = rows[s * per_step:(s + 1) * per_step][dist.rank::dist.world]
                optim.zero_grad(set_to_none=True)
                sums = [0.0] * (3 * cfg.ttt_steps)
                ntok = 0
                for i, r in enumerate(mine):
                    b = collate(samples, r, cfg.pack_tokens).to(device)
                    sync = model.no_sync() if (dist.world > 1 and i + 1 < len(mine)) else contextlib.nullcontext()
                    with sync, autocast():
                        logits = model(b.aux.float(), b.input_ids, b.position_ids, b.attn_mask, cfg.ttt_steps)
                        with torch.no_grad():
                            tl = target_logits(b.last, rows_w, softcap)
                        loss, st = ttt_loss(logits, tl, b.next_tokens, b.mask, b.doc, d2t_full, weights)
                    (loss / len(mine)).backward()
                    for j in range(cfg.ttt_steps):
                        sums[3 * j] += st.loss[j]
                        sums[3 * j + 1] += st.correct[j]
                        sums[3 * j + 2] += st.count[j]
                    ntok += b.num_tokens
                gnorm = torch.nn.utils.clip_grad_norm_(train_params, cfg.grad_clip)
                optim.step()
                sched.step()
                step += 1
                sums = dist.all_sum(sums + [float(ntok)])
                ntok_all = sums[-1]
                tokens_seen += ntok_all
                if device.type == "cuda":  # the backward and optimizer step run queued: time them done
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                if fit is not None:
                    now = time.perf_counter()
                    if dist.all_sum([float(dist.main and fit.due(now, now - t_start, step, schedule.total))])[0]:
                        # every rank re-fits from rank 0's clock, so that they agree on the step count
                        elapsed, timed, n = dist.all_sum([now - t_start, now - fit.t, step - fit.step]
                                                         if dist.main else [0.0, 0.0, 0.0])
                        schedule.total = fit.refit(now, step, elapsed, timed, int(n))
                        bar.total = schedule.total
                        bar.refresh()
                per_step_loss = [sums[3 * j] / max(1, sums[3 * j + 2]) for j in range(cfg.ttt_steps)]
                per_step_acc = [sums[3 * j + 1] / max(1, sums[3 * j + 2]) for j in range(cfg.ttt_steps)]
                rec = {"step": step, "epoch": epoch, "lr": sched.get_last_lr()[0]}
                if fit is not None and fit.fits and fit.fits[-1]["step"] == step:
                    rec["refit"] = fit.fits[-1]
                if ntok_all:
                    rec.update({"loss": sum(w * x for w, x in zip(weights, per_step_loss)),
                                "step_loss": per_step_loss, "step_acc": per_step_acc, "grad_norm": float(gnorm),
                                "tokens_per_s": ntok_all / dt, "flops_per_s": flops_tok * ntok_all / dt})
                else:  # a shuffled epoch can pack into fewer rows than the first: its last steps are empty
                    rec["empty"] = True
                if step % cfg.eval_every == 0 or step == schedule.total:
                    rec.update(evaluate())
                    if rec["val_acceptance_length"] > best:
                        best = rec["val_acceptance_length"]
                        save_best(rec)
                if metrics_f:
                    metrics_f.write(json.dumps(rec) + "\n")
                    metrics_f.flush()
                # an empty step keeps the training numbers of the last real one in the summary
                last_metrics.update({k: v for k, v in rec.items() if k != "empty"})
                bar.update(1)
                if ntok_all:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{per_step_acc[0]:.2f}",
                                    tok_s=f"{rec['tokens_per_s']:.0f}",
                                    **({"val_al": f"{rec['val_acceptance_length']:.2f}"}
                                       if "val_acceptance_length" in rec else {}))
                if cfg.max_minutes is not None and step < schedule.total and dist.all_sum(
                        [float(time.perf_counter() - t_start > 60 * cfg.max_minutes)])[0] > 0:
                    cut = {"reason": f"--max-minutes {cfg.max_minutes:g} reached", "step": step,
                           "planned_steps": schedule.total}
                    if "val_acceptance_length" not in rec and val_rows:  # the best draft so far, measured now
                        rec.update(evaluate())
                        if rec["val_acceptance_length"] > best:
                            best = rec["val_acceptance_length"]
                            save_best(rec)
                        last_metrics.update(rec)
                        if metrics_f:  # the step again, with its validation (readers keep the later record)
                            metrics_f.write(json.dumps(rec) + "\n")
                            metrics_f.flush()
                    save_checkpoint()
                    break
                if step % cfg.checkpoint_every == 0 or step == schedule.total:
                    save_checkpoint()
    except KeyboardInterrupt:
        save_checkpoint()  # nothing lost: the next run resumes here
        raise
    finally:
        bar.close()
        if metrics_f:
            metrics_f.close()
            # interrupted too: the picture of what was trained (its time is not training's)
            t_draw = time.perf_counter()
            draw_curves(out, f"a draft for {Path(str(cfg.verifier)).name}")
            t_start += time.perf_counter() - t_draw
    if not val_rows and dist.main:  # no validation data: the last weights are the result
        save_best(last_metrics)
    dist.barrier()
    seconds = time.perf_counter() - t_start
    summary = {**last_metrics, "train_seconds": seconds, "tokens_seen": tokens_seen,
               "vocab_coverage": vocab_cov, "best_val_acceptance_length": best, "total_steps": schedule.total,
               "cut": cut, "fits": fit.fits if fit else [], "cap_steps": cap_steps,
               "plot": str((out / "training.png").resolve()) if (out / "training.png").is_file() else None}
    if dist.main:
        atomic_write_json(out / "train_summary.json", summary)
    return TrainResult(out / "draft", best, step, seconds, summary, draft)
