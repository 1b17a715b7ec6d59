"""Build-once loading of pagoda's small C++ CPU kernels (paged attention, gemv, weight-only
quantized matmul): compiled with torch's ``load_inline`` on first use, cached by a hash of the
source (an edited kernel is rebuilt, not reused), and skipped for good where it cannot be built
or ``PAGODA_CPU_KERNELS=0``; the caller then keeps its slower path."""
from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Callable

logger = logging.getLogger(__name__)

# Every module that defines an InlineKernel named ``_KERNEL``.
KERNEL_MODULES = (
    "pagoda.layers.attention.cpu_kernel",
    "pagoda.layers.cpu_gemv",
    "pagoda.layers.cpu_amx",
    "pagoda.layers.cpu_panel",
    "pagoda.layers.cpu_fused",
    "pagoda.layers.cpu_moe",
    "pagoda.layers.quantization.cpu_woq",
    "pagoda.layers.cpu_decode",
)


# C++ shared by the kernels' sources (each source pastes it in after its includes): sixteen float32
# lanes loaded from float32 or from bfloat16 (exactly: a shift), exp of sixteen floats, and silu(g) * u.
VECTOR_HELPERS = r"""
#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp of sixteen floats: 2^k * exp(r) with k = round(x / ln 2), r = x - k ln 2 (in two parts), and
// exp(r) on |r| <= ln2 / 2 by Cephes' expf polynomial (about one ulp); scalef gives inf and 0
// past the float range, as exp does.
static inline __m512 exp16(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

// silu(g) * u = g / (1 + exp(-g)) * u, sixteen lanes.
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  return _mm512_mul_ps(_mm512_div_ps(g, den), u);
}
#endif
"""

def build_all() -> dict[str, bool]:
    """Build (or load from the cache) every CPU kernel now, one after another; returns which are
    available. A process that would otherwise compile on first use inside a collective (a
    tensor-parallel worker) calls this beforehand so a cold cache cannot outlast a timeout."""
    import importlib

    return {name: importlib.import_module(name)._KERNEL.load() is not None for name in KERNEL_MODULES}


def packed_linear(compiled: object, x, packed, out_features: int, bias):
    """``F.linear(x, weight, bias)`` through a compiled kernel's ``linear(rows, packed, n)`` (float32
    results) over the weight it packed: ``x``'s leading dims flattened and restored, the bias
    added, the result in ``x``'s dtype. The tile kernels' wrapper (``cpu_amx``, ``cpu_panel``)."""
    flat = x.reshape(-1, x.shape[-1])
    y = compiled.linear(flat, packed, out_features)  # type: ignore[attr-defined]
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


class InlineKernel:
    """A C++ module compiled from ``source`` on first use (cached by its hash). ``functions``:
    the names ``load_inline`` binds; None when the source has its own ``PYBIND11_MODULE`` (to bind
    a class)."""

    def __init__(self, prefix: str, source: str, functions: list[str] | None, cflags: list[str], what: str,
                 fallback: str, supported: Callable[[], bool] = lambda: True) -> None:
        self.name = prefix + hashlib.sha1(source.encode()).hexdigest()[:10]
        self.source, self.functions, self.cflags = source, functions, cflags
        self.what, self.fallback, self.supported = what, fallback, supported
        self.module: object | None = None
        self.failed = False

    def load(self) -> object | None:
        """The compiled module, or None when it cannot be built here."""
        if self.module is not None or self.failed:
            return self.module
        if os.environ.get("PAGODA_CPU_KERNELS", "1") in ("0", "false") or not self.supported():
            self.failed = True
            return None
        self.module = self._built()
        if self.module is not None:
            return self.module
        try:
            from torch.utils.cpp_extension import load_inline

            start = time.perf_counter()
            self.module = load_inline(self.name, cpp_sources=self.source, functions=self.functions,
                                      extra_cflags=self.cflags, extra_ldflags=["-fopenmp"], verbose=False)
            logger.info("%s ready in %.1fs", self.what, time.perf_counter() - start)
        except Exception as exc:  # no compiler, no ninja, ...
            logger.warning("%s unavailable (%s); %s", self.what, exc, self.fallback)
            self.failed = True
        return self.module

    def _built(self) -> object | None:
        """The module from an earlier build of this exact source, imported directly. ``load_inline``
        would take the build directory's lock file and run ninja just to find nothing to do: a
        second or so per kernel at every process start, and a process killed while holding the
        lock (a test killing a server, a user's kill -9) would leave every later start waiting
        for it forever. Anything unusual (no such file, a build in progress, a broken file) goes
        to ``load_inline``."""
        try:
            from torch.utils import cpp_extension

            directory = cpp_extension._get_build_directory(self.name, verbose=False)
            path, lock = os.path.join(directory, f"{self.name}.so"), os.path.join(directory, "lock")
            # A fresh lock may be a build in progress (its output half written): leave that to
            # load_inline. One older than any build is a dead process's.
            if not os.path.exists(path) or (os.path.exists(lock) and time.time() - os.path.getmtime(lock) < 600):
                return None
            return cpp_extension._import_module_from_library(self.name, directory, True)
        except Exception:  # a partial or stale build: rebuild the usual way
            return None
