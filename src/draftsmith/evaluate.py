"""Teacher-forced acceptance on held-out prompts: a draft's quality in seconds, without timing.

Greedy decoding is deterministic, so which draft tokens the engine would accept follows
from the verifier's greedy reply alone: the draft's step j at position t is accepted
when steps 0..j all equal the reply's tokens (:func:`~draftsmith.train.loop.simulated_acceptance`,
the same TTT unroll the draft was trained with). ``draftsmith eval``

1. answers the prompts once with the verifier (greedy) and captures its hidden states
   over prompt + reply, cached and resumable;
2. reports each draft's acceptance length and per-position acceptance at k over all
   prompts (about 15 s per draft for MT-Bench's 80 on 2 CPU cores, against ~10 min
   for a ``draftsmith bench`` of 80 prompts);
3. with ``--check-engine N``, decodes the first N prompts with the real engine and the
   first draft, so the shortcut is checked against it, not assumed.

It measures acceptance only, never speed: ``draftsmith bench`` stays the judge of speedup.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch

from draftsmith.config import check_ranges, opt
from draftsmith.errors import DraftsmithError


@dataclass
class EvalConfig:
    """Score EAGLE-3 drafts by teacher-forced acceptance on held-out prompts: the verifier answers them
    once (greedy, cached), then each draft's acceptance at k follows from those replies in seconds.
    Acceptance only: `draftsmith bench` measures speed."""

    draft: list[str] = opt(help="EAGLE-3 draft directories (speculators format)")
    verifier: str = opt("smollm2-135m", "verifier: HF dir, .gguf file or alias")
    dataset: str = opt("mt-bench", "held-out prompts (first user turns): mt-bench, humaneval or a JSONL file")
    num_prompts: int | None = opt(None, "the first N prompts (default: all)")
    num_draft_tokens: int = opt(5, "draft length k scored")
    max_new_tokens: int = opt(128, "longest verifier reply")
    cache: str = opt("runs/eval", "directory for the verifier's replies and hidden states (one subdirectory per "
                                  "verifier, dataset and settings, reused by later runs)")
    check_engine: int = opt(0, "also decode the first N prompts with the real engine and the first draft")
    out: str | None = opt(None, "JSON file with every number (and beside it a .png: acceptance by position)")
    dtype: str = opt("float32", "verifier dtype (float32: the greedy replies the engine reproduces exactly)")
    device: str = opt("auto", "device: auto, cpu, cuda, cuda:N")

    def __post_init__(self) -> None:
        if not self.draft:
            raise DraftsmithError("--draft: name at least one draft directory")
        check_ranges(self, {"--num-draft-tokens": (self.num_draft_tokens >= 1, ">= 1"),
                            "--max-new-tokens": (self.max_new_tokens >= 1, ">= 1"),
                            "--check-engine": (self.check_engine >= 0, ">= 0"),
                            "--num-prompts": (self.num_prompts is None or self.num_prompts >= 1, ">= 1")})


class Acceptance(NamedTuple):
    """Teacher-forced acceptance of one draft over a set of samples."""

    per_position: list[float]  # [k] share of chains accepted at step j
    positions: int              # chains counted (every k targets inside a reply)
    per_sample: list[float]     # each sample's acceptance length

    @property
    def acceptance_length(self) -> float:
        """1 + the expected accepted tokens per round (vLLM's definition)."""
        return 1.0 + sum(self.per_position)


def _draft_steps(draft: torch.nn.Module, samples: list[dict], k: int) -> Iterator[tuple[Any, list[torch.Tensor]]]:
    """Per sample: its one-sample batch and the draft's k teacher-forced step logits over it."""
    from draftsmith.train.packing import collate

    for s in samples:
        b = collate([s], [0], s["input_ids"].shape[0])
        with torch.no_grad():
            yield b, draft.forward_ttt(b.aux.float(), b.input_ids, b.position_ids, b.attn_mask, k)


def teacher_forced_acceptance(draft: torch.nn.Module, samples: list[dict], k: int) -> Acceptance:
    """Greedy acceptance of ``draft`` at draft length ``k`` on captured ``samples``, pooled over them.

    Args:
        draft: an :class:`~draftsmith.models.eagle3.Eagle3Draft` (or anything with its
            ``forward_ttt`` and ``draft_to_target``), in float32.
        samples: captured samples (:mod:`draftsmith.data.capture`) of the verifier's own replies.
        k: draft length.
    """
    from draftsmith.train.loop import simulated_acceptance

    acc = torch.zeros(k, dtype=torch.long)
    n = 0
    per_sample = []
    for b, logits in _draft_steps(draft, samples, k):
        a, c = simulated_acceptance(logits, b, draft.draft_to_target)
        acc += a
        n += int(c)
        per_sample.append(1 + sum(a.tolist()) / max(int(c), 1))
    return Acceptance([x / max(n, 1) for x in acc.tolist()], n, per_sample)


def heldout_samples(model: torch.nn.Module, tokenizer: Any, fingerprint: str, verifier_spec: str, dataset: str,
                    work: Path, *, aux_layer_ids: list[int] | None = None, num_prompts: int | None = None,
                    max_new_tokens: int = 128, progress: bool = True) -> list[dict]:
    """The verifier's greedy replies to ``dataset``'s prompts, captured at ``aux_layer_ids``; cached in ``work``.

    The prompts are those ``draftsmith bench`` measures on
    (:func:`~draftsmith.data.sources.eval_conversations`). Regeneration and capture
    resume and refuse a directory made with other settings, so a later call with the
    same arguments reads the cache.
    """
    from draftsmith.data.capture import capture_to_shards
    from draftsmith.data.regenerate import load_regenerated, regenerate
    from draftsmith.data.shards import load_shards
    from draftsmith.data.sources import eval_conversations
    from draftsmith.models.verifier import context_length

    replies = regenerate(model, tokenizer, eval_conversations(dataset, num_prompts), work / "regenerated.jsonl",
                         max_new_tokens=max_new_tokens, batch_size=16, fingerprint=fingerprint, progress=progress)
    # Whole replies (up to the context): a cut reply would drop chains the engine sees.
    shards = capture_to_shards(model, tokenizer, load_regenerated(replies), work / "shards", fingerprint=fingerprint,
                               verifier_spec=verifier_spec, aux_layer_ids=aux_layer_ids,
                               max_length=context_length(model) or 1 << 16, batch_size=8, samples_per_shard=256,
                               progress=progress)
    return list(load_shards(shards, fingerprint))


def engine_acceptance(model: torch.nn.Module, proposer: Any, samples: list[dict], k: int,
                      max_new_tokens: int) -> list[float]:
    """Acceptance length of the real engine on each sample's prompt (greedy), for comparison."""
    from draftsmith.decoding.engine import generate

    out = []
    for s in samples:
        prompt = s["input_ids"][: int(s["loss_mask"].int().argmax())].tolist()  # up to the reply's first token
        out.append(generate(model, prompt, proposer=proposer, max_new_tokens=max_new_tokens,
                            num_draft_tokens=k).stats["acceptance_length"])
    return out


def _cache_dir(cfg: EvalConfig, fingerprint: str, aux_layer_ids: list[int]) -> Path:
    """One cache per verifier and capture settings: another dataset or budget never reads a stale one."""
    key = json.dumps([cfg.dataset, cfg.num_prompts, cfg.max_new_tokens, cfg.dtype, aux_layer_ids])
    return Path(cfg.cache) / f"{fingerprint[:16]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def evaluate(cfg: EvalConfig, progress: bool = True) -> dict[str, Any]:
    """Score every draft of ``cfg``; the result as ``--out`` writes it.

    Raises:
        DraftsmithError: a draft that does not fit the verifier, or drafts that read
            different verifier layers (checked before the verifier answers anything).
    """
    from draftsmith.drafters import load_draft
    from draftsmith.models.speculators import read_config, read_draft, validate_against_verifier
    from draftsmith.models.verifier import load_verifier, text_config

    model, tokenizer, fingerprint = load_verifier(cfg.verifier, dtype=cfg.dtype, device=cfg.device)
    layers = text_config(model).num_hidden_layers
    aux: list[int] | None = None
    for path in cfg.draft:
        draft_cfg, _ = read_config(path, verifier_layers=layers)
        validate_against_verifier(draft_cfg, model, what=f"draft {path!r}")
        if aux is not None and list(draft_cfg.aux_layer_ids) != aux:
            raise DraftsmithError(f"draft {path!r} reads verifier layers {draft_cfg.aux_layer_ids}, {cfg.draft[0]!r} "
                                  f"reads {aux}: score them in separate runs")
        aux = list(draft_cfg.aux_layer_ids)
    samples = heldout_samples(model, tokenizer, fingerprint, cfg.verifier, cfg.dataset,
                              _cache_dir(cfg, fingerprint, aux), aux_layer_ids=aux, num_prompts=cfg.num_prompts,
                              max_new_tokens=cfg.max_new_tokens, progress=progress)
    k = cfg.num_draft_tokens
    result: dict[str, Any] = {"verifier_fingerprint": fingerprint, "dataset": cfg.dataset, "prompts": len(samples),
                              "k": k, "drafts": {}}
    for path in cfg.draft:
        draft = read_draft(path, device="cpu", dtype=torch.float32, verifier_layers=layers)
        a = teacher_forced_acceptance(draft, samples, k)
        result["drafts"][path] = {"acceptance_length": a.acceptance_length, "per_position": a.per_position,
                                  "positions": a.positions, "per_sample": a.per_sample}
    if cfg.check_engine:
        first = cfg.draft[0]
        engine = engine_acceptance(model, load_draft(first, model), samples[:cfg.check_engine], k, cfg.max_new_tokens)
        result["engine_check"] = {"draft": first, "engine": engine,
                                  "teacher_forced": result["drafts"][first]["per_sample"][:cfg.check_engine]}
    return result


def plot_acceptance(result: dict[str, Any], png: Path) -> Path:
    """The drafts side by side: the share of draft chains accepted up to each position (what sums,
    plus one, to the acceptance length), one line per draft."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend is left alone

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    paths = list(result["drafts"])
    for depth in (1, 2, None):  # the shortest path tails that tell the drafts apart (".../a/draft", ".../b/draft")
        labels = [str(Path(*Path(p).parts[-depth:])) if depth else p for p in paths]
        if len(set(labels)) == len(labels):
            break
    for label, d in zip(labels, result["drafts"].values()):
        pos = d["per_position"]
        ax.plot(range(1, len(pos) + 1), pos, "o-", label=f"{label}: {d['acceptance_length']:.2f}")
    ax.set(xlabel="draft position i", ylabel="chains accepted through position i [fraction]", ylim=(0, 1.05),
           title=f"Teacher-forced acceptance, k={result['k']}, {result['prompts']} "
                 f"{Path(result['dataset']).name} prompts")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(title="draft: acceptance length", fontsize="small")
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    return png


def run_eval(cfg: EvalConfig) -> int:
    """``draftsmith eval``: print each draft's acceptance, write ``--out``."""
    result = evaluate(cfg)
    for path, d in result["drafts"].items():
        print(f"{path}: acceptance length {d['acceptance_length']:.3f} (k={result['k']}, {result['prompts']} "
              f"prompts, {d['positions']} positions); per position {[round(x, 3) for x in d['per_position']]}")
    check = result.get("engine_check")
    if check:
        print(f"engine vs teacher-forced, first {len(check['engine'])} prompts: "
              + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(check["engine"], check["teacher_forced"]))
              + f"; means {statistics.mean(check['engine']):.3f} / {statistics.mean(check['teacher_forced']):.3f}")
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {cfg.out} and {plot_acceptance(result, Path(cfg.out).with_suffix('.png'))}")
    return 0
