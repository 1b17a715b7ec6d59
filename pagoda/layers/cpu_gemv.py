"""A C++ matrix-vector kernel for the few-row (decode) linear layers on CPU, compiled on first use.

A batch-1 decode step multiplies one row of activations by every weight of the model: the work
is one pass over the weights, so its speed is the memory bandwidth. The blocked GEMM kernels of
BLAS and oneDNN are built for many rows; at one row they pay packing, blocking and dispatch costs
that leave a large share of the bandwidth unused. This kernel streams each weight row once, in
the checkpoint's own ``[out, in]`` layout, computing up to ``MAX_ROWS`` activation rows from the
same load, and splits the output features across the OpenMP threads. float32 and bfloat16
weights (bfloat16 widened to float32 in registers; the sums are float32 either way).

Where the compiler is missing or ``PAGODA_CPU_KERNELS=0`` the module reports itself unavailable
and the callers keep their other kernels.
"""
from __future__ import annotations

import torch

from pagoda.layers.cpu_build import VECTOR_HELPERS, InlineKernel

MAX_ROWS = 4  # activation rows one pass over the weights serves

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

""" + VECTOR_HELPERS + r"""
// y[r, n] = sum_k x[r, k] * w[n, k] for r < M, output rows n .. n + NR - 1. NR weight rows are read
// side by side, so NR * M independent accumulators are in flight: one row's chain of multiply-adds
// alone waits on each add's latency, which held the bfloat16 kernel (half the bytes per multiply-
// add) well below the memory's speed; the rows are also prefetched ahead, since NR short rows read
// side by side are not a pattern the hardware prefetcher follows quickly. Every output is summed in
// the same order (sixteen lanes over k, their sum, then the k tail) whatever NR, so a row's result
// does not depend on which rows share its group.
constexpr int PF = 512;  // software prefetch distance in bytes along each weight row

#if defined(__AVX512BF16__)
// One activation row over bfloat16 weights where the CPU has AVX512-BF16: the row is rounded to
// bfloat16 (as a bfloat16 model's activations are everywhere else) and each vdpbf16ps multiplies
// 32 pairs exactly and adds them into sixteen float32 lanes, with no widening of the weights.
// Same order for every output row whatever NR: 32-wide steps, the lanes' sum, then the k tail.
template <int NR>
static inline void group_bf16_dot(const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t n) {
  __m512 va[NR];
  for (int j = 0; j < NR; ++j) va[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh xv = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
    for (int j = 0; j < NR; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + j) * K + k) + PF, _MM_HINT_T0);
    for (int j = 0; j < NR; ++j)
      va[j] = _mm512_dpbf16_ps(va[j], (__m512bh)_mm512_loadu_si512(w + (n + j) * K + k), xv);
  }
  float acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_reduce_add_ps(va[j]);
  for (; k < K; ++k) {
    const float xk = static_cast<float>(c10::BFloat16(x[k]));
    for (int j = 0; j < NR; ++j) acc[j] += static_cast<float>(w[(n + j) * K + k]) * xk;
  }
  for (int j = 0; j < NR; ++j) y[n + j] = acc[j];
}
#endif

template <typename W, int M, int NR>
static inline void group(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n) {
#if defined(__AVX512BF16__)
  if constexpr (M == 1 && std::is_same_v<W, at::BFloat16>) {
    group_bf16_dot<NR>(x, w, y, K, n);
    return;
  }
#endif
  float acc[M][NR];
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 va[M][NR];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NR; ++j) va[r][j] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m512 xv[M];
    for (int r = 0; r < M; ++r) xv[r] = _mm512_loadu_ps(x + r * K + k);
    if ((k * static_cast<int64_t>(sizeof(W))) % 64 == 0)  // each row's cache line PF bytes ahead
      for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + j) * K + k) + PF, _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) {
      const __m512 wv = load16(w + (n + j) * K + k);
      for (int r = 0; r < M; ++r) va[r][j] = _mm512_fmadd_ps(wv, xv[r], va[r][j]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_reduce_add_ps(va[r][j]);
#else
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = 0.f;
#endif
  for (; k < K; ++k)
    for (int j = 0; j < NR; ++j) {
      const float wk = static_cast<float>(w[(n + j) * K + k]);
      for (int r = 0; r < M; ++r) acc[r][j] += wk * x[r * K + k];
    }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < NR; ++j) y[r * N + n + j] = acc[r][j];
}

// Output rows [n0, n1) for M <= 4 activation rows: groups of NR rows (8 accumulators in all),
// the rest one at a time.
template <typename W, int M>
static void rows(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = M == 1 ? 8 : M == 2 ? 4 : 2;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) group<W, M, NR>(x, w, y, K, N, n);
  for (; n < n1; ++n) group<W, M, 1>(x, w, y, K, N, n);
}

template <typename W>
static void run(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  switch (M) {
    case 1: rows<W, 1>(x, w, y, K, N, n0, n1); break;
    case 2: rows<W, 2>(x, w, y, K, N, n0, n1); break;
    case 3: rows<W, 3>(x, w, y, K, N, n0, n1); break;
    default: rows<W, 4>(x, w, y, K, N, n0, n1); break;
  }
}

// x: [M, K] (any float dtype, M <= 4), w: [N, K] contiguous float32 or bfloat16.
// Returns [M, N] float32.
torch::Tensor gemv(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 4 && w.size(1) == K && w.is_contiguous());
  torch::Tensor xf = x.to(torch::kFloat).contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Chunks of >= 16 output rows keep each thread on whole cache lines of y.
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  if (w.scalar_type() == torch::kBFloat16) {
    const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
    at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) { run(xp, wp, yp, M, K, N, b, e); });
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kFloat);
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) { run(xp, wp, yp, M, K, N, b, e); });
  }
  return y;
}
"""

_KERNEL = InlineKernel("pagoda_cpu_gemv_", _SOURCE, ["gemv"], ["-O3", "-march=native", "-fopenmp"],
                       "CPU gemv kernel", "the other kernels serve every shape")


def load() -> object | None:
    """The compiled module, or None when it cannot be built here."""
    return _KERNEL.load()


def supports(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in (torch.float32, torch.bfloat16) and load() is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of at most ``MAX_ROWS`` rows (leading dims
    flattened), in ``x``'s dtype."""
    module = load()
    assert module is not None
    flat = x.reshape(-1, x.shape[-1])
    y = module.gemv(flat, weight)  # type: ignore[attr-defined]
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
