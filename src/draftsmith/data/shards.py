"""Shards on disk: the capture directory format, written atomically and read back verified.

A capture directory holds ``shard-00000.safetensors``, ... and ``manifest.json``.
Shard ``k`` covers the conversations ``[k*S, (k+1)*S)`` of the capture's input
(``S = samples_per_shard``) minus those dropped (no reply, prompt too long), in
input order; sample ``i`` of a shard (the four tensors of
:mod:`draftsmith.data.capture`) is stored under the keys ``"{i}.input_ids"``,
``"{i}.loss_mask"``, ``"{i}.aux"``, ``"{i}.last"``, and the safetensors metadata
key ``"draftsmith"`` holds a JSON object with the verifier fingerprint, aux layer
ids, dtype, the sample ids and counts, so a lone shard still says where it came
from. The manifest records the verifier (fingerprint, spec, hidden size), the
capture settings and, per shard, its sample/token counts and sha256; it is
rewritten atomically after every shard. Readers (:func:`load_shards`,
:class:`ShardDataset`, :func:`read_shard`) refuse a shard of another verifier and
a corrupt one, naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.utils import atomic_write_bytes, atomic_write_json, write_error

log = logging.getLogger(__name__)

SHARD_FORMAT = "draftsmith.capture/1"
MANIFEST = "manifest.json"
SAMPLE_KEYS = ("input_ids", "loss_mask", "aux", "last")
_META_KEY = "draftsmith"  # one metadata key: safetensors writes several keys in a random order
# Manifest fields that must match for a directory to be resumed; the rest may differ.
_RESUME_KEYS = ("format", "fingerprint", "aux_layer_ids", "hidden_size", "dtype", "max_length", "samples_per_shard",
                "trim_loops")


# ----------------------------------------------------------------------------- writing
def shard_name(index: int) -> str:
    """The file name of shard ``index``."""
    return f"shard-{index:05d}.safetensors"


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_shard(path: Path, samples: list[dict], meta: dict[str, Any]) -> tuple[str, int]:
    """Write one shard atomically; return ``(sha256, bytes)``.

    Raises:
        DraftsmithError: the write failed (e.g. disk full); no partial file is left.
    """
    from safetensors.torch import save

    tensors = {f"{i}.{k}": s[k].contiguous() for i, s in enumerate(samples) for k in SAMPLE_KEYS}
    data = save(tensors, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
    try:
        atomic_write_bytes(path, data)  # temp file + fsync + rename; removes the temp file on failure
    except OSError as e:
        raise write_error(e, path, "completed shards") from e
    return hashlib.sha256(data).hexdigest(), len(data)


def resume_entries(out_dir: Path, header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Shard entries of an earlier run in ``out_dir`` that this run may keep, by file name.

    Raises:
        DraftsmithError: the directory holds a capture of another verifier or with other settings.
    """
    path = out_dir / MANIFEST
    if not path.exists():
        return {}
    old = read_manifest(out_dir)
    if old.get("fingerprint") != header["fingerprint"]:
        raise DraftsmithError(f"{out_dir} holds shards captured from verifier {old.get('fingerprint')}, not "
                              f"{header['fingerprint']}; capture into another directory")
    for k in _RESUME_KEYS:
        had = old.get(k)
        if had != header[k]:
            raise DraftsmithError(f"{out_dir} holds a capture with {k}={had!r}, not {header[k]!r}; "
                                  "re-run with the same settings or capture into another directory")
    return {e["file"]: e for e in old.get("shards", [])}


def write_manifest(out_dir: Path, header: dict[str, Any], shards: list[dict[str, Any]], dropped: dict[str, int],
                   complete: bool) -> None:
    """(Re)write the manifest atomically: ``header``, the totals over ``shards``, and ``shards``."""
    manifest = {**header,
                "num_samples": sum(s["samples"] for s in shards),
                "total_tokens": sum(s["tokens"] for s in shards),
                "total_loss_tokens": sum(s["loss_tokens"] for s in shards),
                "dropped": dropped,
                "complete": complete,
                "shards": shards}
    try:
        atomic_write_json(out_dir / MANIFEST, manifest)
    except OSError as e:
        raise write_error(e, out_dir / MANIFEST, "completed shards") from e


