"""llama.cpp as a serving engine: ``llama-server`` plain or with an EAGLE-3 draft.

The build comes from ``make setup-llamacpp`` (llama.cpp vendored in the pinned
llama-cpp-python sdist, CPU only) under ``.engines/llama.cpp`` or
``$DRAFTSMITH_LLAMACPP_DIR``; it holds the server and the field's own converter,
``convert_hf_to_gguf.py``, which turns speculators-format drafts and HF verifiers
into GGUF.

How llama.cpp serves an EAGLE-3 draft (``src/models/eagle3.cpp``,
``common/speculative.cpp`` of that build), and so what a draft must be to be served
as trained:

- three aux layers, each read as the *input* of that verifier layer (our and vLLM's
  ``hidden_states[i]``), concatenated, optionally RMS-normed (``norm_before_fc``),
  then ``fc``;
- one Llama decoder layer reading ``[input_layernorm(embed), hidden_norm(g)]``, no
  biases, no q/k norm; residual from ``hidden_norm(g)`` or raw ``g``
  (``norm_before_residual``);
- the next draft step reads the *pre-norm* hidden state (there is no ``norm_output``);
- draft ids map to verifier ids through ``d2t``.

What the server reports: each ``/completion`` answer's ``timings`` carry
``draft_n`` and ``draft_n_accepted``; the Prometheus ``/metrics`` (``--metrics``) add
the verification steps and accepted tokens per draft position. The engine reads
the latter before and after each request (one client, one slot) so that
:class:`SpecCounters` hold that request alone, checked against ``timings``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from draftsmith.engines.base import EngineResult, ServerProcess, SpecCounters, free_port, http_json, http_text, log_tail
from draftsmith.errors import DraftsmithError
from draftsmith.models.speculators import (CONFIG_FILE, DTYPE_NAMES, read_config, read_draft,
                                          validate_against_verifier, weight_dtype, write_draft)
from draftsmith.utils import cache_dir

log = logging.getLogger(__name__)

BUILD_ENV = "DRAFTSMITH_LLAMACPP_DIR"
# An editable install (the repo's own .venv) finds the Makefile's build next to src/.
_REPO_BUILD = Path(__file__).resolve().parents[3] / ".engines" / "llama.cpp"
SETUP_HINT = ("run `make setup-llamacpp` (builds llama-server from the pinned llama-cpp-python sdist into "
              f".engines/llama.cpp) or set {BUILD_ENV} to such a build")
# rope types llama.cpp's converter writes and its graph computes as transformers does
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # torch dtype name -> converter --outtype
#: quantized GGUF drafts the exporter writes: name -> ggml type id of the quantized weights
GGUF_QUANTS = {"q8_0": 8}


# ============================================================================ the build
@dataclass(frozen=True)
class LlamaCppBuild:
    """A llama.cpp build made by ``make setup-llamacpp``.

    Attributes:
        root: the directory holding ``src/`` (the sources, with the converter),
            ``build/bin/llama-server`` and ``pydeps/`` (the converter's extra imports).
    """

    root: Path

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def converter(self) -> Path:
        return self.root / "src" / "convert_hf_to_gguf.py"

    @property
    def pydeps(self) -> Path:
        return self.root / "pydeps"


def find_build(root: str | Path | None = None) -> LlamaCppBuild:
    """The llama.cpp build at ``root``, ``$DRAFTSMITH_LLAMACPP_DIR`` or the repo's ``.engines/llama.cpp``.

    Raises:
        DraftsmithError: when the server or the converter is missing, saying how to build them.
    """
    b = LlamaCppBuild(Path(root or os.environ.get(BUILD_ENV) or _REPO_BUILD).expanduser().resolve())
    for p in (b.server, b.converter):
        if not p.is_file():
            raise DraftsmithError(f"llama.cpp build not found: {p} is missing; {SETUP_HINT}")
    return b


def _run_logged(argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
                what: str = "command") -> None:
    """Run ``argv`` to completion with its output in ``log_path``; its process group dies with us."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        code = proc.wait()
    except BaseException:  # Ctrl-C, SIGTERM: the converter must not outlive us
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if code != 0:
        raise DraftsmithError(f"{what} failed (exit code {code}); its log ({log_path}) ends with:\n"
                              f"{log_tail(log_path)}")


def convert_hf_to_gguf(model_dir: str | Path, out: str | Path, *, outtype: str = "f32",
                       target_model_dir: str | Path | None = None, build: LlamaCppBuild | None = None,
                       log_path: str | Path | None = None) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` (with its bundled gguf-py) on ``model_dir``.

    Args:
        model_dir: an HF model directory, or a speculators EAGLE-3 draft directory.
        out: the GGUF file to write (atomically: a failed run leaves nothing there).
        outtype: ``f32``, ``f16``, ``bf16`` or ``q8_0``.
        target_model_dir: the verifier's HF directory (config and tokenizer); required
            by the converter for EAGLE-3 drafts.
        build: the llama.cpp build (default: :func:`find_build`).
        log_path: the converter's log (default: next to ``out``).

    Returns:
        ``out``.
    """
    build = build or find_build()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    argv = [sys.executable, str(build.converter), str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
    if target_model_dir is not None:
        argv += ["--target-model-dir", str(target_model_dir)]
    pythonpath = os.pathsep.join(p for p in (str(build.pydeps), os.environ.get("PYTHONPATH", "")) if p)
    try:
        _run_logged(argv, Path(log_path or out.with_name(out.name + ".convert.log")), env={"PYTHONPATH": pythonpath},
                    what=f"llama.cpp's convert_hf_to_gguf.py on {model_dir}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ============================================================================ what llama.cpp serves
def unsupported_draft_features(cfg: Any, has_embedding: bool = True) -> list[str]:
    """Parts of a draft (an :class:`~draftsmith.models.eagle3.Eagle3Config`) that llama.cpp computes differently.

    Args:
        cfg: the draft's config.
        has_embedding: whether the draft carries its own ``embed_tokens.weight``
            (without it llama.cpp uses the verifier's, which needs equal widths).

    Returns:
        one line per problem, each naming the config.json key; empty when llama.cpp's
        ``draft-eagle3`` runs the draft as draftsmith and vLLM do.
    """
    problems = []
    if cfg.fc_norm:
        problems.append("fc_norm: true (an RMSNorm per aux layer before fc): llama.cpp's converter drops "
                        "those weights and its eagle3 graph has no such norm")
    if cfg.norm_output:
        problems.append("norm_output: true (the next draft step reads norm(h)): llama.cpp feeds the "
                        "pre-norm hidden state to the next step")
    if cfg.qk_norm:
        problems.append("transformer_layer_config.model_type 'qwen3' (q/k RMSNorm): llama.cpp's eagle3 layer "
                        "has no q/k norm")
    if cfg.attention_bias:
        problems.append("transformer_layer_config.attention_bias: true: llama.cpp's eagle3 layer has no "
                        "projection biases")
    if len(cfg.aux_layer_ids) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids {cfg.aux_layer_ids}: llama.cpp's eagle3 needs "
                        "exactly 3 aux layers")
    rope = cfg.rope_parameters.get("rope_type", "default")
    if rope not in _ROPE_TYPES:
        problems.append(f"transformer_layer_config rope_type {rope!r}: llama.cpp's converter writes only "
                        f"{', '.join(_ROPE_TYPES)}")
    if not has_embedding and cfg.hidden_size != cfg.verifier_hidden_size:
        problems.append(f"no embed_tokens.weight while hidden_size {cfg.hidden_size} != target_hidden_size "
                        f"{cfg.verifier_hidden_size}: llama.cpp would embed with the verifier's "
                        f"{cfg.verifier_hidden_size}-wide table")
    return problems


def check_draft_supported(cfg: Any, has_embedding: bool = True, what: str = "draft") -> None:
    """Raise unless llama.cpp's ``draft-eagle3`` computes the draft as trained (:func:`unsupported_draft_features`)."""
    problems = unsupported_draft_features(cfg, has_embedding)
    if problems:
        raise DraftsmithError(
            f"{what} cannot be served by llama.cpp as trained: " + "; ".join(problems)
            + ". Serve it with vLLM (the speculators format), or train a draft without these options "
            "(draftsmith's defaults) for llama.cpp")


# GGUF value types (gguf-py's GGUFValueType) -> struct format; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGML_NUMPY = {0: "<f4", 1: "<f2", 26: "<i4", 27: "<i8", 28: "<f8"}  # plain ggml types: F32, F16, I32, I64, F64


@dataclass
class GGUFInfo:
    """The header of a GGUF file: metadata and where each tensor lies.

    Attributes:
        path: the file.
        meta: key -> value; arrays longer than 1024 entries (the vocabulary) are left out.
        tensors: name -> (ggml type id, shape as ``ne`` (fastest dimension first), byte offset in the file).
    """

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, tuple[int, list[int], int]]

    def array(self, name: str) -> Any:
        """A plain-typed tensor (F32, F16, I32, I64, F64) as a numpy array of its ``ne`` reversed shape."""
        import numpy as np

        kind, shape, offset = self.tensors[name]
        if kind not in _GGML_NUMPY:
            raise DraftsmithError(f"{self.path}: tensor {name} has ggml type {kind}, not a plain one")
        n = int(np.prod(shape))
        return np.fromfile(self.path, dtype=_GGML_NUMPY[kind], count=n, offset=offset).reshape(shape[::-1])


def read_gguf(path: str | Path) -> GGUFInfo:
    """Read a GGUF header (the ``gguf`` package's reader decodes every vocabulary string: a minute here)."""
    import mmap
    import struct

    path = Path(path)

    def fail(why: str) -> DraftsmithError:
        return DraftsmithError(f"{path} is not a readable GGUF file: {why}")

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            pos = 0

            def take(fmt: str) -> Any:
                nonlocal pos
                v = struct.unpack_from(fmt, m, pos)[0]
                pos += struct.calcsize(fmt)
                return v

            def string() -> str:
                nonlocal pos
                n = take("<Q")
                v = bytes(m[pos:pos + n]).decode("utf-8", errors="replace")
                pos += n
                return v

            def value(kind: int, keep: bool = True) -> Any:
                nonlocal pos
                if kind in _GGUF_SCALARS:
                    return take(_GGUF_SCALARS[kind])
                if kind == 8:
                    return string()
                if kind == 9:
                    sub, n = take("<I"), take("<Q")
                    keep = keep and n <= 1024
                    if sub in _GGUF_SCALARS and not keep:
                        pos += n * struct.calcsize(_GGUF_SCALARS[sub])
                        return None
                    if sub == 8 and not keep:  # the vocabulary: skip the strings undecoded
                        for _ in range(n):
                            pos += 8 + struct.unpack_from("<Q", m, pos)[0]
                        return None
                    items = [value(sub, keep) for _ in range(n)]
                    return items if keep else None
                raise fail(f"unknown value type {kind} at byte {pos}")

            if m[:4] != b"GGUF":
                raise fail("no GGUF magic")
            pos = 4
            version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
            if version < 2:
                raise fail(f"GGUF version {version} is too old")
            meta = {}
            for _ in range(n_kv):
                key = string()
                meta[key] = value(take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = string()
                shape = [take("<Q") for _ in range(take("<I"))]
                infos.append((name, take("<I"), shape, take("<Q")))
            align = int(meta.get("general.alignment") or 32)
            data = pos + (-pos) % align
    except (OSError, ValueError, struct.error) as e:  # short file, unreadable: not a GGUF we can serve
        raise fail(str(e)) from None
    return GGUFInfo(path, meta, {name: (kind, shape, data + off) for name, kind, shape, off in infos})


def check_draft_gguf(path: str | Path, cfg: Any, draft_to_target: Sequence[int] | None = None,
                     quant: str | None = None) -> None:
    """Check that a converted draft GGUF says what the draft's config says.

    Args:
        path: the GGUF file.
        cfg: the draft's :class:`~draftsmith.models.eagle3.Eagle3Config`.
        draft_to_target: the verifier id of every draft id (checked against the file's
            ``d2t``, which llama.cpp stores as absolute ids); None when Vd == V.
        quant: a key of :data:`GGUF_QUANTS`: the head must be stored in that type.

    Raises:
        DraftsmithError: naming the first disagreement.
    """
    import numpy as np

    path = Path(path)
    g = read_gguf(path)
    meta, tensors = g.meta, {n: (t, shape) for n, (t, shape, _) in g.tensors.items()}
    expect = {
        "general.architecture": "eagle3",
        "eagle3.target_layers": list(cfg.aux_layer_ids),
        "eagle3.target_hidden_size": cfg.verifier_hidden_size,
        "eagle3.embedding_length": cfg.hidden_size,
        "eagle3.block_count": 1,
        "eagle3.norm_before_residual": cfg.norm_before_residual,
        "eagle3.norm_before_fc": cfg.norm_before_fc,
        "eagle3.vocab_size": cfg.vocab_size,
    }
    for key, want in expect.items():
        if meta.get(key) != want:
            raise DraftsmithError(f"{path}: GGUF key {key} is {meta.get(key)!r}, the draft's config says {want!r} "
                                  "(a llama.cpp converter this draftsmith does not know?)")
    A, Ht, H = len(cfg.aux_layer_ids), cfg.verifier_hidden_size, cfg.hidden_size
    want_shapes = {"fc.weight": [A * Ht, H], "output.weight": [H, cfg.draft_vocab_size]}
    for name, shape in want_shapes.items():
        if name not in tensors or tensors[name][1] != shape:
            raise DraftsmithError(f"{path}: tensor {name} is {tensors.get(name)}, expected shape {shape}")
    if quant is not None and g.tensors["output.weight"][0] != GGUF_QUANTS[quant]:
        raise DraftsmithError(f"{path}: output.weight has ggml type {g.tensors['output.weight'][0]}, not {quant} "
                              f"({GGUF_QUANTS[quant]}): the converter did not quantize the draft")
    if draft_to_target is not None and (
            "d2t" not in g.tensors or not np.array_equal(g.array("d2t").reshape(-1), np.asarray(draft_to_target))):
        raise DraftsmithError(f"{path}: d2t does not map the draft vocabulary onto the verifier ids the draft uses")


def check_gguf_pair(draft_gguf: str | Path, verifier_gguf: str | Path) -> None:
    """Refuse a draft GGUF that does not fit the verifier GGUF (llama.cpp would abort or serve garbage)."""
    dmeta = read_gguf(draft_gguf).meta
    v = read_gguf(verifier_gguf)
    vmeta, vtensors = v.meta, {n: (t, shape) for n, (t, shape, _) in v.tensors.items()}
    if dmeta.get("general.architecture") != "eagle3":
        raise DraftsmithError(f"{draft_gguf} is not an EAGLE-3 draft (general.architecture "
                              f"{dmeta.get('general.architecture')!r}); export one with "
                              "`draftsmith export DRAFT --format gguf`")
    arch = vmeta.get("general.architecture")
    n_layer, width = vmeta.get(f"{arch}.block_count"), vmeta.get(f"{arch}.embedding_length")
    vocab = vmeta.get(f"{arch}.vocab_size") or (vtensors.get("token_embd.weight", ("", [0, 0]))[1][1])
    problems = []
    if dmeta.get("eagle3.target_hidden_size") != width:
        problems.append(f"it reads aux states of width {dmeta.get('eagle3.target_hidden_size')}, the verifier's "
                        f"hidden size is {width}")
    if any(not 0 <= i < (n_layer or 0) for i in dmeta.get("eagle3.target_layers") or []):
        problems.append(f"aux layers {dmeta.get('eagle3.target_layers')} do not lie in [0, {n_layer}) ")
    if dmeta.get("eagle3.vocab_size") not in (None, vocab):
        problems.append(f"its vocabulary has {dmeta.get('eagle3.vocab_size')} tokens, the verifier's {vocab}")
    if problems:
        raise DraftsmithError(f"draft {draft_gguf} does not match verifier {verifier_gguf}: " + "; ".join(problems))


# ============================================================================ models as GGUF
def _dir_key(d: Path) -> str:
    """Content key of an HF model directory: its config and the size+head+tail of each weight file."""
    from draftsmith.models.verifier import file_key

    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")) + sorted(d.glob("*.bin")):
        h.update(f"{f.name}:{file_key(f)}".encode())
    return h.hexdigest()[:16]


def verifier_gguf(spec: str | os.PathLike, build: LlamaCppBuild | None = None) -> Path:
    """The GGUF file llama-server runs for a verifier spec.

    An alias or a ``.gguf`` file is served as is (the packaged SmolLM2 runs its Q4_1
    weights); an HF directory is converted once with llama.cpp's converter to
    float32 (what draftsmith's own engine computes in on CPU), cached.
    """
    from draftsmith.models.verifier import ALIASES

    text = str(spec)
    if text in ALIASES:
        return ALIASES[text]()
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftsmithError(f"verifier {text!r}: GGUF file not found")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"verifier {text!r}: not an alias ({', '.join(sorted(ALIASES))}), a .gguf file or a "
                              "local Hugging Face model directory; llama.cpp needs one of them")
    out = cache_dir() / "llamacpp" / "verifiers" / f"{path.resolve().name}-{_dir_key(path)}-f32.gguf"
    if not out.is_file():
        log.info("converting verifier %s to GGUF for llama.cpp (once): %s", path, out)
        convert_hf_to_gguf(path, out, outtype="f32", build=build)
    return out


def draft_gguf(draft: str | os.PathLike, verifier: str, build: LlamaCppBuild | None = None,
               dtype: str | None = None) -> Path:
    """The GGUF of a draft: a ``.gguf`` file as is, a speculators directory exported once (cached)
    in ``dtype`` (:func:`export_gguf`; None: the draft's own)."""
    path = Path(draft).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftsmithError(f"draft {str(draft)!r}: GGUF file not found")
        return path
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"draft {str(draft)!r} is neither a .gguf file nor a draft directory with config.json")
    key = hashlib.sha256(f"{_dir_key(path)}|{verifier}".encode()).hexdigest()[:16]
    out = cache_dir() / "llamacpp" / "drafts" / f"{path.resolve().name}-{key}{'-' + dtype if dtype else ''}.gguf"
    if not out.is_file():
        export_gguf(path, out, verifier=verifier, build=build, dtype=dtype)
    return out


# ============================================================================ GGUF (llama.cpp)
def _named_verifier(draft_dir: Path) -> str | None:
    """``speculators_config.verifier.name_or_path`` of a draft directory, unparsed otherwise."""
    f = draft_dir / CONFIG_FILE
    try:
        raw = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # read_config below names the problem
    spec = raw.get("speculators_config") if isinstance(raw, dict) else None
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return name if isinstance(name, str) else None


def export_gguf(draft_dir: str | Path, out: str | Path, *, verifier: str | None = None,
                dtype: str | torch.dtype | None = None, build: Any = None) -> Path:
    """Write a draft as the GGUF that llama.cpp's ``--spec-type draft-eagle3`` loads.

    The draft is checked against its verifier (hidden size, vocabulary, aux layers)
    and against what llama.cpp's eagle3 graph implements, converted by llama.cpp's own
    ``convert_hf_to_gguf.py`` (which takes the vocabulary from the verifier), and the
    file is read back and checked against the draft before it replaces ``out``.

    Args:
        draft_dir: a speculators-format EAGLE-3 draft directory.
        out: the ``.gguf`` file to write.
        verifier: the verifier (alias, .gguf, HF directory); default: the one the draft names.
        dtype: weight dtype (None/"auto": the draft's own), or ``q8_0``: the converter quantizes
            the draft's matrices to 8 bits per weight in blocks of 32 (one scale each), the
            precision llama.cpp users often serve a draft in.
        build: a :class:`~draftsmith.engines.llamacpp.LlamaCppBuild` (default: the Makefile's).

    Returns:
        ``out``.

    Raises:
        DraftsmithError: the build is missing, the verifier is not on this machine, the
            draft does not match it, or llama.cpp would compute the draft differently.
    """
    import tempfile

    from transformers import AutoConfig

    from draftsmith.models.verifier import resolve_spec

    build = build or find_build()  # before any work: without the converter nothing can be written
    src, out = Path(draft_dir), Path(out)
    if out.suffix != ".gguf":
        raise DraftsmithError(f"--out {str(out)!r}: a GGUF export is one file; name it *.gguf")
    name = verifier or _named_verifier(src)
    if name is None:
        read_config(src, verifier_layers=1)  # a missing or broken config.json is the first thing to report
        raise DraftsmithError(f"draft {str(src)!r} names no verifier (speculators_config.verifier.name_or_path); "
                              "pass --verifier: llama.cpp's converter takes the vocabulary from it")
    try:
        vdir = resolve_spec(name)
    except DraftsmithError as e:
        raise DraftsmithError(f"{e}; a GGUF export needs the verifier on this machine (pass --verifier)") from None
    vconfig = AutoConfig.from_pretrained(vdir)
    layers = vconfig.get_text_config().num_hidden_layers
    cfg, _ = read_config(src, verifier_layers=layers)
    validate_against_verifier(cfg, vconfig, what=f"draft {str(src)!r} (for verifier {name!r})")
    draft = read_draft(src, verifier_layers=layers)
    check_draft_supported(draft.config, has_embedding=not draft.embed_tokens_from_verifier, what=f"draft {str(src)!r}")
    quant = dtype if dtype in GGUF_QUANTS else None
    wdtype = torch.float32 if quant else weight_dtype(dtype, draft.fc.weight.dtype)  # q8_0 from float32
    d2t = draft.draft_to_target.tolist() if cfg.draft_vocab_size < cfg.vocab_size else None
    staged_gguf = out.with_name(f".{out.name}.{os.getpid()}.staged")
    try:
        with tempfile.TemporaryDirectory(prefix="draftsmith-gguf-") as tmp:
            # the converter reads exactly what we validated: our own speculators write of the draft
            staged = write_draft(draft, Path(tmp) / "draft", verifier_name=str(vdir), dtype=wdtype, verifier=vconfig)
            outtype = quant or OUTTYPES[DTYPE_NAMES[wdtype]]
            convert_hf_to_gguf(staged, staged_gguf, outtype=outtype, target_model_dir=vdir,
                               build=build, log_path=cache_dir() / "llamacpp" / "logs" / f"convert-{out.stem}.log")
        check_draft_gguf(staged_gguf, draft.config, d2t, quant)
        os.replace(staged_gguf, out)
    finally:
        staged_gguf.unlink(missing_ok=True)
    return out


# ============================================================================ the server
def parse_metrics(text: str) -> SpecCounters:
    """llama-server's speculative counters from its Prometheus ``/metrics`` text."""
    values: dict[str, float] = {}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r'llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}\s+(\S+)', line)
        if m:
            per_pos[int(m.group(1))] = int(float(m.group(2)))
            continue
        name, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            values[name] = float(value)
    return SpecCounters(drafts=int(values.get("llamacpp:spec_decode_num_drafts_total", 0)),
                        draft_tokens=int(values.get("llamacpp:spec_decode_num_draft_tokens_total", 0)),
                        accepted_tokens=int(values.get("llamacpp:spec_decode_num_accepted_tokens_total", 0)),
                        accepted_per_position=[per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)])


class LlamaCppEngine:
    """``llama-server`` on 127.0.0.1 with a verifier GGUF and optionally an EAGLE-3 draft.

    Use as a context manager; the server is stopped on every exit path. Each
    :meth:`generate` is one greedy completion of token ids.

    Args:
        verifier: alias, ``.gguf`` file or HF directory (see :func:`verifier_gguf`).
        draft: None (plain decoding), a draft ``.gguf`` or a speculators draft directory
            (exported to GGUF once, after the checks of :func:`export_gguf`).
        k: tokens drafted per round; llama.cpp always drafts exactly k
            (``--spec-draft-p-min 0``: no confidence cut; ``--spec-draft-n-min k``).
        threads: CPU threads for the verifier and the draft (generation and batches).
        ctx_size: context of the single slot: prompt + new tokens + k + 2 must fit.
        work_dir: where the server's logs go (default: the draftsmith cache).
        port: a fixed port (default: a free one, chosen at start).
        startup_timeout: seconds to wait for ``/health``.
        build_dir: the llama.cpp build (default: :func:`find_build`).
        extra_args: more llama-server flags, appended last (e.g. ``["-fa", "off"]``).
    """

    name = "llama.cpp"

    def __init__(self, verifier: str, draft: str | os.PathLike | None = None, k: int = 3, threads: int = 2,
                 ctx_size: int = 4096, work_dir: str | Path | None = None, port: int | None = None,
                 startup_timeout: float = 300.0, build_dir: str | Path | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        if k < 1:
            raise DraftsmithError(f"llama.cpp: k (draft tokens per round) must be >= 1, got {k}")
        if threads < 1:
            raise DraftsmithError(f"llama.cpp: threads must be >= 1, got {threads}")
        self.verifier, self.draft, self.k, self.threads, self.ctx_size = str(verifier), draft, k, threads, ctx_size
        self.work_dir = Path(work_dir) if work_dir is not None else cache_dir() / "llamacpp" / "logs"
        self.port, self.startup_timeout, self.build_dir = port, startup_timeout, build_dir
        self.extra_args = [str(a) for a in extra_args]
        self.server: ServerProcess | None = None
        self.argv: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    def command(self, model: Path, draft: Path | None, port: int) -> list[str]:
        """The llama-server command line (also what a user would run by hand)."""
        build = find_build(self.build_dir)
        t = str(self.threads)
        argv = [str(build.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-t", t, "-tb", t, "-c", str(self.ctx_size),
                "-np", "1",            # one slot: the whole context is one request's, counters are per request
                "--cache-ram", "0",    # no prompt cache between requests: each is measured from scratch
                "--metrics"]           # /metrics: verification steps and per-position acceptance
        if draft is not None:
            argv += ["-md", str(draft), "--spec-type", "draft-eagle3",
                     "--spec-draft-n-max", str(self.k), "--spec-draft-n-min", str(self.k),
                     "--spec-draft-p-min", "0",   # draft k tokens even when the draft is unsure (as vLLM does)
                     "-td", t, "-tbd", t]
        return argv + self.extra_args

    def start(self) -> "LlamaCppEngine":
        """Resolve the models (converting once if needed), start the server, wait until it answers."""
        build = find_build(self.build_dir)
        model = verifier_gguf(self.verifier, build)
        dgguf = None
        if self.draft is not None:
            dgguf = draft_gguf(self.draft, self.verifier, build)
            check_gguf_pair(dgguf, model)
        self.port = self.port or free_port()
        self.argv = self.command(model, dgguf, self.port)
        log_path = self.work_dir / f"llama-server-{os.getpid()}-{self.port}.log"
        self.server = ServerProcess("llama-server", self.argv, log_path, f"{self.base_url}/health",
                                    startup_timeout=self.startup_timeout)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> "LlamaCppEngine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The server's process id (kept after it stopped)."""
        return self.server.pid if self.server is not None else None

    def _counters(self) -> SpecCounters:
        return parse_metrics(http_text(f"{self.base_url}/metrics"))

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool = False) -> EngineResult:
        """One greedy completion of ``prompt_ids`` (no prompt cache), with this request's counters.

        Raises:
            DraftsmithError: the request does not fit the context, the server fails, or
                its counters disagree with each other.
        """
        if self.server is None or self.server.proc is None:
            raise DraftsmithError("llama.cpp engine is not running; use it as a context manager")
        need = len(prompt_ids) + max_new_tokens + self.k + 2
        if need > self.ctx_size:
            raise DraftsmithError(f"llama.cpp: prompt ({len(prompt_ids)}) + new tokens ({max_new_tokens}) + k + 2 = "
                                  f"{need} exceed the context size {self.ctx_size}; start the engine with a larger "
                                  "ctx_size")
        before = self._counters() if self.speculative else None
        payload = {"prompt": [int(t) for t in prompt_ids], "n_predict": max_new_tokens,
                   # temperature 0 alone in the chain: argmax, with no penalties or filters in the way
                   "temperature": 0.0, "samplers": ["temperature"],
                   "cache_prompt": False, "return_tokens": True, "stream": False, "ignore_eos": ignore_eos,
                   "seed": 0}  # no effect on argmax; makes --spec-synth-rates (benchmarking) runs repeatable
        t0 = time.perf_counter()
        try:
            resp = http_json(f"{self.base_url}/completion", payload)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            tail = log_tail(self.server.log_path)
            raise DraftsmithError(f"llama-server request failed: {e}; its log ({self.server.log_path}) ends "
                                  f"with:\n{tail}") from e
        seconds = time.perf_counter() - t0
        tokens = [int(t) for t in resp.get("tokens") or []]
        if len(tokens) != int(resp.get("tokens_predicted", len(tokens))):
            raise DraftsmithError(f"llama-server returned {len(tokens)} token ids for {resp.get('tokens_predicted')} "
                                  "predicted tokens")
        counters = self._request_counters(before, resp.get("timings") or {}) if before is not None else None
        return EngineResult(tokens, seconds, counters)

    def _request_counters(self, before: SpecCounters, timings: dict[str, Any]) -> SpecCounters:
        """This request's counters: /metrics after minus before, checked against its ``timings``."""
        drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
        deadline = time.monotonic() + 5.0
        while True:
            # the server adds a request to /metrics when it releases the slot, right after answering
            c = self._counters() - before
            if (c.draft_tokens, c.accepted_tokens) == (drafted, accepted) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if (c.draft_tokens, c.accepted_tokens) != (drafted, accepted):
            raise DraftsmithError(f"llama-server's counters disagree: timings say {accepted}/{drafted} drafted tokens "
                                  f"accepted, /metrics {c.accepted_tokens}/{c.draft_tokens} (another client on "
                                  f"port {self.port}?)")
        c.accepted_per_position = (c.accepted_per_position + [0] * self.k)[: self.k]
        return c
