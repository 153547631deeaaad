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


def build(source: Path, prefix: str) -> None:
    """Compile and load ``source`` (its ops register themselves); raises whatever the build raises."""
    from torch.utils import cpp_extension

    ninja_on_path()
    fl = flags()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(fl).encode()).hexdigest()[:12]
    cpp_extension.load(name=f"{prefix}_{digest}", sources=[str(source)], extra_cflags=fl, extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)
