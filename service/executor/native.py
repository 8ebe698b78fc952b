"""The project's C++ CPU kernels (`kernels/*.cpp`), compiled on first use for the CPU they run on.

Each kernel is built with `-march=native` into the model cache, keyed by its source and source path, the flags,
the torch version and the CPU's flags, so a cache shared by machines of several kinds holds one build each: a
build costs 25-50 s once per machine kind, loading it a few ms after. Without a C++ compiler and ninja (or if
the build fails) `build` returns None, logged, and the caller keeps torch's own kernels: the same results to
rounding, slower. The Dockerfile and CI install g++ and ninja-build.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from service.executor.cpu_kernels import cpu_flags
from service.executor.paths import default_cache_dir

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
# -ffp-contract=off: the compiler fuses no multiply and add on its own, differently in one tile of rows than
# in another, so a row's bits never depend on the rows beside it (the kernels fuse explicitly where they mean to).
# -fopenmp: `at::parallel_for` is a header template whose OpenMP backend is a `#pragma omp parallel`; built
# without the flag (as torch's `load` builds by default) it runs the whole range on the calling thread, so
# every kernel ran on one thread whatever `--torch-threads` said. Linked with it, the kernels share torch's
# own OpenMP runtime (its libgomp.so.1, already loaded by the same soname), pool and thread count.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)


def isa_flags() -> tuple[str, ...]:
    """Flags that hold a build to the instruction set a dispatch cap asks for (`ATEN_CPU_CAPABILITY=avx2`:
    no AVX-512 and no AVX-VNNI, what an AVX2-only EPYC runs; `default`: no AVX at all), so a capped test run
    proves the kernels' AVX2 or portable code on a CPU that has more, as it proves torch's."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap == "avx2":
        return ("-mno-avx512f", "-mno-avxvnni")
    if cap == "default":
        return ("-mno-avx",)
    return ()


@functools.cache
def sources_digest() -> str:
    """A digest of every kernel's source: forward costs measured on one version of the kernels are not reused
    by another (`cost_cache.cost_key`)."""
    digest = hashlib.sha256()
    for source in sorted([*KERNELS.glob("*.cpp"), *KERNELS.glob("*.h")]):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def build(name: str) -> ModuleType | None:
    """The extension module compiled from `kernels/<name>.cpp`, or None where it cannot be built (logged)."""
    source = KERNELS / f"{name}.cpp"
    flags = [*FLAGS, *isa_flags()]
    try:
        from torch.utils.cpp_extension import load

        key = hashlib.sha256(
            b"\0".join(
                [
                    source.read_bytes(),
                    *(
                        header.read_bytes() for header in sorted(KERNELS.glob("*.h"))
                    ),  # what the sources include
                    str(source).encode(),  # ninja rebuilds when the build's source path changes
                    " ".join([*flags, *LINK_FLAGS]).encode(),
                    torch.__version__.encode(),
                    " ".join(sorted(cpu_flags())).encode(),
                ]
            )
        ).hexdigest()[:16]
        folder = default_cache_dir() / "kernels" / f"{name}-{key}"
        folder.mkdir(parents=True, exist_ok=True)
        return load(
            name=f"csd_{name}_{key}",
            sources=[str(source)],
            extra_cflags=flags,
            extra_ldflags=list(LINK_FLAGS),
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: torch's kernels serve instead
        log.warning("the %s kernel could not be built (%s); torch's own kernels serve instead", name, exc)
        return None
