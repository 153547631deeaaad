"""Build draftsmith's C++ CPU ops on first use: ``cpu_attention.cpp`` (the compiled steps' decode
attention) and ``cpu_linear.cpp`` (the eager steps' few-row Linear, ``--weight-layout cpp``).

Each source registers ``draftsmith::`` ops with ``torch.library`` (a fragment each), so a compiled
graph calls them without Python in between. They are built with the C++ compiler ``--compile``
needs anyway (``torch.utils.cpp_extension``, ~25-60 s once each; cached by torch under
``TORCH_EXTENSIONS_DIR``, the build named by a digest of the source, the headers beside it
(``cpu_vec.h``) and the flags).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

#: C++ flags per ATen CPU capability (the vector ISA torch itself runs with here), not
#: ``-march=native``: an extension cached on a shared home must not be run by an older CPU.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def flags() -> list[str]:
    """The compile flags for this CPU: -O3, OpenMP (``at::parallel_for`` is OpenMP in ATen's headers,
    serial without it; the extension links libgomp.so.1, which resolves to the one torch has loaded)
    and the vector ISA torch runs with."""
    return ["-O3", "-fopenmp", "-DNDEBUG"] + ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])


def ninja_on_path() -> None:
    """The ninja wheel's binary on PATH, for a venv that is not activated (cpp_extension runs ``ninja``)."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _load(prefix: str, source: Path, text: bytes, fl: list[str], include: Path) -> None:
    """Compile and load ``source`` (whose content is ``text``) as ``prefix_<digest>``, the digest over its text,
    the headers in ``include`` (what it may include) and the flags: rebuilt only when one of them changes."""
    from torch.utils import cpp_extension

    ninja_on_path()
    headers = b"".join(h.read_bytes() for h in sorted(include.glob("*.h")))
    digest = hashlib.sha256(text + headers + " ".join(fl).encode()).hexdigest()[:12]
    cpp_extension.load(name=f"{prefix}_{digest}", sources=[str(source)], extra_cflags=fl, extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)


def build(source: Path, prefix: str) -> None:
    """Compile and load ``source`` (its ops register themselves); raises whatever the build raises."""
    _load(prefix, source, source.read_bytes(), flags(), source.parent)


def build_as(source: Path, ns: str, cflags: list[str] | None = None, include: Path | None = None) -> None:
    """Build a version of one of these sources with its ops registered under the namespace ``ns`` instead of
    ``draftsmith``, so it loads beside the engine's own build (a kernel's older source in a benchmark, or
    another ISA's form in a test). ``cflags``: default :func:`flags`; ``include``: where its headers are
    (default beside ``source``). Named by content: rebuilt only when the source, headers or flags change."""
    import tempfile

    text = source.read_text()
    for macro in ("TORCH_LIBRARY_FRAGMENT(draftsmith,", "TORCH_LIBRARY_IMPL(draftsmith,"):
        if macro not in text:
            raise ValueError(f"{source}: no {macro!r}; not a version of a draftsmith kernel source")
        text = text.replace(macro, macro.replace("draftsmith", ns))
    include = include or source.parent
    fl = (cflags if cflags is not None else flags()) + [f"-I{include}"]
    # named by its content (the same text under the same name), loaded by a name with the digest of it all
    src = Path(tempfile.gettempdir()) / f"{ns}_{hashlib.sha256(text.encode()).hexdigest()[:12]}.cpp"
    if not src.exists():
        src.write_text(text)
    _load(ns, src, text.encode(), fl, include)
