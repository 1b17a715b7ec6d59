// panel.h: a float32 (and, with AVX512-BF16, bfloat16) matmul over weights packed into
// 16-column panels, for the decode shapes (one to a few dozen rows).
//
// Design notes
// - At 1-32 rows a float32 product is a pass over the weights with little arithmetic per byte;
//   oneDNN's blocked kernels stream it poorly there and the gemv loop ends every output in a
//   horizontal sum. Here the weight is packed once as [ceil(N/16), K, 16] (zero padded): step k
//   of panel p is the sixteen weights input k contributes to features 16p.., one 64-byte line.
// - A tile of up to eight rows and three panels keeps 24 accumulators in registers; each step
//   loads three weight vectors and multiplies each by the rows' broadcast input. Each thread takes
//   one contiguous run of panels; lines are prefetched a few dozen steps ahead.
// - Each output sums its K products in order with fused multiply-adds: a row's result does not
//   depend on the other rows of the step.
// - bfloat16: panels [ceil(N/16), ceil(K/2), 16, 2], rows rounded to bfloat16 pairs, vdpbf16ps
//   adds each step's two exact products per feature (float32 sums in a fixed order).
// - Float32 also on AVX2 (its own notes below: rows six at a time, the same sums, the same bits);
//   bfloat16 needs AVX512-BF16. Other variants report available() false and the other kernels
//   serve.
// - The core (the packers, the tiles, `matmul` and `matmul_bf16`) is plain C++ over pointers,
//   sizes and row strides: it builds with -DPAGODA_CORE_ONLY and no ATen. cores_test.cpp
//   (tests/kernels/cpp) checks the products on the AVX2 and AVX-512 variants, and the packers and
//   the no-kernel answer on the scalar variant and on NEON under qemu. panel.cpp's ops are a thin
//   layer over it: the tensor checks and allocations, and the errors of a variant without the kernel.
#pragma once

#include "core.h"
#if !defined(PAGODA_CORE_ONLY)
#include "pagoda.h"  // ATen, for the entry points at the end
#endif