# ----------------------------------------------------------------------------- reading
def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a capture directory, checked for shape.

    Raises:
        DraftsmithError: no manifest, unreadable or not a draftsmith capture manifest.
    """
    path = Path(directory) / MANIFEST
    if not Path(directory).exists():
        raise DraftsmithError(f"{directory} does not exist (a capture directory: `draftsmith data` makes one, "
                              "OUT/shards)")
    if not path.is_file():
        below = sorted(p.parent for p in Path(directory).glob(f"*/{MANIFEST}")) if Path(directory).is_dir() else []
        hint = f"; did you mean {below[0]}?" if len(below) == 1 else (
            f"; capture directories below it: {', '.join(map(str, below[:3]))}" if below else " (run capture first)")
        raise DraftsmithError(f"{directory} is not a capture directory: {MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"{path} is corrupt or unreadable ({type(e).__name__}); re-run capture") from e
    if not isinstance(manifest, dict) or manifest.get("format") != SHARD_FORMAT or \
            not isinstance(manifest.get("shards"), list):
        raise DraftsmithError(f"{path} is not a draftsmith capture manifest (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {SHARD_FORMAT!r})")
    return manifest


def _foreign(where: Path | str, found: Any, expected: str) -> DraftsmithError:
    return DraftsmithError(f"shard {where} was captured from verifier {found}, not {expected} (the verifier "
                           "being trained for); capture again with this verifier")


def _shard_header(path: Path, data: bytes) -> dict[str, Any]:
    """The draftsmith metadata in a safetensors header, parsed without loading tensors."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        if size > len(data) - 8:
            raise ValueError("header runs past the end of the file")
        header = json.loads(data[8:8 + size])
        meta = json.loads(header["__metadata__"][_META_KEY])
        if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}")
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"shard {path} is corrupt or not a draftsmith shard ({e}); delete it and re-run "
                              "capture") from e
    return meta


