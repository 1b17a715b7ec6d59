"""A float32 matmul over weights packed into 16-column panels, for the decode shapes (one to a few
dozen rows), compiled on first use where the CPU has AVX-512.

Why: a float32 decode step multiplies each weight by one row per sequence. At one to 32 rows
that is a pass over the weights with little arithmetic per byte, and neither of the other
kernels streams it well: oneDNN's blocked float32 kernels, built for large products, ran at 14-60
GFLOP/s at 2-8 rows and 115-140 at 32 on the 2-core Xeon pagoda is developed on (weights from
memory, ``pagoda bench gemm``), and the gemv kernel reads the ``[out, in]`` weight as dot
products that end in a horizontal sum per output.

Here the weight is packed once as ``[ceil(N/16), K, 16]`` float32 (zero padded): panel ``p``
holds output features ``16p .. 16p+15``, and step ``k`` of a panel is the sixteen weights that
input ``k`` contributes to them, one 64-byte line. A tile of up to eight rows and three panels
(48 features) keeps its 24 accumulators in registers; each step loads three weight vectors and
multiplies each by the eight rows' input ``k``, broadcast. Every thread takes one contiguous
run of panels, so it streams its share of the weights front to back; the first row tile of a
group of panels fetches the lines it will read a few dozen steps on, and with more than eight
rows the second tile fetches the next group into L2 while the rest of the rows reuse the current
one from cache. Each output sums its ``K`` products in order with fused multiply-adds, so a
row's result does not depend on the other rows of the step.

Measured on that Xeon against the previous kernels over the 56M-parameter model's shapes
(weights from memory): 1.14-1.26x the gemv kernel at one row, 1.3-1.8x oneDNN at 2-16 rows,
1.1-1.4x at 32, level at 48-64 (so it serves at most ``MAX_ROWS``). Where AVX-512 is missing or
the kernel cannot be built, ``supported()`` is False and the other kernels keep serving.
"""
from __future__ import annotations

import torch

from pagoda import cpu_features
from pagoda.layers.cpu_build import InlineKernel

MAX_ROWS = 32  # the most rows the kernel serves (oneDNN's blocking is level at 48-64 rows)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 3;  // panels per tile: 48 output features, 24 accumulators of 8 rows
constexpr int64_t ROWS = 8;   // rows per tile
constexpr int64_t AHEAD = 24; // K steps between fetching a weight line and reading it

#if defined(__AVX512F__)
// y[R rows, NV * 16 features] = a[R rows, K] @ the NV panels at w (each K x 16 floats; panel j at
// w + j * K * 16). `last`: the lanes of the final panel that are real features. `ahead`: fetch
// the own lines AHEAD steps on into L1 (crossing into the next group near the end); `next` /
// `next_nv`: the following group's panels, fetched into L2 step by step (0: none).
template <int R, int NV>
inline void tile(const float* a, int64_t lda, const float* w, int64_t K, float* y, int64_t ldy, __mmask16 last,
                 bool ahead, const float* next, int64_t next_nv) {
  __m512 acc[R][NV];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NV];
    for (int j = 0; j < NV; ++j) {
      const float* line = w + (j * K + k) * 16;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(line + AHEAD * 16), _MM_HINT_T0);
      wv[j] = _mm512_loadu_ps(line);
    }
    for (int64_t j = 0; j < next_nv; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(next + (j * K + k) * 16), _MM_HINT_T1);
    for (int m = 0; m < R; ++m) {
      const __m512 av = _mm512_set1_ps(a[m * lda + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_fmadd_ps(av, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < R; ++m) {
    for (int j = 0; j + 1 < NV; ++j) _mm512_storeu_ps(y + m * ldy + 16 * j, acc[m][j]);
    _mm512_mask_storeu_ps(y + m * ldy + 16 * (NV - 1), last, acc[m][NV - 1]);
  }
}

// All M rows times one group of NV panels: tiles of eight rows, then the rest.
template <int NV>
void group(const float* a, int64_t lda, int64_t M, const float* w, int64_t K, float* y, int64_t ldy,
           __mmask16 last, const float* next, int64_t next_nv) {
  int64_t m0 = 0;
  int t = 0;
  for (; m0 + ROWS <= M; m0 += ROWS, ++t)
    tile<ROWS, NV>(a + m0 * lda, lda, w, K, y + m0 * ldy, ldy, last, t == 0, next, t == 1 ? next_nv : 0);
  const float* ar = a + m0 * lda;
  float* yr = y + m0 * ldy;
  const bool ahead = t == 0;
  const int64_t nn = t == 1 ? next_nv : 0;
  switch (M - m0) {
    case 1: tile<1, NV>(ar, lda, w, K, yr, ldy, last, ahead, next, nn); break;
    case 2: tile<2, NV>(ar, lda, w, K, yr, ldy, last, ahead, next, nn); break;
    case 3: tile<3, NV>(ar, lda, w, K, yr, ldy, last, ahead, next, nn); break;
    case 4: tile<4, NV>(ar, lda, w, K, yr, ldy, last, ahead, next, nn); break;
    case 5: tile<5, NV>(ar, lda, w, K, yr, ldy, last, ahead, next, nn); break;
    case 6: tile<6, NV>(ar, lda, w, K, yr, ldy, last, ahead, next, nn); break;
    case 7: tile<7, NV>(ar, lda, w, K, yr, ldy, last, ahead, next, nn); break;
    default: break;
  }
}
#endif

}  // namespace

// Whether this build has the kernel (AVX-512).
bool available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// weight [N, K] float32 -> [ceil(N/16), K, 16], zero padded.
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat, "panel pack: a 2-D float32 weight");
  const torch::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + 15) / 16;
  torch::Tensor out = torch::zeros({P, K, 16}, w.options());
  const float* s = w.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < 16 && p * 16 + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) d[(p * K + k) * 16 + j] = s[(p * 16 + j) * K + k];
  });
  return out;
}