namespace pagoda::panel {

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
static inline void tile(const typename S::A* a, int64_t lda, const typename S::A* w, int64_t steps, float* y,
                        int64_t ldy, __mmask16 last, bool ahead, const typename S::A* next, int64_t next_nv) {
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
static void group(const typename S::A* a, int64_t lda, int64_t M, const typename S::A* w, int64_t steps, float* y,
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
static void run_panels(const typename S::A* a, int64_t lda, int64_t M, const typename S::A* w, int64_t steps,
                       float* y, int64_t ldy, int64_t N) {
  const int64_t P = (N + 15) / 16;
  const __mmask16 tail = N % 16 ? static_cast<__mmask16>((1u << (N % 16)) - 1) : 0xFFFF;
  pagoda::parallel_for(0, P, GROUP, [&](int64_t p0, int64_t p1) {
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
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (float32 only): a panel's sixteen features are two 8-lane vectors, and sixteen registers
// hold one row against three panels (6 accumulators, 6 weight vectors) or up to six rows against
// one panel (12 accumulators); the later row tiles read the panel from cache. Each output still
// sums its K products in order with fused multiply-adds, so the results equal the AVX-512
// kernel's bit for bit.
// - Rows are split into tiles of equal size (8 rows: 4 + 4, not 6 + 2): a tile of r rows has 2r
//   independent chains of multiply-adds, and below four rows it waits on their latency (2 rows
//   took as long per line as 4).
// - The first tile streams the panel from memory with lines fetched AVX2_AHEAD steps on (10 KB):
//   at 24 steps a six-row tile, which spends several cycles a line, read 28 GB/s on a machine
//   that streams 47 (a one-row pass, three panels at a time, keeps 24).
constexpr int AVX2_ROWS = 6;
constexpr int64_t AVX2_AHEAD = 160;

// y[R rows, NV * 16 features] = a[R rows, K] @ the NV panels at w; `width`: the features of the
// last panel that are real (the rest are not stored); `ahead`: how many steps on to prefetch the
// lines (0: none, the panel is in cache).
template <int R, int NV>
static inline void tile2(const float* a, int64_t lda, const float* w, int64_t K, float* y, int64_t ldy,
                         int64_t width, int64_t ahead) {
  __m256 acc[R][NV][2];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[NV][2];
    for (int j = 0; j < NV; ++j) {
      const float* line = w + (j * K + k) * 16;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(line + ahead * 16), _MM_HINT_T0);
      wv[j][0] = _mm256_loadu_ps(line);
      wv[j][1] = _mm256_loadu_ps(line + 8);
    }
    for (int m = 0; m < R; ++m) {
      const __m256 av = _mm256_set1_ps(a[m * lda + k]);
      for (int j = 0; j < NV; ++j) {
        acc[m][j][0] = _mm256_fmadd_ps(av, wv[j][0], acc[m][j][0]);
        acc[m][j][1] = _mm256_fmadd_ps(av, wv[j][1], acc[m][j][1]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NV; ++j) {
      float* dst = y + m * ldy + 16 * j;
      if (j + 1 < NV || width == 16) {
        _mm256_storeu_ps(dst, acc[m][j][0]);
        _mm256_storeu_ps(dst + 8, acc[m][j][1]);
      } else {
        alignas(32) float t[16];
        _mm256_store_ps(t, acc[m][j][0]);
        _mm256_store_ps(t + 8, acc[m][j][1]);
        std::memcpy(dst, t, width * sizeof(float));
      }
    }
}

// All M rows times one panel, in ceil(M / 6) tiles of equal size (they differ by one row at most);
// the first streams the panel, the others read it from cache.
static inline void rows2(const float* a, int64_t lda, int64_t M, const float* w, int64_t K, float* y, int64_t ldy,
                         int64_t width) {
  const int64_t tiles = (M + AVX2_ROWS - 1) / AVX2_ROWS;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t r = (M - m0 + (tiles - t) - 1) / (tiles - t);
    const float* ar = a + m0 * lda;
    float* yr = y + m0 * ldy;
    const int64_t ahead = m0 == 0 ? AVX2_AHEAD : 0;
    switch (r) {
      case 1: tile2<1, 1>(ar, lda, w, K, yr, ldy, width, ahead); break;
      case 2: tile2<2, 1>(ar, lda, w, K, yr, ldy, width, ahead); break;
      case 3: tile2<3, 1>(ar, lda, w, K, yr, ldy, width, ahead); break;
      case 4: tile2<4, 1>(ar, lda, w, K, yr, ldy, width, ahead); break;
      case 5: tile2<5, 1>(ar, lda, w, K, yr, ldy, width, ahead); break;
      default: tile2<AVX2_ROWS, 1>(ar, lda, w, K, yr, ldy, width, ahead); break;
    }
    m0 += r;
  }
}

// y = rows a @ the panels at w: one contiguous run of panels per thread; one row takes them three
// at a time, more rows one panel at a time.
static inline void run_panels_avx2(const float* a, int64_t lda, int64_t M, const float* w, int64_t K, float* y,
                                   int64_t ldy, int64_t N) {
  const int64_t P = (N + 15) / 16;
  pagoda::parallel_for(0, P, GROUP, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1;) {
      const int64_t nv = M == 1 ? std::min<int64_t>(GROUP, p1 - p) : 1, np = p + nv;
      const int64_t width = np == P ? N - (P - 1) * 16 : 16;
      const float* wp = w + p * K * 16;
      float* yp = y + p * 16;
      if (nv == 3) tile2<1, 3>(a, lda, wp, K, yp, ldy, width, AHEAD);
      else if (nv == 2) tile2<1, 2>(a, lda, wp, K, yp, ldy, width, AHEAD);
      else rows2(a, lda, M, wp, K, yp, ldy, width);
      p = np;
    }
  });
}
#endif

// Whether this variant has the float32 kernel (AVX-512, or AVX2 with FMA) and the bfloat16 one
// (AVX512-BF16). Without them `matmul` / `matmul_bf16` compute nothing and return false.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kHasF32 = true;
#else
constexpr bool kHasF32 = false;
#endif
#if defined(__AVX512BF16__)
constexpr bool kHasBF16 = true;
#else
constexpr bool kHasBF16 = false;
#endif

// s: weight [N, K] float32, row-major -> d: [ceil(N/16), K, 16]. d is zeroed by the caller (the
// padding features are not written).
static inline void pack_into(const float* s, int64_t N, int64_t K, float* d) {
  const int64_t P = (N + 15) / 16;
  pagoda::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < 16 && p * 16 + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) d[(p * K + k) * 16 + j] = s[(p * 16 + j) * K + k];
  });
}

// s: weight [N, K] bfloat16 bits, row-major -> d: [ceil(N/16), ceil(K/2), 16, 2]: step k of
// panel p holds the pair (2k, 2k+1) of each of its 16 features. d is zeroed by the caller.
static inline void pack_bf16_into(const uint16_t* s, int64_t N, int64_t K, uint16_t* d) {
  const int64_t P = (N + 15) / 16, K2 = (K + 1) / 2;
  pagoda::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < 16 && p * 16 + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) d[((p * K2 + k / 2) * 16 + j) * 2 + k % 2] = s[(p * 16 + j) * K + k];
  });
}

