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

Bfloat16 weights have the same kernel for CPUs with AVX512-BF16 but no AMX (AMD EPYC Zen 4, for
one): panels ``[ceil(N/16), ceil(K/2), 16, 2]`` (a step is a pair of K values, still one 64-byte
line), the rows rounded to bfloat16 pairs, each step's two products per feature added by
``vdpbf16ps`` (exact products, float32 sums in a fixed order). Where AMX is there, ``cpu_amx``
serves bfloat16 instead: on the Xeon the two are level at one row, and AMX is 1.5-4x faster from
eight rows up; this kernel is 1.3-1.5x the bfloat16 gemv kernel at one row there.
"""
from __future__ import annotations

import torch

from pagoda import cpu_features
from pagoda.layers.cpu_build import InlineKernel, packed_linear

MAX_ROWS = 32  # the most rows the kernel serves (oneDNN's blocking is level at 48-64 rows)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 3;  // panels per tile: 48 output features, 24 accumulators of 8 rows
constexpr int64_t ROWS = 8;   // rows per tile
constexpr int64_t AHEAD = 24; // K steps between fetching a weight line and reading it

#if defined(__AVX512F__)
// How a step multiplies, for each weight dtype. A: the element of the rows and the panels; V: a
// vector of one weight line (16 features) or of one row's broadcast value. Float32: a step is
// one K value, added with a fused multiply-add. Bfloat16: a step is a pair of K values (the line
// holds the pair of each feature; the row's pair is broadcast as one 32-bit value) and
// `vdpbf16ps` adds both products, exact in float32, to each feature's sum.
struct F32Step {
  using A = float;
  using V = __m512;
  static V load(const A* p) { return _mm512_loadu_ps(p); }
  static V broadcast(A a) { return _mm512_set1_ps(a); }
  static __m512 madd(__m512 acc, V a, V w) { return _mm512_fmadd_ps(a, w, acc); }
};
#if defined(__AVX512BF16__)
struct BF16Step {
  using A = uint32_t;
  using V = __m512bh;
  static V load(const A* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static V broadcast(A a) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(a)); }
  static __m512 madd(__m512 acc, V a, V w) { return _mm512_dpbf16_ps(acc, a, w); }
};
#endif

// y[R rows, NV * 16 features] = a[R rows, K steps] @ the NV panels at w (each `steps` x 16
// elements; panel j at w + j * steps * 16). `last`: the lanes of the final panel that are real
// features. `ahead`: fetch the own lines AHEAD steps on into L1 (crossing into the next group
// near the end); `next` / `next_nv`: the following group's panels, fetched into L2 step by step
// (0: none).
template <class S, int R, int NV>
inline void tile(const typename S::A* a, int64_t lda, const typename S::A* w, int64_t steps, float* y, int64_t ldy,
                 __mmask16 last, bool ahead, const typename S::A* next, int64_t next_nv) {
  __m512 acc[R][NV];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < steps; ++k) {
    typename S::V wv[NV];
    for (int j = 0; j < NV; ++j) {
      const typename S::A* line = w + (j * steps + k) * 16;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(line + AHEAD * 16), _MM_HINT_T0);
      wv[j] = S::load(line);
    }
    for (int64_t j = 0; j < next_nv; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(next + (j * steps + k) * 16), _MM_HINT_T1);
    for (int m = 0; m < R; ++m) {
      const typename S::V av = S::broadcast(a[m * lda + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = S::madd(acc[m][j], av, wv[j]);
    }
  }
  for (int m = 0; m < R; ++m) {
    for (int j = 0; j + 1 < NV; ++j) _mm512_storeu_ps(y + m * ldy + 16 * j, acc[m][j]);
    _mm512_mask_storeu_ps(y + m * ldy + 16 * (NV - 1), last, acc[m][NV - 1]);
  }
}

// All M rows times one group of NV panels: tiles of eight rows, then the rest.
template <class S, int NV>
void group(const typename S::A* a, int64_t lda, int64_t M, const typename S::A* w, int64_t steps, float* y,
           int64_t ldy, __mmask16 last, const typename S::A* next, int64_t next_nv) {
  int64_t m0 = 0;
  int t = 0;
  for (; m0 + ROWS <= M; m0 += ROWS, ++t)
    tile<S, ROWS, NV>(a + m0 * lda, lda, w, steps, y + m0 * ldy, ldy, last, t == 0, next, t == 1 ? next_nv : 0);
  const typename S::A* ar = a + m0 * lda;
  float* yr = y + m0 * ldy;
  const bool ahead = t == 0;
  const int64_t nn = t == 1 ? next_nv : 0;
  switch (M - m0) {
    case 1: tile<S, 1, NV>(ar, lda, w, steps, yr, ldy, last, ahead, next, nn); break;
    case 2: tile<S, 2, NV>(ar, lda, w, steps, yr, ldy, last, ahead, next, nn); break;
    case 3: tile<S, 3, NV>(ar, lda, w, steps, yr, ldy, last, ahead, next, nn); break;
    case 4: tile<S, 4, NV>(ar, lda, w, steps, yr, ldy, last, ahead, next, nn); break;
    case 5: tile<S, 5, NV>(ar, lda, w, steps, yr, ldy, last, ahead, next, nn); break;
    case 6: tile<S, 6, NV>(ar, lda, w, steps, yr, ldy, last, ahead, next, nn); break;
    case 7: tile<S, 7, NV>(ar, lda, w, steps, yr, ldy, last, ahead, next, nn); break;
    default: break;
  }
}

// y = rows a @ the panels at w, one contiguous run of panels per thread, in groups of three
// (fewer at the run's end).
template <class S>
void run_panels(const typename S::A* a, int64_t lda, int64_t M, const typename S::A* w, int64_t steps, float* y,
                int64_t ldy, int64_t N) {
  const int64_t P = (N + 15) / 16;
  const __mmask16 tail = N % 16 ? static_cast<__mmask16>((1u << (N % 16)) - 1) : 0xFFFF;
  at::parallel_for(0, P, GROUP, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p += GROUP) {
      const int64_t nv = std::min<int64_t>(GROUP, p1 - p), np = p + nv;
      const int64_t next_nv = std::min<int64_t>(GROUP, p1 - np);
      const __mmask16 last = np == P ? tail : 0xFFFF;
      const typename S::A* wp = w + p * steps * 16;
      const typename S::A* next = w + np * steps * 16;
      float* yp = y + p * 16;
      if (nv == 3) group<S, 3>(a, lda, M, wp, steps, yp, ldy, last, next, next_nv);
      else if (nv == 2) group<S, 2>(a, lda, M, wp, steps, yp, ldy, last, next, next_nv);
      else group<S, 1>(a, lda, M, wp, steps, yp, ldy, last, next, next_nv);
    }
  });
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

// Whether this build has the bfloat16 kernel (AVX512-BF16).
bool available_bf16() {
#if defined(__AVX512BF16__)
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
  run_panels<F32Step>(x, ldx, M, w, K, y, ldy, N);
#else
  TORCH_CHECK(false, "this build has no float32 panel kernel (needs AVX-512)");
#endif
}

// weight [N, K] bfloat16 -> [ceil(N/16), ceil(K/2), 16, 2], zero padded: step k of panel p holds
// the pair (2k, 2k+1) of each of its 16 features.
torch::Tensor pack_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "panel pack: a 2-D bfloat16 weight");
  const torch::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + 15) / 16, K2 = (K + 1) / 2;
  torch::Tensor out = torch::zeros({P, K2, 16, 2}, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* d = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < 16 && p * 16 + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) d[((p * K2 + k / 2) * 16 + j) * 2 + k % 2] = s[(p * 16 + j) * K + k];
  });
  return out;
}

// y [M, N] float32 (row stride ldy) = x [M, K] (float32, rounded to bfloat16 to nearest even as a
// conversion does, or bfloat16; row stride ldx) @ weight^T, the weight packed by `pack_bf16`. The
// signature of cpu_amx's amx_linear: the fused decode blocks call either through its address.
void panel_linear_bf16(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                       const at::BFloat16* w, int64_t N) {
#if defined(__AVX512BF16__)
  const int64_t K2 = (K + 1) / 2;
  std::vector<uint16_t> a(M * K2 * 2, 0);  // the rows as bfloat16, each padded to whole pairs
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* dst = a.data() + m * K2 * 2;
    if (x_bf16) {
      std::memcpy(dst, static_cast<const at::BFloat16*>(x) + m * ldx, K * 2);
      continue;
    }
    const float* src = static_cast<const float*>(x) + m * ldx;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      _mm512_storeu_si512(dst + k,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k)));
    for (; k < K; ++k) dst[k] = at::BFloat16(src[k]).x;
  }
  run_panels<BF16Step>(reinterpret_cast<const uint32_t*>(a.data()), K2, M, reinterpret_cast<const uint32_t*>(w), K2, y,
                       ldy, N);
#else
  TORCH_CHECK(false, "this build has no bfloat16 panel kernel (needs AVX512-BF16)");
#endif
}

// x [M, K] @ weight^T -> [M, n] float32: float32 rows over float32 panels (`pack`), float32 or
// bfloat16 rows over bfloat16 panels (`pack_bf16`).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || (bf16 && x.scalar_type() == torch::kBFloat16)),
              "panel linear: float32 rows (or bfloat16 rows over bfloat16 panels)");
  const int64_t K = x.size(1);
  const bool shaped = bf16 ? packed.dim() == 4 && packed.size(1) == (K + 1) / 2 && packed.size(3) == 2
                           : packed.scalar_type() == torch::kFloat && packed.dim() == 3 && packed.size(1) == K;
  TORCH_CHECK(packed.is_contiguous() && shaped && packed.size(0) == (n + 15) / 16 && packed.size(2) == 16,
              "panel linear: the packed weight is not [", n, ", ", K, "]");
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0);
  torch::Tensor y = torch::empty({M, n}, x.options().dtype(torch::kFloat));
  if (M == 0 || n == 0) return y;
  if (K == 0) return y.zero_();
  if (bf16)
    panel_linear_bf16(y.data_ptr<float>(), n, xc.data_ptr(), xc.scalar_type() == torch::kBFloat16, xc.stride(0), M, K,
                      packed.data_ptr<at::BFloat16>(), n);
  else
    panel_linear(y.data_ptr<float>(), n, xc.data_ptr<float>(), xc.stride(0), M, K, packed.data_ptr<float>(), n);
  return y;
}

int64_t linear_address() { return reinterpret_cast<int64_t>(&panel_linear); }
int64_t linear_bf16_address() { return reinterpret_cast<int64_t>(&panel_linear_bf16); }
"""

_KERNEL = InlineKernel("pagoda_cpu_panel_", _SOURCE, ["available", "available_bf16", "pack", "pack_bf16", "linear",
                                                      "linear_address", "linear_bf16_address"],
                       ["-O3", "-march=native", "-fopenmp"], "CPU float32 panel kernel",
                       "oneDNN and the gemv kernel serve float32 decode rows",
                       supported=lambda: "avx512f" in cpu_features.cpu_flags())


def load() -> object | None:
    """The compiled module, or None where it cannot be built here."""
    return _KERNEL.load()


def supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this process can run the kernel for ``dtype`` weights: an AVX-512 CPU (AVX512-BF16
    for bfloat16) and a build that targets it."""
    module = load()
    if module is None or dtype not in (torch.float32, torch.bfloat16):
        return False
    return bool(module.available() if dtype == torch.float32 else module.available_bf16())  # type: ignore[attr-defined]


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and supported(weight.dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([N, K] float32 or bfloat16) in the kernel's layout."""
    module = load()
    return module.pack_bf16(weight) if weight.dtype == torch.bfloat16 else module.pack(weight)  # type: ignore[union-attr]


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight, in ``x``'s dtype."""
    return packed_linear(load(), x, packed, out_features, bias)
