"""The speculators draft format (what vLLM serves): write, read back, validate.

A draft directory holds

    config.json        speculators 0.9.0 ``Eagle3SpeculatorConfig`` (what vLLM and speculators read)
    model.safetensors  weights under speculators' names; ``d2t`` (int64 offsets, target = i + d2t[i])
                       and ``t2d`` (bool [V]) only when Vd < V, as speculators writes them
    draftsmith.json    provenance: versions, verifier fingerprint, training config, command, metrics

and, once exported (:func:`draftsmith.export.save_draft`), a ``README.md`` model card.

``config.json`` is written with a fixed key order and only facts of the model (no
versions, no times), so write -> read -> write reproduces it byte for byte; the
provenance that changes between runs lives in ``draftsmith.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Draft, default_aux_layer_ids
from draftsmith.models.quantize import output_vocab_size
from draftsmith.models.verifier import text_config
from draftsmith.utils import atomic_dir, command_line, environment_info

log = logging.getLogger(__name__)

SPECULATORS_VERSION = "0.9.0"  # the format version we target (and test against)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
PROVENANCE_FILE = "draftsmith.json"
PROVENANCE_FORMAT = "draftsmith-draft/1"

# Tensors speculators keeps in its state dict but never saves (training targets only).
_IGNORED_KEYS = {"verifier_lm_head.weight", "verifier_norm.weight"}
_LAYER_TYPES = {"llama": False, "qwen3": True}  # transformer_layer_config.model_type -> qk_norm
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


# ============================================================================ config.json
def speculators_config(cfg: Eagle3Config, *, verifier_name: str | None, num_draft_tokens: int,
                       dtype: torch.dtype) -> dict[str, Any]:
    """The speculators 0.9.0 ``config.json`` of a draft, keys in a fixed order.

    All four norm flags are written: speculators and vLLM default missing ones
    differently (vLLM assumes ``norm_before_residual=True``, speculators False).
    """
    tl = {
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": {k: cfg.rope_parameters[k] for k in sorted(cfg.rope_parameters)},
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    target_hidden = cfg.target_hidden_size if cfg.target_hidden_size not in (None, cfg.hidden_size) else None
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3DraftModel"],
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": target_hidden,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": DTYPE_NAMES[dtype],
        "transformer_layer_config": tl,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_draft_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(cfg.verifier_architectures)},
        },
    }


def _get(d: dict[str, Any], key: str, types: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    """``d[key]`` checked against ``types``; the error names the config.json key."""
    if key not in d or d[key] is None:
        if default is ...:
            raise DraftsmithError(f"{where}: config.json has no {key!r}")
        return default
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise DraftsmithError(f"{where}: config.json {key!r} must be {_type_names(types)}, got {v!r}")
    if not isinstance(v, types):
        raise DraftsmithError(f"{where}: config.json {key!r} must be {_type_names(types)}, got {v!r}")
    return v


def _type_names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join({"int": "an integer", "float": "a number", "bool": "true/false", "str": "a string",
                        "dict": "an object", "list": "a list"}.get(t.__name__, t.__name__) for t in ts)


def _rope_from(tl: dict[str, Any]) -> dict[str, Any]:
    """rope parameters of a layer config: transformers 5 ``rope_parameters`` or legacy keys."""
    rope = tl.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))  # per-layer-type form
    if not isinstance(rope, dict) or not rope:
        rope = dict(tl.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
    rope = dict(rope)
    rope.setdefault("rope_type", "default")
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(tl.get("rope_theta", 10000.0))
    return rope


def config_from_speculators(raw: dict[str, Any], where: str = "draft",
                            verifier_layers: int | None = None) -> tuple[Eagle3Config, dict[str, Any]]:
    """Parse a speculators EAGLE-3 ``config.json`` into an :class:`Eagle3Config`.

    Args:
        raw: the parsed JSON.
        where: what to call the draft in errors (its path).
        verifier_layers: the verifier's layer count, used only when the config leaves
            ``eagle_aux_hidden_state_layer_ids`` null (speculators then uses [2, n//2, n-3]).

    Returns:
        the config and facts that are not part of it (``dtype``, ``notes``).

    Raises:
        DraftsmithError: naming the key that is missing, mistyped or unsupported.
    """
    if not isinstance(raw, dict):
        raise DraftsmithError(f"{where}: config.json must hold a JSON object")
    kind = raw.get("speculators_model_type")
    if kind is None:
        raise DraftsmithError(f"{where}: config.json has no 'speculators_model_type'; this is not a "
                              "speculators-format draft (convert it with speculators first)")
    if kind != "eagle3":
        raise DraftsmithError(f"{where}: speculators_model_type {kind!r} is not supported; draftsmith reads 'eagle3'")
    notes: list[str] = []
    tl = _get(raw, "transformer_layer_config", dict, where)
    tw = f"{where}: transformer_layer_config"
    model_type = tl.get("model_type")
    if model_type not in _LAYER_TYPES:
        raise DraftsmithError(f"{where}: transformer_layer_config.model_type {model_type!r} is not supported; "
                              f"draftsmith reads {sorted(_LAYER_TYPES)}")
    if _get(tl, "num_hidden_layers", int, tw, 1) != 1:
        raise DraftsmithError(f"{where}: transformer_layer_config.num_hidden_layers={tl['num_hidden_layers']}; "
                              "draftsmith supports 1-layer EAGLE-3 drafts")
    if tl.get("hidden_act", "silu") != "silu":
        raise DraftsmithError(f"{where}: transformer_layer_config.hidden_act {tl['hidden_act']!r} is not supported "
                              "(only 'silu')")
    if tl.get("mlp_bias"):
        raise DraftsmithError(f"{where}: transformer_layer_config.mlp_bias=true is not supported")
    layer_types = tl.get("layer_types") or []
    window = tl.get("sliding_window")
    if "sliding_attention" in layer_types and window:
        notes.append(f"sliding-window attention ({window} tokens) is read as full attention: "
                     f"identical for contexts up to {window} tokens")
        log.warning("%s: %s", where, notes[-1])

    H = _get(tl, "hidden_size", int, tw)
    nh = _get(tl, "num_attention_heads", int, tw)
    V = _get(tl, "vocab_size", int, tw)
    Vd = _get(raw, "draft_vocab_size", int, where, 32000)  # speculators' default when absent
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if verifier_layers is None:
            raise DraftsmithError(f"{where}: config.json leaves 'eagle_aux_hidden_state_layer_ids' null; "
                                  "load it against its verifier (load_draft) to use the default [2, n//2, n-3]")
        ids = default_aux_layer_ids(verifier_layers)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftsmithError(f"{where}: config.json 'eagle_aux_hidden_state_layer_ids' must be a non-empty "
                              f"list of integers, got {ids!r}")
    flags = {k: _get(raw, k, bool, where, False) for k in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                           "norm_output")}
    missing = [k for k in flags if k not in raw]
    if missing:
        notes.append(f"norm flag(s) {', '.join(missing)} absent: read as false (speculators' default)")
        log.warning("%s: %s", where, notes[-1])
    spec = _get(raw, "speculators_config", dict, where, {})
    methods = _get(spec, "proposal_methods", list, f"{where}: speculators_config", [])
    k = 5
    if methods:
        if not isinstance(methods[0], dict):
            raise DraftsmithError(f"{where}: speculators_config.proposal_methods[0] must be an object")
        k = _get(methods[0], "speculative_tokens", int, f"{where}: speculators_config.proposal_methods[0]", 5)
    verifier = _get(spec, "verifier", dict, f"{where}: speculators_config", {})
    vname = _get(verifier, "name_or_path", str, f"{where}: speculators_config.verifier", None)
    varch = _get(verifier, "architectures", list, f"{where}: speculators_config.verifier", [])
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    try:
        cfg = Eagle3Config(
            vocab_size=V,
            draft_vocab_size=Vd,
            hidden_size=H,
            intermediate_size=_get(tl, "intermediate_size", int, tw),
            num_attention_heads=nh,
            num_key_value_heads=_get(tl, "num_key_value_heads", int, tw, nh),
            head_dim=_get(tl, "head_dim", int, tw, H // nh),
            aux_layer_ids=list(ids),
            target_hidden_size=_get(raw, "target_hidden_size", int, where, None),
            rms_norm_eps=float(_get(tl, "rms_norm_eps", (int, float), tw, 1e-6)),
            rope_parameters=_rope_from(tl),
            max_position_embeddings=_get(tl, "max_position_embeddings", int, tw, 2048),
            attention_bias=_get(tl, "attention_bias", bool, tw, False),
            qk_norm=_LAYER_TYPES[model_type],
            num_draft_tokens=k,
            verifier_name=vname,
            verifier_architectures=[str(a) for a in varch],
            **flags,
        )
    except DraftsmithError as e:
        raise DraftsmithError(f"{where}: {e}") from None
    if k < 1:
        raise DraftsmithError(f"{where}: speculators_config.proposal_methods[0].speculative_tokens must be >= 1")
    return cfg, {"dtype": dtype_name, "notes": notes}



# ============================================================================ validation
def validate_against_verifier(cfg: Eagle3Config, verifier: Any, what: str = "draft") -> None:
    """Raise unless the draft fits ``verifier`` (a model or its HF config).

    Checks the verifier hidden size (the width of each aux state fed to ``fc``),
    the vocabulary (embedding rows; draft ids map into it) and the aux layer ids
    (HF ``hidden_states`` indices, i.e. inputs of layers 0..n-1, distinct as speculators
    requires).
    """
    vc = text_config(verifier)
    problems = []
    if vc.hidden_size != cfg.verifier_hidden_size:
        problems.append(f"its hidden size is {vc.hidden_size} but the draft reads aux states of width "
                        f"{cfg.verifier_hidden_size} (transformer_layer_config.hidden_size / target_hidden_size)")
    vocab = vc.vocab_size
    if isinstance(verifier, torch.nn.Module) and verifier.get_output_embeddings() is not None:
        vocab = output_vocab_size(verifier)
    if vocab != cfg.vocab_size:
        problems.append(f"its vocabulary has {vocab} tokens but the draft's has {cfg.vocab_size} "
                        "(transformer_layer_config.vocab_size)")
    n = vc.num_hidden_layers
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < n]
    if bad:
        problems.append(f"aux layer ids {cfg.aux_layer_ids} (eagle_aux_hidden_state_layer_ids) must lie in "
                        f"[0, {n - 1}] for its {n} layers")
    if len(set(cfg.aux_layer_ids)) != len(cfg.aux_layer_ids):
        problems.append(f"aux layer ids {cfg.aux_layer_ids} (eagle_aux_hidden_state_layer_ids) must be distinct "
                        "(speculators and vLLM capture each layer once)")
    if problems:
        raise DraftsmithError(f"{what} does not match the verifier: " + "; ".join(problems))


def _local_verifier_config(name: str) -> Any | None:
    """The HF config of a verifier named by path, .gguf or alias, or None if not on this machine."""
    from transformers import AutoConfig

    from draftsmith.models.verifier import ALIASES, resolve_spec

    path = Path(name).expanduser()
    try:
        if name in ALIASES or path.suffix == ".gguf" or path.is_dir():
            return AutoConfig.from_pretrained(resolve_spec(name))
        return AutoConfig.from_pretrained(name, local_files_only=True)  # a hub id already in the HF cache
    except (OSError, ValueError, KeyError):
        return None


def serving_name(name: str | None) -> str | None:
    """What ``speculators_config.verifier.name_or_path`` should say for a verifier spec.

    Local directories become absolute paths; draftsmith aliases and .gguf files become
    the converted Hugging Face directory vLLM and speculators can load; hub ids stay.
    """
    if name is None:
        return None
    from draftsmith.models.verifier import ALIASES, resolve_spec

    path = Path(name).expanduser()
    if name in ALIASES or path.suffix == ".gguf":
        return str(resolve_spec(name).resolve())
    if path.is_dir():
        return str(path.resolve())
    return name


# ============================================================================ write
def weight_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    """The dtype to write weights in: ``dtype``, or ``default`` for None/"auto" (float32 if not writable).

    Raises:
        DraftsmithError: a dtype the format does not store.
    """
    if dtype is None or dtype == "auto":
        return default if default in DTYPE_NAMES else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_NAMES:
            raise DraftsmithError(f"cannot export weights as {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in _DTYPES:
        raise DraftsmithError(f"--dtype {dtype!r}: expected one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def draft_state_dict(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors``: speculators' names; d2t/t2d only when Vd < V."""
    cfg = draft.config
    sd = {}
    for name, t in draft.state_dict().items():
        if name.startswith("rotary_emb."):
            continue
        if name in ("d2t", "t2d"):
            if cfg.draft_vocab_size == cfg.vocab_size:
                continue  # speculators registers no vocab mapping then
            t = t.to(torch.long if name == "d2t" else torch.bool)
        elif name == "embed_tokens.weight" and getattr(draft, "embed_tokens_from_verifier", False):
            continue  # a draft that shares the verifier's embedding (vLLM does the same when absent)
        else:
            t = t.to(dtype)
        sd[name] = t.detach().to("cpu").contiguous()
    return sd

def write_draft(draft: Eagle3Draft, out_dir: str | Path, *, verifier_name: str | None = None,
                num_draft_tokens: int | None = None, fingerprint: str | None = None,
                provenance: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
                dtype: str | torch.dtype | None = None, verifier: Any = None) -> Path:
    """Write ``draft`` as a speculators EAGLE-3 draft directory (atomically), without a model card.

    Args:
        draft: the draft to export.
        out_dir: target directory (replaced as a whole when the write succeeds).
        verifier_name: ``speculators_config.verifier.name_or_path``, what vLLM loads as the
            verifier (default: the verifier the draft was trained with).
        num_draft_tokens: ``speculative_tokens``, vLLM's default k (default: the draft's).
        fingerprint: the verifier's draftsmith fingerprint, for the provenance.
        provenance: extra provenance (``training``: data, budget, config; ``source``; ...).
        metrics: draftsmith's measurements (``acceptance_length``, ``per_position_acceptance``,
            ``speedup``, ...), recorded in the provenance.
        dtype: float dtype of the weights (None/"auto": the draft's own).
        verifier: the verifier model or HF config to validate against (default: the named
            verifier's config when it is on this machine).

    Returns:
        the directory written.

    Raises:
        DraftsmithError: if the draft does not match the verifier it names.
    """
    cfg = draft.config
    name = serving_name(verifier_name if verifier_name is not None else cfg.verifier_name)
    k = num_draft_tokens if num_draft_tokens is not None else cfg.num_draft_tokens
    if k < 1:
        raise DraftsmithError(f"--num-draft-tokens must be >= 1, got {k}")
    if torch.isnan(draft.fc.weight).any() or torch.isnan(draft.lm_head.weight).any():
        raise DraftsmithError("the draft has NaN weights (fc or lm_head); refusing to export it")
    checked_against = "the given verifier" if verifier is not None else None
    if verifier is None and name is not None:
        verifier = _local_verifier_config(name)
        checked_against = name if verifier is not None else None
    if verifier is not None:
        validate_against_verifier(cfg, verifier, what=f"draft (for verifier {name!r})")
        arch = list(getattr(getattr(verifier, "config", verifier), "architectures", None) or [])
        if arch:
            cfg = dataclasses.replace(cfg, verifier_architectures=arch)
    elif name is None:
        log.warning("the draft names no verifier: `vllm serve DRAFT` and speculators' loader need "
                    "speculators_config.verifier.name_or_path; pass verifier_name (--verifier-name)")
    else:
        log.warning("verifier %r is not on this machine: the draft is exported unchecked against it", name)
    wdtype = weight_dtype(dtype, draft.fc.weight.dtype)
    config = speculators_config(cfg, verifier_name=name, num_draft_tokens=k, dtype=wdtype)
    tensors = draft_state_dict(draft, wdtype)
    prov = build_provenance(cfg, verifier_name=name, fingerprint=fingerprint, checked_against=checked_against,
                            extra=provenance, metrics=metrics)
    from safetensors.torch import save_file

    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / PROVENANCE_FILE).write_text(json.dumps(prov, indent=2, default=str) + "\n")
    return out



def build_provenance(cfg: Eagle3Config, *, verifier_name: str | None, fingerprint: str | None,
                     checked_against: str | None, extra: dict[str, Any] | None,
                     metrics: dict[str, Any] | None) -> dict[str, Any]:
    """The content of ``draftsmith.json``: where the draft came from and what it measured."""
    env = environment_info()
    prov: dict[str, Any] = {
        "format": PROVENANCE_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "draftsmith": env["draftsmith"],
        "versions": {k: env[k] for k in ("python", "torch", "transformers")},
        "speculators_format": SPECULATORS_VERSION,
        "command": command_line(),
        "verifier": {"name_or_path": verifier_name, "architectures": list(cfg.verifier_architectures),
                     "fingerprint": fingerprint, "checked_against": checked_against},
        "draft": {"aux_layer_ids": list(cfg.aux_layer_ids), "draft_vocab_size": cfg.draft_vocab_size,
                  "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
                  "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output},
    }
    reserved = set(prov)
    prov.update({key: v for key, v in (extra or {}).items() if key not in reserved})
    if metrics:
        prov["metrics"] = metrics
    return prov


# ============================================================================ read
def read_config(path: str | Path, verifier_layers: int | None = None) -> tuple[Eagle3Config, dict[str, Any]]:
    """Parse ``path/config.json`` (see :func:`config_from_speculators`)."""
    p = Path(path)
    f = p / CONFIG_FILE
    if not p.is_dir():
        raise DraftsmithError(f"draft {str(p)!r} is not a directory")
    if not f.is_file():
        raise DraftsmithError(f"draft {str(p)!r} has no {CONFIG_FILE}")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{f} is not valid JSON: {e}") from None
    return config_from_speculators(raw, where=str(p), verifier_layers=verifier_layers)


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = [path / WEIGHTS_FILE]
    if not files[0].is_file():
        index = path / WEIGHTS_INDEX_FILE
        if not index.is_file():
            raise DraftsmithError(f"draft {str(path)!r} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX_FILE})")
        try:
            files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise DraftsmithError(f"{index} is not a safetensors index: {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise DraftsmithError(f"cannot read {f}: {e}") from None
    return tensors


def read_draft(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               verifier_layers: int | None = None) -> Eagle3Draft:
    """Read a speculators-format EAGLE-3 draft (ours or anyone's) into an :class:`Eagle3Draft`.

    Args:
        path: the draft directory.
        device: where to put it.
        dtype: float dtype (None: the file's).
        verifier_layers: verifier depth, for configs that leave the aux layer ids null.

    Returns:
        the draft in eval mode. Without ``embed_tokens.weight`` in the file its
        embedding is NaN and ``draft.embed_tokens_from_verifier`` is True: fill it
        from the verifier (:func:`load_draft` does).

    Raises:
        DraftsmithError: naming the bad key or tensor.
    """
    p = Path(path)
    cfg, _ = read_config(p, verifier_layers=verifier_layers)
    tensors = _load_tensors(p)
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    file_dtype = floats[0] if floats else torch.float32
    target_dtype = file_dtype if dtype is None else weight_dtype(dtype, file_dtype)
    with torch.device("meta"):
        probe = Eagle3Draft(cfg)  # shapes only, no allocation
    expected = {n: t for n, t in probe.state_dict().items() if not n.startswith("rotary_emb.")}
    tensors = {k: v for k, v in tensors.items() if k not in _IGNORED_KEYS}
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise DraftsmithError(f"{p}: {WEIGHTS_FILE} has tensors this config does not define: "
                              f"{', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    missing = sorted(set(expected) - set(tensors) - optional)
    if missing:
        raise DraftsmithError(f"{p}: {WEIGHTS_FILE} lacks {', '.join(missing)}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise DraftsmithError(f"{p}: tensor {name} has shape {list(t.shape)}, config.json implies "
                                  f"{list(expected[name].shape)}")
    d2t, t2d = _vocab_maps(tensors.get("d2t"), tensors.get("t2d"), V, Vd, p)
    state = {n: (t.to(target_dtype) if t.is_floating_point() else t) for n, t in tensors.items()
             if n not in ("d2t", "t2d")}
    no_embed = "embed_tokens.weight" not in tensors
    if no_embed:
        state["embed_tokens.weight"] = torch.full(expected["embed_tokens.weight"].shape, math.nan,
                                                  dtype=target_dtype)
    state["d2t"], state["t2d"] = d2t, t2d
    draft = probe
    draft.load_state_dict(state, strict=True, assign=True)  # the meta tensors become the file's
    # rope tables are not in the file: rebuild them (in float32) on a real device
    draft.rotary_emb = type(draft.rotary_emb)(cfg.rope_config())
    draft.embed_tokens_from_verifier = no_embed
    return draft.to(device=device).eval()


def _vocab_maps(d2t: torch.Tensor | None, t2d: torch.Tensor | None, V: int, Vd: int,
                where: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Check (or derive) d2t offsets and the t2d mask with speculators' semantics."""
    if d2t is None and t2d is None:
        if Vd != V:
            raise DraftsmithError(f"{where}: draft_vocab_size {Vd} < vocab_size {V} but {WEIGHTS_FILE} has "
                                  "no d2t / t2d vocabulary mapping")
        return torch.zeros(Vd, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    if t2d is not None:
        t2d = t2d.to(torch.bool)
        if int(t2d.sum()) != Vd:
            raise DraftsmithError(f"{where}: t2d marks {int(t2d.sum())} tokens but draft_vocab_size is {Vd}")
    if d2t is None:
        d2t = torch.nonzero(t2d).squeeze(1) - torch.arange(Vd)  # speculators orders draft ids by target id
    d2t = d2t.to(torch.long)
    target = torch.arange(Vd) + d2t
    if target.min() < 0 or target.max() >= V or target.unique().numel() != Vd:
        raise DraftsmithError(f"{where}: d2t maps draft ids outside [0, {V}) or onto one token twice")
    if t2d is None:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[target] = True
    elif not t2d[target].all():
        raise DraftsmithError(f"{where}: d2t and t2d disagree (a draft id maps to a token t2d does not mark)")
    return d2t, t2d


def read_provenance(path: str | Path) -> dict[str, Any] | None:
    """``draftsmith.json`` of a draft directory (None for drafts made elsewhere)."""
    f = Path(path) / PROVENANCE_FILE
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{f} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else None