def read_shard(path: Path, expected_fingerprint: str | None = None, sha256: str | None = None) -> list[dict]:
    """The samples of one shard file, after checking its provenance and integrity.

    Args:
        path: a ``shard-*.safetensors`` file.
        expected_fingerprint: refuse a shard of any other verifier.
        sha256: the checksum the manifest recorded (checked when given).

    Raises:
        DraftsmithError: naming the file, when it is foreign, corrupt, truncated or unreadable.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DraftsmithError(f"cannot read shard {path}: {e.strerror or e}") from e
    meta = _shard_header(path, data)  # provenance first: a foreign shard says so, not "checksum mismatch"
    if expected_fingerprint is not None and meta.get("fingerprint") != expected_fingerprint:
        raise _foreign(path, meta.get("fingerprint"), expected_fingerprint)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise DraftsmithError(f"shard {path} is corrupt: its checksum does not match the manifest (truncated or "
                              "modified); delete it and re-run capture to rebuild it")
    try:
        tensors = load(data)
    except SafetensorError as e:
        raise DraftsmithError(f"shard {path} is corrupt ({e}); delete it and re-run capture") from e
    try:
        return [{k: tensors[f"{i}.{k}"] for k in SAMPLE_KEYS} for i in range(int(meta["samples"]))]
    except KeyError as e:
        raise DraftsmithError(f"shard {path} is corrupt: tensor {e.args[0]} is missing") from e


def _check_directory(directory: Path, expected_fingerprint: str | None) -> dict[str, Any]:
    manifest = read_manifest(directory)
    if expected_fingerprint is not None and manifest.get("fingerprint") != expected_fingerprint:
        raise _foreign(f"directory {directory}", manifest.get("fingerprint"), expected_fingerprint)
    if not manifest.get("complete"):
        log.warning("%s: the capture did not finish (%d shards); using what it wrote", directory,
                    len(manifest["shards"]))
    return manifest


def load_shards(directory: Path, expected_fingerprint: str | None = None) -> Iterator[dict]:
    """Yield the samples of a capture directory, one shard in memory at a time.

    Args:
        directory: a :func:`capture_to_shards` output.
        expected_fingerprint: the verifier being trained for; ``None`` checks only
            that every shard agrees with the manifest.

    Raises:
        DraftsmithError: missing/corrupt manifest, a foreign shard or a corrupt one (named).
    """
    directory = Path(directory)
    manifest = _check_directory(directory, expected_fingerprint)
    for entry in manifest["shards"]:
        yield from read_shard(directory / entry["file"], manifest["fingerprint"], entry["sha256"])


def load_capture_dirs(directories: Sequence[Path | str],
                      expected_fingerprint: str | None = None) -> tuple[list[dict], list[int]]:
    """The samples of one or more capture directories, in order, and the verifier layers they hold.

    Several directories are trained on together: an earlier capture plus fresh replies, say
    (fresh regenerated replies beat another pass over old ones, BENCHMARKS.md section 3).

    Raises:
        DraftsmithError: no directory, one named twice, any that :func:`load_shards` refuses,
            or directories captured at different layers or hidden sizes (named).
    """
    dirs = [Path(d) for d in directories]
    if not dirs:
        raise DraftsmithError("no capture directory given")
    resolved = [d.resolve() for d in dirs]
    twice = sorted({str(d) for d, r in zip(dirs, resolved) if resolved.count(r) > 1})
    if twice:
        raise DraftsmithError(f"capture directory named more than once: {', '.join(twice)}")
    layouts = {d: (list(m["aux_layer_ids"]), int(m["hidden_size"]))
               for d, m in ((d, read_manifest(d)) for d in dirs)}
    if len({json.dumps(v) for v in layouts.values()}) > 1:
        raise DraftsmithError("capture directories hold different verifier layers, so they cannot be trained on "
                              "together: " + "; ".join(f"{d}: aux layers {a}, hidden size {h}"
                                                       for d, (a, h) in layouts.items()))
    samples = [s for d in dirs for s in load_shards(d, expected_fingerprint)]
    return samples, layouts[dirs[0]][0]


class ShardDataset(torch.utils.data.Dataset):
    """Random access to the samples of a capture directory (a ``torch`` Dataset).

    A shard is verified (provenance and checksum) the first time one of its
    samples is read; samples are then read from the memory-mapped file one at a
    time, so memory holds no more than the requested sample.

    Attributes:
        manifest: the directory's manifest.
        fingerprint: the verifier the samples were captured from.
        aux_layer_ids: the captured layers.
        hidden_size: the verifier's hidden size.
    """

    def __init__(self, directory: Path, fingerprint: str | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = _check_directory(self.directory, fingerprint)
        self.fingerprint: str = self.manifest["fingerprint"]
        self.aux_layer_ids: list[int] = list(self.manifest["aux_layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self._index = [(k, i) for k, e in enumerate(self.manifest["shards"]) for i in range(int(e["samples"]))]
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, k: int) -> Path:
        return self.directory / self.manifest["shards"][k]["file"]

    def _verify(self, k: int) -> None:
        if k in self._verified:
            return
        path, entry = self._path(k), self.manifest["shards"][k]
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                meta = _shard_header(path, head + f.read(min(size, 1 << 26)))
        except OSError as e:
            raise DraftsmithError(f"cannot read shard {path}: {e.strerror or e}") from e
        if meta.get("fingerprint") != self.fingerprint:
            raise _foreign(path, meta.get("fingerprint"), self.fingerprint)
        if sha256_file(path) != entry["sha256"]:
            raise DraftsmithError(f"shard {path} is corrupt: its checksum does not match the manifest "
                                  "(truncated or modified); delete it and re-run capture to rebuild it")
        self._verified.add(k)

    def __getitem__(self, idx: int) -> dict:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        k, i = self._index[idx]
        self._verify(k)
        from safetensors import safe_open

        with safe_open(str(self._path(k)), framework="pt") as f:
            return {key: f.get_tensor(f"{i}.{key}") for key in SAMPLE_KEYS}

    def __iter__(self) -> Iterator[dict]:
        for k, entry in enumerate(self.manifest["shards"]):
            yield from read_shard(self._path(k), self.fingerprint, entry["sha256"])
            self._verified.add(k)

