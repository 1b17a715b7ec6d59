// gemv.h: the one-to-four-row matrix-vector loops (y = x W^T over W in its [out, in] layout),
// shared by the gemv op (gemv.cpp) and the fused decode blocks (decode.cpp).
//
// Design notes
// - Batch-1 decode multiplies one activation row by every weight: one pass over the weights, so
//   the speed is the memory bandwidth. Blocked GEMMs pay packing and dispatch costs that leave
//   bandwidth unused at one row; this loop streams each weight row once, serving up to four
//   activation rows from the same load, and the op splits output features across the threads.
// - float32 and bfloat16 weights (bfloat16 widened in registers, exactly); sums in float32.
// - Every output row is summed in the same order whatever its neighbours, so a row's result does
//   not depend on the batch it ran in.
#pragma once

#include "core.h"
#include "vec.h"
#if !defined(PAGODA_CORE_ONLY)
#include "pagoda.h"  // ATen, for the entry points at the end
#endif

namespace pagoda::gemv_k {
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
static inline void group_bf16_dot(const float* x, const c10::BFloat16* w, float* y, int64_t K, int64_t n) {
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
  if constexpr (M == 1 && std::is_same_v<W, c10::BFloat16>) {
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
  // Every other width through vec.h (AVX2: eight lanes, NEON: four): the same loop, the same
  // order for every output row whatever NR. The scalar variant keeps the plain loop below.
  using pagoda::vec::VecF;
  constexpr int64_t L = pagoda::vec::kVecWidth;
  if constexpr (L > 1) {
    VecF va[M][NR];
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < NR; ++j) va[r][j] = VecF::zero();
    for (; k + L <= K; k += L) {
      VecF xv[M];
      for (int r = 0; r < M; ++r) xv[r] = VecF::load(x + r * K + k);
      if ((k * static_cast<int64_t>(sizeof(W))) % 64 == 0)  // each row's cache line PF bytes ahead
        for (int j = 0; j < NR; ++j) __builtin_prefetch(reinterpret_cast<const char*>(w + (n + j) * K + k) + PF);
      for (int j = 0; j < NR; ++j) {
        const VecF wv = VecF::load(w + (n + j) * K + k);
        for (int r = 0; r < M; ++r) va[r][j] = pagoda::vec::fma(wv, xv[r], va[r][j]);
      }
    }
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = va[r][j].reduce_add();
  } else {
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = 0.f;
  }
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


#if !defined(PAGODA_CORE_ONLY)
// x: [M, K] (any float dtype, M <= 4), w: [N, K] contiguous float32 or bfloat16.
// Returns [M, N] float32.
at::Tensor gemv(at::Tensor x, at::Tensor w);
#endif

}  // namespace pagoda::gemv_k