// y [M, N] float32 (row stride ldy) = x [M, K] float32 (row stride ldx) @ weight^T, the weight
// packed by `pack`. Called directly by the fused decode blocks (through its address).
void panel_linear(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                  int64_t N) {
#if defined(__AVX512F__)
  const int64_t P = (N + 15) / 16;
  const __mmask16 tail = N % 16 ? static_cast<__mmask16>((1u << (N % 16)) - 1) : 0xFFFF;
  // One contiguous run of panels per thread, in groups of three (fewer at the run's end).
  at::parallel_for(0, P, GROUP, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += GROUP) {
      const int64_t nv = std::min<int64_t>(GROUP, p1 - p), np = p + nv;
      const int64_t next_nv = std::min<int64_t>(GROUP, p1 - np);
      const __mmask16 last = np == P ? tail : 0xFFFF;
      const float* wp = w + p * K * 16;
      const float* next = w + np * K * 16;
      float* yp = y + p * 16;
      if (nv == 3) group<3>(x, ldx, M, wp, K, yp, ldy, last, next, next_nv);
      else if (nv == 2) group<2>(x, ldx, M, wp, K, yp, ldy, last, next, next_nv);
      else group<1>(x, ldx, M, wp, K, yp, ldy, last, next, next_nv);
    }
  });
#else
  TORCH_CHECK(false, "this build has no float32 panel kernel (needs AVX-512)");
#endif
}

// x [M, K] float32 @ weight^T -> [M, n] float32.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "panel linear: float32 rows");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (n + 15) / 16 && packed.size(1) == x.size(1) && packed.size(2) == 16,
              "panel linear: the packed weight is not [", n, ", ", x.size(1), "]");
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  if (K == 0) return y.zero_();
  panel_linear(y.data_ptr<float>(), n, xc.data_ptr<float>(), xc.stride(0), M, K, packed.data_ptr<float>(), n);
  return y;
}

int64_t linear_address() { return reinterpret_cast<int64_t>(&panel_linear); }
"""

_KERNEL = InlineKernel("pagoda_cpu_panel_", _SOURCE, ["available", "pack", "linear", "linear_address"],
                       ["-O3", "-march=native", "-fopenmp"], "CPU float32 panel kernel",
                       "oneDNN and the gemv kernel serve float32 decode rows",
                       supported=lambda: "avx512f" in cpu_features.cpu_flags())


def load() -> object | None:
    """The compiled module, or None where it cannot be built here."""
    return _KERNEL.load()


def supported() -> bool:
    """Whether this process can run the kernel: an AVX-512 CPU and a build that targets it."""
    module = load()
    return module is not None and bool(module.available())  # type: ignore[attr-defined]


def supports(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype == torch.float32
            and supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([N, K] float32) in the kernel's layout."""
    return load().pack(weight)  # type: ignore[union-attr]


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight."""
    flat = x.reshape(-1, x.shape[-1])
    y = load().linear(flat, packed, out_features)  # type: ignore[union-attr]
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], out_features)