// y [M, N] float32 (row stride ldy) = x [M, K] float32 (row stride ldx) @ weight^T, the weight
// packed by `pack_into`. False (nothing computed) where the variant has no float32 kernel.
static inline bool matmul(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                          int64_t N) {
#if defined(__AVX512F__)
  run_panels<F32Step>(x, ldx, M, w, K, y, ldy, N);
  return true;
#elif defined(__AVX2__) && defined(__FMA__)
  run_panels_avx2(x, ldx, M, w, K, y, ldy, N);
  return true;
#else
  (void)y, (void)ldy, (void)x, (void)ldx, (void)M, (void)K, (void)w, (void)N;
  return false;
#endif
}

// y [M, N] float32 (row stride ldy) = x [M, K] (float32, rounded to bfloat16 to nearest even as a
// conversion does, or bfloat16 where x_bf16; row stride ldx) @ weight^T, the weight packed by
// `pack_bf16_into`. False (nothing computed) where the variant has no bfloat16 kernel.
static inline bool matmul_bf16(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                               const c10::BFloat16* w, int64_t N) {
#if defined(__AVX512BF16__)
  const int64_t K2 = (K + 1) / 2;
  std::vector<uint16_t> a(M * K2 * 2, 0);  // the rows as bfloat16, each padded to whole pairs
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* dst = a.data() + m * K2 * 2;
    if (x_bf16) {
      std::memcpy(dst, static_cast<const c10::BFloat16*>(x) + m * ldx, K * 2);
      continue;
    }
    const float* src = static_cast<const float*>(x) + m * ldx;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      _mm512_storeu_si512(dst + k,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k)));
    for (; k < K; ++k) dst[k] = c10::BFloat16(src[k]).x;
  }
  run_panels<BF16Step>(reinterpret_cast<const uint32_t*>(a.data()), K2, M, reinterpret_cast<const uint32_t*>(w), K2, y,
                       ldy, N);
  return true;
#else
  (void)y, (void)ldy, (void)x, (void)x_bf16, (void)ldx, (void)M, (void)K, (void)w, (void)N;
  return false;
#endif
}

#if !defined(PAGODA_CORE_ONLY)
// Whether this variant has the float32 kernel (AVX-512 or AVX2+FMA) and the bfloat16 one (AVX512-BF16).
bool available();
bool available_bf16();
// weight [N, K] float32 -> [ceil(N/16), K, 16]; bfloat16 -> [ceil(N/16), ceil(K/2), 16, 2].
at::Tensor pack(at::Tensor weight);
at::Tensor pack_bf16(at::Tensor weight);
// y [M, N] float32 (row stride ldy) = x @ the packed weight^T (float32 panels, or bfloat16 panels
// with amx_linear's signature); a variant without the kernel raises.
void panel_linear(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                  int64_t N);
void panel_linear_bf16(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                       const at::BFloat16* w, int64_t N);
// x [M, K] @ the packed weight^T -> [M, n] float32.
at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t n);
#endif

}  // namespace pagoda::panel
