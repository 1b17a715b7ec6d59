"""Builds pagoda's C++ CPU kernel library once per instruction-set variant at install time
(``pip install .``, ``pip install -e .``, ``python -m build``): ``pagoda.kernels._C_scalar``,
``_C_avx2`` and ``_C_avx512`` on x86-64 (the AVX-512 one also carries the AMX kernel), ``_C_scalar``
elsewhere. The sources are pagoda/kernels/csrc; the variants' flags are pagoda/kernels/build.py's.
Each variant's files compile in parallel (ninja; ``MAX_JOBS`` sets how many at once).

``PAGODA_BUILD_VARIANTS`` (comma-separated; default all) builds fewer, e.g. ``avx512`` on a
development machine, or none (``PAGODA_BUILD_VARIANTS=``), in which case the kernels are built
from the sources at first use instead. The project metadata is in pyproject.toml."""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _kernel_build():
    """pagoda/kernels/build.py, loaded by path (importing the package would import torch and more)."""
    spec = importlib.util.spec_from_file_location("_pagoda_kernel_build", ROOT / "pagoda" / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extensions():
    kb = _kernel_build()
    wanted = os.environ.get("PAGODA_BUILD_VARIANTS")
    variants = list(kb.VARIANTS) if wanted is None else [v.strip() for v in wanted.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(kb.VARIANTS))
    if unknown:
        raise SystemExit(f"PAGODA_BUILD_VARIANTS: unknown variant(s) {unknown}; this machine builds {list(kb.VARIANTS)}")
    if not variants:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    csrc = Path("pagoda") / "kernels" / "csrc"
    extensions = [
        CppExtension(kb.module_name(v), [str(csrc / s) for s in kb.SOURCES], include_dirs=[str(ROOT / csrc)],
                     # -g0: no debug info (Python's CFLAGS ask for it; it doubles the build time)
                     extra_compile_args={"cxx": [*kb.compile_flags(v), "-g0", "-Wno-maybe-uninitialized"]}, extra_link_args=["-fopenmp"])
        for v in variants
    ]

    class Build(BuildExtension):
        """One progress line per variant (pip shows them with -v)."""

        def build_extension(self, ext) -> None:
            start = time.perf_counter()
            index = self.extensions.index(ext) + 1
            print(f"pagoda: building CPU kernel variant {ext.name} ({index}/{len(self.extensions)}, "
                  f"{len(ext.sources)} files, MAX_JOBS={os.environ.get('MAX_JOBS', 'all cores')})", file=sys.stderr,
                  flush=True)
            # Each variant's objects in a folder of their own: the variants compile the same file
            # names with other flags, and shared object paths made every build rebuild them all.
            build_temp = self.build_temp
            self.build_temp = os.path.join(build_temp, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = build_temp
            print(f"pagoda: {ext.name} built in {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)

    return extensions, {"build_ext": Build.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
