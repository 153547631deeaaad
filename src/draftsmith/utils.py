"""Small shared helpers: devices, dtypes, cache dir, atomic writes, append-only files, provenance."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True, **kw: Any) -> Any:
    """The progress bar of a long step: its ETA is remaining work over the *average* rate so far
    (tqdm's ``smoothing=0``). tqdm's default moving average follows the last few updates, and a
    step whose work arrives in bursts (replies ending early, batches of unequal length) then
    shows ETAs off by 10x; the average stays within 2x after the first tenth (tests/test_progress.py).
    """
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, smoothing=0, disable=not enabled, dynamic_ncols=True, **kw)


def cache_dir() -> Path:
    """Root of draftsmith's cache (``DRAFTSMITH_CACHE``, default ``~/.cache/draftsmith``)."""
    root = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/"auto" picks CUDA when present, else CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(f"device {device!r} requested but CUDA is not available")
    return dev


def check_dtype_name(dtype: str, flag: str = "--dtype") -> None:
    """Refuse a dtype name :func:`resolve_dtype` would not know, before any work."""
    if dtype != "auto" and dtype not in _DTYPES:
        raise DraftsmithError(f"{flag}: unknown dtype {dtype!r}; use auto or one of {sorted(set(_DTYPES))}")


def check_device_name(device: str, flag: str = "--device") -> None:
    """Refuse a device string torch cannot parse (availability is checked when it is used)."""
    if device == "auto":
        return
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise DraftsmithError(f"{flag}: unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None


def check_out_path(out: str | Path, kind: str, flag: str = "--out") -> None:
    """Refuse, before any work, an output the command could not write at the end: ``kind`` "dir" (a
    directory, made if missing) or "file"; a path under a file, or without write permission."""
    out = Path(out)
    if kind == "dir" and out.exists() and not out.is_dir():
        raise DraftsmithError(f"{flag} {out}: exists and is not a directory (this command writes one: name a new one)")
    if kind == "file" and out.is_dir():
        raise DraftsmithError(f"{flag} {out}: a directory is there; this command writes a file (name one)")
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not probe.is_dir() and probe != out:
        raise DraftsmithError(f"{flag} {out}: not writable ({probe} is a file, not a directory)")
    if not os.access(probe if probe.is_dir() else probe.parent, os.W_OK):
        raise DraftsmithError(f"{flag} {out}: not writable (no write permission on {probe})")


def cpu_has_amx(onednn_limit: bool = True) -> bool:
    """Whether bfloat16 matmuls run on AMX here (then ~10x float32's speed; without it, far slower).

    The CPU's flag, unless oneDNN is limited below AMX with ``ONEDNN_MAX_CPU_ISA`` (e.g. ``AVX2``):
    torch's bfloat16 matmuls then run without AMX, and so does this answer (how an AMX machine
    measures what a CPU without AMX gets). ``onednn_limit=False``: the CPU's flag alone (for what
    does not run through oneDNN).
    """
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() if onednn_limit else ""
    if isa and isa not in ("ALL", "DEFAULT") and "AMX" not in isa:
        return False
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 faster than float32: AMX, or AVX-512 BF16 (Zen 4, Cooper
    Lake). On the AMD EPYC (Zen 4, no AMX) measured in BENCHMARKS.md 9i, bfloat16 is 1.6-1.75x float32
    for a regeneration step (batch 16), 1.5x for a prefill and for a draft training step; on a CPU with neither
    (AVX2 only) it is far slower than float32. ``ONEDNN_MAX_CPU_ISA`` below BF16 (``AVX2``,
    ``AVX512_CORE``) turns it off, as :func:`cpu_has_amx` does for AMX.
    """
    if cpu_has_amx():
        return True
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and isa not in ("ALL", "DEFAULT") and "BF16" not in isa and "AMX" not in isa:
        return False
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/"auto": bfloat16 on CUDA, float32 on CPU (exact greedy equivalence is a float32 property)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise DraftsmithError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))} or 'auto'")
    return _DTYPES[dtype]


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``final`` only if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file + rename: readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_error(e: OSError, path: Path, kept: str) -> DraftsmithError:
    """The error of a resumable write that failed: why ("the disk is full" for a full disk or
    quota), what is ``kept``, and that a re-run continues."""
    why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
    return DraftsmithError(f"cannot write {path}: {why}; {kept} are kept, free space and re-run the same "
                           "command to continue")


def complete_lines(path: Path, cut: bool = True) -> list[bytes]:
    """The complete lines of an append-only JSONL file (none if it does not exist).

    Every record is written as one line ending in "\\n", so text after the last one is a
    torn write of an interrupted run: with ``cut`` (the writer, about to append) it is cut
    off the file, else (a reader) only left out; with a warning either way.
    """
    if not path.exists():
        return []
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DraftsmithError(f"cannot read {path}: {e.strerror or e}") from e
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log.warning("%s: %s a torn last line (%d bytes) from an interrupted run", path,
                    "dropping" if cut else "ignoring", len(data) - end)
        if cut:
            with open(path, "r+b") as f:
                f.truncate(end)
    return data[:end].splitlines()


def environment_info() -> dict[str, Any]:
    """Versions and machine facts recorded next to every artefact."""
    import transformers

    from draftsmith import __version__

    info = {
        "draftsmith": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_isa": cpu_isa(),
    }
    return info


def cpu_isa() -> str:
    """The vector ISA torch runs with here (``AVX2``, ``AVX512``, ...), with ``+AVX512_BF16`` / ``+AMX``
    where the CPU has them: two CPUs of one model name ("AMD EPYC": Zen 3 with AVX2 only, Zen 4 with
    AVX-512 BF16) differ 2-3x in this project's step costs (BENCHMARKS.md 15q)."""
    isa = str(torch.backends.cpu.get_cpu_capability())
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        isa += "+AVX512_BF16"
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        isa += "+AMX"
    return isa


def command_line() -> str:
    return " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
