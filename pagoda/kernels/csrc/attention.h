// attention.h: paged decode attention over the KV cache in place (the loops; the op that
// calls them is attention.cpp's paged_decode, and the fused decode blocks call `run` directly).
//
// Design notes
// - A gather-then-attend path copies every sequence's K/V into a fresh tensor per layer and reads
//   it twice more. These loops read each sequence's K/V through its block table, once, computing
//   every query head of a K/V group from the same row; with fewer sequences than threads a long
//   sequence's positions are split over the threads and the parts' softmax sums merged.
// - Float32 decode rows over a float32, bfloat16, float16 or quantized (int8 / fp8 with a bf16
//   scale per token and K/V head) cache; quantized elements are dequantized in the loop, never as
//   a copy.
// - Head sizes 64 and 128 (AVX2: also 256) over float32/bfloat16/float16 caches (`attend_heads`, nearly every
//   model) keep each head's q and output rows in registers across positions, sum sixteen (AVX-512)
//   or eight (AVX2) positions' scores together and use a vectorised exp; other shapes take the
//   general loops (which the compiler vectorises for the variant's width).
// - Logit soft-capping (Gemma 2's `cap * tanh(score / cap)`) on the scores of every path, before
//   the softmax (`cap_scores`).
// - Built with fast-math (attention.cpp, and decode.cpp around its include): the sums' order is
//   the kernel's own, and no input here is NaN or infinite by construction.
#pragma once

#include "core.h"
#include "vec.h"
#if !defined(PAGODA_CORE_ONLY)
#include "pagoda.h"  // ATen, for the entry points at the end
#endif

namespace pagoda::attn {
// Cache element readers. A quantized cache stores int8 or fp8 values and, beside it, one bf16
// scale per token and K/V head; the kernel folds the scales into the scores (K) and the
// probabilities (V), so an element read is just the conversion below.
static inline float bits_to_float(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }
struct F32 { using T = float; static inline float get(T x) { return x; } };
struct I8 { using T = int8_t; static inline float get(T x) { return static_cast<float>(x); } };
// fp8 by bit arithmetic (no lookup table, so loops vectorise). Subnormals go through an exact
// multiply rather than float subnormals, which -ffast-math may flush. NaN/inf never occur:
// writes clamp to the largest finite value.
struct E4M3 {
  using T = uint8_t;
  static inline float get(T b) {
    const uint32_t em = b & 0x7f;
    const float mag = em < 8 ? static_cast<float>(em) * 0x1p-9f : bits_to_float((em << 20) + (120u << 23));
    return b & 0x80 ? -mag : mag;
  }
};
struct E5M2 {
  using T = uint8_t;
  static inline float get(T b) {
    const uint32_t em = b & 0x7f;
    const float mag = em < 4 ? static_cast<float>(em) * 0x1p-16f : bits_to_float((em << 21) + (112u << 23));
    return b & 0x80 ? -mag : mag;
  }
};
static inline float bf16_to_float(uint16_t x) { return bits_to_float(static_cast<uint32_t>(x) << 16); }
// A bfloat16 cache (a bfloat16 model's): widened, no scales.
struct BF16 { using T = uint16_t; static inline float get(T x) { return bf16_to_float(x); } };
// A float16 cache (a float16 model's): widened (F16C's vcvtph2ps in the vector paths), no scales.
struct F16 { using T = c10::Half; static inline float get(T x) { return static_cast<float>(x); } };

struct Cache {
  const void* k; const void* v;                  // [num_blocks, block_size, Hkv, D]
  const uint16_t* ks; const uint16_t* vs;        // bf16 [num_blocks, block_size, Hkv] or null
  int64_t sb, ss, sh;                            // element strides of the values
  int64_t tb, ts, th;                            // element strides of the scales
};

// Positions ahead of the one being read whose K/V rows are prefetched. A sequence's slots sit in
// blocks scattered over the cache, and a decode step reads every sequence once: left to the
// hardware, each row is a wait on memory (half the time of a batch-32 bfloat16 step's attention
// went to those waits before the rows were fetched ahead).
constexpr int64_t AHEAD = 6;

// Fetch one K/V row of D elements into L1.
template <class T>
static inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(p + i, 0, 3);
}

// Fetch the rows of heads [h0, h0 + nh) of position `pos` of sequence b (a K or V base `base`).
template <class T>
static inline void prefetch_slot(const T* base, const Cache& c, const int32_t* bt, int64_t b, int64_t W, int64_t bs,
                                 int64_t pos, int64_t h0, int64_t nh, int64_t D) {
  const T* slot = base + bt[b * W + pos / bs] * c.sb + (pos % bs) * c.ss;
  for (int64_t hh = 0; hh < nh; ++hh) prefetch_row(slot + (h0 + hh) * c.sh, D);
}

// Logit soft-capping in place (cap > 0): s = cap * tanh(s / cap) over n scores, as the torch
// backend's reference does before the softmax. tanh(x) = 1 - 2 / (exp(2x) + 1) through vec.h's
// exp, x clamped to +-15 first (tanh is +-1 there in float32), so nothing infinite appears under
// fast-math; about 1e-7 * cap absolute error near 0, where the subtraction cancels.
static inline void cap_scores(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  int64_t i = 0;
  if constexpr (vec::kVecWidth > 1) {
    using vec::VecF;
    const VecF lo = VecF::set1(-15.f), one = VecF::set1(1.f), two = VecF::set1(2.f), vinv = VecF::set1(inv),
               vcap = VecF::set1(cap), zero = VecF::zero();
    for (; i + vec::kVecWidth <= n; i += vec::kVecWidth) {
      VecF x = vec::max(lo, VecF::load(s + i) * vinv);
      x = zero - vec::max(zero - x, lo);  // min(x, 15)
      (vcap * (one - two / (vec::exp(two * x) + one))).store(s + i);
    }
  }
  for (; i < n; ++i) {
    const float x = std::min(std::max(s[i] * inv, -15.f), 15.f);
    s[i] = cap * (1.f - 2.f / (vec::exp1(2.f * x) + 1.f));
  }
}

#if defined(__AVX512F__)
static inline __m512 load_f32_row(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load_f32_row(const uint16_t* p) {  // bfloat16: widening is a shift
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load_f32_row(const c10::Half* p) { return vec::VecF::load(p).v; }  // float16: vcvtph2ps

// attend_range for a bfloat16 (or float32) cache with D a multiple of 16 (up to 256): each K/V
// head's row is loaded (and widened) once per position straight into vectors that serve its G
// query heads, with no widened copy of the row. Same results as the general loop up to the order
// of the float32 additions.
template <class E>
static void attend_vec(int64_t b, int64_t h0, int64_t nh, int64_t p0, int64_t p1, const float* qp, const Cache& c,
                       const int32_t* bt, int64_t H, int64_t D, int64_t G, int64_t bs, int64_t W, float scale,
                       float* acc, float* mx, float* den, float softcap) {
  using T = typename E::T;
  const T* kp = static_cast<const T*>(c.k);
  const T* vp = static_cast<const T*>(c.v);
  const int64_t L = p1 - p0, R = nh * G, NV = D / 16;
  const float* qb = qp + (b * H + h0 * G) * D;
  std::vector<float> scores(R * L);
  for (int64_t t = 0; t < L; ++t) {  // position by position: each slot's heads are contiguous
    if (t + AHEAD < L) prefetch_slot(kp, c, bt, b, W, bs, t + AHEAD + p0, h0, nh, D);
    const int64_t block = bt[b * W + (t + p0) / bs], off = (t + p0) % bs;
    const T* slot = kp + block * c.sb + off * c.ss;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const T* kr = slot + (h0 + hh) * c.sh;
      __m512 kv[16];
      for (int64_t v = 0; v < NV; ++v) kv[v] = load_f32_row(kr + 16 * v);
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = qb + (hh * G + g) * D;
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
        for (int64_t v = 1; v < NV; ++v) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * v), kv[v], sum);
        scores[(hh * G + g) * L + t] = _mm512_reduce_add_ps(sum) * scale;
      }
    }
  }
  if (softcap > 0.f) cap_scores(scores.data(), R * L, softcap);
  // The softmax is written out in both loops on purpose: moved into a shared helper, GCC
  // vectorised its exp under -ffast-math and one-rank and tensor-parallel logprobs drifted apart.
  for (int64_t r = 0; r < R; ++r) {
    float* sr = scores.data() + r * L;
    float m = sr[0];
    for (int64_t t = 1; t < L; ++t) m = sr[t] > m ? sr[t] : m;
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) { sr[t] = std::exp(sr[t] - m); sum += sr[t]; }
    mx[r] = m;
    den[r] = sum;
  }
  std::fill(acc, acc + R * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    if (t + AHEAD < L) prefetch_slot(vp, c, bt, b, W, bs, t + AHEAD + p0, h0, nh, D);
    const int64_t block = bt[b * W + (t + p0) / bs], off = (t + p0) % bs;
    const T* slot = vp + block * c.sb + off * c.ss;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const T* vr = slot + (h0 + hh) * c.sh;
      __m512 vv[16];
      for (int64_t v = 0; v < NV; ++v) vv[v] = load_f32_row(vr + 16 * v);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(hh * G + g) * L + t]);
        float* ar = acc + (hh * G + g) * D;
        for (int64_t v = 0; v < NV; ++v)
          _mm512_storeu_ps(ar + 16 * v, _mm512_fmadd_ps(p, vv[v], _mm512_loadu_ps(ar + 16 * v)));
      }
    }
  }
}

// Lane i of the result = the sum of the sixteen lanes of v[i]. Every lane is summed by the same
// tree (pairs of 128-bit halves, then the 128-bit quarters), so a score does not depend on which
// positions share its block.
static inline vec::VecF hsum_lanes(const vec::VecF* vf) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(vf[2 * i].v, vf[2 * i + 1].v),
                         _mm512_unpackhi_ps(vf[2 * i].v, vf[2 * i + 1].v));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)))};
}

static inline __mmask16 live_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// The first n (1 .. 16) lanes of x to dst.
static inline void store_lanes(float* dst, vec::VecF x, int64_t n) { _mm512_mask_storeu_ps(dst, live_lanes(n), x.v); }

// Each of the R rows of L scores becomes exp(score - max) in place; mx and den get the row's
// maximum and the sum of its exponentials. The last partial block of sixteen is masked.
static inline void softmax_rows(float* scores, int64_t R, int64_t L, float* mx, float* den) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = scores + r * L;
    __m512 m16 = _mm512_set1_ps(-FLT_MAX);
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 live = live_lanes(L - t);
      m16 = _mm512_mask_max_ps(m16, live, m16, _mm512_maskz_loadu_ps(live, sr + t));
    }
    const float m = _mm512_reduce_max_ps(m16);
    __m512 sum16 = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 live = live_lanes(L - t);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sr + t), _mm512_set1_ps(m)));
      _mm512_mask_storeu_ps(sr + t, live, e);
      sum16 = _mm512_mask_add_ps(sum16, live, sum16, e);
    }
    mx[r] = m;
    den[r] = _mm512_reduce_add_ps(sum16);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 variant's (eight lanes) row loads and lane helpers for ``attend_heads`` below,
// through vec.h's loads and exp.
static inline __m256 load_f32_row(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load_f32_row(const uint16_t* p) {  // bfloat16: widening is a shift
  return vec::VecF::load(reinterpret_cast<const c10::BFloat16*>(p)).v;
}
static inline __m256 load_f32_row(const c10::Half* p) { return vec::VecF::load(p).v; }  // float16: F16C

// Lane i of the result = the sum of the eight lanes of v[i], every lane by the same tree
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), so a score does not depend on which
// positions share its group of eight.
static inline vec::VecF hsum_lanes(const vec::VecF* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0].v, v[1].v), _mm256_hadd_ps(v[2].v, v[3].v));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4].v, v[5].v), _mm256_hadd_ps(v[6].v, v[7].v));
  return {_mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31))};
}

// The first n (1 .. 8) lanes of x to dst.
static inline void store_lanes(float* dst, vec::VecF x, int64_t n) {
  if (n == 8) {
    x.store(dst);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, x.v);
    std::copy(tmp, tmp + n, dst);
  }
}

// Each of the R rows of L scores becomes exp(score - max) in place; mx and den get the row's
// maximum and the sum of its exponentials. Whole groups of eight in vectors, the rest one by one.
static inline void softmax_rows(float* scores, int64_t R, int64_t L, float* mx, float* den) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = scores + r * L;
    __m256 m8 = _mm256_set1_ps(-FLT_MAX);
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sr + t));
    float m = vec::VecF{m8}.reduce_max();
    for (; t < L; ++t) m = sr[t] > m ? sr[t] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= L; t += 8) {
      const __m256 e = vec::exp(vec::VecF{_mm256_sub_ps(_mm256_loadu_ps(sr + t), vm)}).v;
      _mm256_storeu_ps(sr + t, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    float tail = 0.f;
    for (; t < L; ++t) {
      sr[t] = vec::exp1(sr[t] - m);
      tail += sr[t];
    }
    mx[r] = m;
    den[r] = vec::VecF{sum8}.reduce_add() + tail;
  }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// attend_range for a float32, bfloat16 or float16 cache with D = N * NV, N = kVecWidth lanes
// (AVX-512: N = 16, D 64 or 128; AVX2: N = 8, D 64, 128 or 256): one query head at a time with
// its q row (scores) or its output row (values) held in registers across the positions. The K/V
// rows of a head are read from memory by its group's first query head, fetched 16 positions
// ahead, and from L1/L2 by the others. Scores N positions at a time, their sums taken together
// by the variant's ``hsum_lanes``; the softmax is the variant's ``softmax_rows``. The output row
// is summed in slices of at most eight vectors (AVX2 has sixteen registers: at D = 128 and 256
// the position loop runs once per slice, each slice's V values read from L1/L2 after the first).
// Each score and output lane is summed in one fixed order whatever the positions' split, as in
// the loops below.
template <class E, int NV>
static void attend_heads(int64_t b, int64_t h0, int64_t nh, int64_t p0, int64_t p1, const float* qp, const Cache& c,
                         const int32_t* bt, int64_t H, int64_t G, int64_t bs, int64_t W, float scale, float* acc,
                         float* mx, float* den, float softcap) {
  using T = typename E::T;
  using vec::VecF;
  constexpr int N = vec::kVecWidth;
  constexpr int64_t D = N * NV;
  constexpr int CH = NV < 8 ? NV : 8;  // output vectors summed per pass over the positions
  static_assert(NV % CH == 0, "the output row is summed in whole slices");
  const T* kp = static_cast<const T*>(c.k);
  const T* vp = static_cast<const T*>(c.v);
  const int64_t L = p1 - p0, R = nh * G;
  const float* qb = qp + (b * H + h0 * G) * D;
  std::vector<int64_t> slot(L + 16);  // element offset of each position's slot (both caches)
  for (int64_t t = 0; t < L; ++t) slot[t] = bt[b * W + (t + p0) / bs] * c.sb + ((t + p0) % bs) * c.ss;
  std::vector<float> scores(R * L + N);
  const VecF vscale = VecF::set1(scale);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int64_t hoff = (h0 + hh) * c.sh;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = hh * G + g;
      VecF q[NV];
      for (int v = 0; v < NV; ++v) q[v] = VecF::load(qb + r * D + N * v);
      for (int64_t t0 = 0; t0 < L; t0 += N) {
        const int64_t n = std::min<int64_t>(N, L - t0);
        VecF s[N];
        for (int64_t i = 0; i < N; ++i) {
          if (i >= n) {
            s[i] = VecF::zero();
            continue;
          }
          if (g == 0 && t0 + i + 16 < L) prefetch_row(kp + slot[t0 + i + 16] + hoff, D);
          const T* kr = kp + slot[t0 + i] + hoff;
          VecF sum = q[0] * VecF{load_f32_row(kr)};
          for (int v = 1; v < NV; ++v) sum = vec::fma(q[v], VecF{load_f32_row(kr + N * v)}, sum);
          s[i] = sum;
        }
        store_lanes(scores.data() + r * L + t0, hsum_lanes(s) * vscale, n);
      }
    }
  }
  if (softcap > 0.f) cap_scores(scores.data(), R * L, softcap);
  softmax_rows(scores.data(), R, L, mx, den);
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int64_t hoff = (h0 + hh) * c.sh;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = hh * G + g;
      const float* sr = scores.data() + r * L;
      for (int c0 = 0; c0 < NV; c0 += CH) {
        VecF a[CH];
        for (int v = 0; v < CH; ++v) a[v] = VecF::zero();
        for (int64_t t = 0; t < L; ++t) {
          if (g == 0 && c0 == 0 && t + 16 < L) prefetch_row(vp + slot[t + 16] + hoff, D);
          const T* vr = vp + slot[t] + hoff + N * c0;
          const VecF p = VecF::set1(sr[t]);
          for (int v = 0; v < CH; ++v) a[v] = vec::fma(p, VecF{load_f32_row(vr + N * v)}, a[v]);
        }
        for (int v = 0; v < CH; ++v) a[v].store(acc + r * D + N * (c0 + v));
      }
    }
  }
}
#endif

// One work item = sequence b, K/V heads [h0, h0 + nh) and its cached positions [p0, p1) (within
// the attended ones). Each cached token's slot holds all K/V heads contiguously, so an item
// covering every head reads whole slots (no wasted cache lines). The item leaves, per query head
// r it serves, its unnormalised output acc[r] (sum of exp(score - mx[r]) * v), the running
// maximum mx[r] and the sum den[r] of those exponentials: parts of one sequence over disjoint
// position ranges merge exactly (``merge_parts``).
template <class E, bool SCALED>
static void attend_range(int64_t b, int64_t h0, int64_t nh, int64_t p0, int64_t p1, const float* qp,
                         const Cache& c, const int32_t* bt, int64_t H, int64_t D, int64_t G, int64_t bs,
                         int64_t W, float scale, float* acc, float* mx, float* den, float softcap) {
  using T = typename E::T;
  const T* kp = static_cast<const T*>(c.k);
  const T* vp = static_cast<const T*>(c.v);
  const int64_t L = p1 - p0, R = nh * G;  // R query heads served by this item
  const float* qb = qp + (b * H + h0 * G) * D;
  std::fill(acc, acc + R * D, 0.f);
  if (L <= 0) {  // no keys: a part that adds nothing (finite values only: built with -ffast-math)
    std::fill(mx, mx + R, -FLT_MAX);
    std::fill(den, den + R, 0.f);
    return;
  }
#if defined(__AVX512F__)
  if constexpr (!SCALED) {  // float32 or bfloat16 caches at the common head sizes
    if (D == 64) return attend_heads<E, 4>(b, h0, nh, p0, p1, qp, c, bt, H, G, bs, W, scale, acc, mx, den, softcap);
    if (D == 128) return attend_heads<E, 8>(b, h0, nh, p0, p1, qp, c, bt, H, G, bs, W, scale, acc, mx, den, softcap);
  }
  // A bfloat16 cache (a bfloat16 model's) at other head sizes: 26-34% faster than the loop below
  // at 190-2000 positions; a float32 one, read in place below, gained nothing from it.
  if constexpr (!SCALED && std::is_same_v<E, BF16>) {
    if (D % 16 == 0 && D <= 256) {
      attend_vec<E>(b, h0, nh, p0, p1, qp, c, bt, H, D, G, bs, W, scale, acc, mx, den, softcap);
      return;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (!SCALED) {  // float32, bfloat16 or float16 caches at the common head sizes
    if (D == 64) return attend_heads<E, 8>(b, h0, nh, p0, p1, qp, c, bt, H, G, bs, W, scale, acc, mx, den, softcap);
    if (D == 128) return attend_heads<E, 16>(b, h0, nh, p0, p1, qp, c, bt, H, G, bs, W, scale, acc, mx, den, softcap);
    // Gemma's head size: the q row lives on the stack (L1) and the output row takes four slices.
    if (D == 256) return attend_heads<E, 32>(b, h0, nh, p0, p1, qp, c, bt, H, G, bs, W, scale, acc, mx, den, softcap);
  }
#endif
  std::vector<float> scores(R * L), row(D);
  // A quantized or bfloat16 row is converted once into `row` and then serves the G query heads
  // of its group; a float32 row is read in place.
  auto load_row = [&](const T* src) -> const float* {
    if constexpr (std::is_same_v<E, BF16> || std::is_same_v<E, F16>) {  // widened a vector at a time
      int64_t d = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      constexpr int64_t LW = vec::kVecWidth;
      for (; d + LW <= D; d += LW) vec::VecF{load_f32_row(src + d)}.store(row.data() + d);
#endif
      for (; d < D; ++d) row[d] = E::get(src[d]);
      return row.data();
    } else if constexpr (!std::is_same_v<E, F32>) {
      for (int64_t d = 0; d < D; ++d) row[d] = E::get(src[d]);
      return row.data();
    } else {
      return reinterpret_cast<const float*>(src);
    }
  };
  for (int64_t t = 0; t < L; ++t) {
    if (t + AHEAD < L) prefetch_slot(kp, c, bt, b, W, bs, t + AHEAD + p0, h0, nh, D);
    const int64_t block = bt[b * W + (t + p0) / bs], off = (t + p0) % bs;
    const T* slot = kp + block * c.sb + off * c.ss;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = h0 + hh;
      const float* kr = load_row(slot + h * c.sh);
      const float ks = SCALED ? bf16_to_float(c.ks[block * c.tb + off * c.ts + h * c.th]) * scale : scale;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = hh * G + g;
        const float* qr = qb + r * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qr[d] * kr[d];
        scores[r * L + t] = s * ks;
      }
    }
  }
  if (softcap > 0.f) cap_scores(scores.data(), R * L, softcap);
  for (int64_t r = 0; r < R; ++r) {
    float* sr = scores.data() + r * L;
    float m = sr[0];
    for (int64_t t = 1; t < L; ++t) m = sr[t] > m ? sr[t] : m;
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) { sr[t] = std::exp(sr[t] - m); sum += sr[t]; }
    mx[r] = m;
    den[r] = sum;
  }
  for (int64_t t = 0; t < L; ++t) {
    if (t + AHEAD < L) prefetch_slot(vp, c, bt, b, W, bs, t + AHEAD + p0, h0, nh, D);
    const int64_t block = bt[b * W + (t + p0) / bs], off = (t + p0) % bs;
    const T* slot = vp + block * c.sb + off * c.ss;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = h0 + hh;
      const float* vr = load_row(slot + h * c.sh);
      const float vs = SCALED ? bf16_to_float(c.vs[block * c.tb + off * c.ts + h * c.th]) : 1.f;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = hh * G + g;
        const float p = scores[r * L + t] * vs;
        float* ar = acc + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
      }
    }
  }
}

// The attended positions of sequence b: the last `window` keys with a sliding window, else all.
static inline int64_t first_pos(const int32_t* sl, int64_t b, int64_t window) {
  return window > 0 && sl[b] > window ? sl[b] - window : 0;
}

// Positions per part when one sequence's keys are split over threads (split-K), so that each
// part still reads whole runs of slots.
constexpr int64_t MIN_SPLIT = 64;

template <class E, bool SCALED>
static void run(float* op, const float* qp, const Cache& c, const int32_t* bt, const int32_t* sl, int64_t B,
                int64_t H, int64_t D, int64_t Hkv, int64_t bs, int64_t W, float scale, int64_t window,
                float softcap = 0.f) {
  const int64_t G = H / Hkv, threads = pagoda::num_threads();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, sl[b] - first_pos(sl, b, window));
  // Fewer sequences than threads and long enough contexts: every item takes all heads of one
  // sequence over a share of its positions (whole slots, every thread busy), and the parts are
  // merged. Otherwise items are (sequence, heads): all heads when there are sequences enough.
  const int64_t parts = B < threads ? std::min<int64_t>(threads / B, longest / MIN_SPLIT) : 1;
  if (parts >= 2) {
    std::vector<float> acc(B * parts * H * D), mx(B * parts * H), den(B * parts * H);
    pagoda::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t b = w / parts, part = w % parts, lo = first_pos(sl, b, window), L = sl[b] - lo;
        attend_range<E, SCALED>(b, 0, Hkv, lo + L * part / parts, lo + L * (part + 1) / parts, qp, c, bt, H, D, G,
                                bs, W, scale, acc.data() + w * H * D, mx.data() + w * H, den.data() + w * H,
                                softcap);
      }
    });
    for (int64_t b = 0; b < B; ++b)
      for (int64_t r = 0; r < H; ++r) {
        float m = -FLT_MAX;
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t i = (b * parts + part) * H + r;
          if (den[i] > 0.f) m = std::max(m, mx[i]);
        }
        float* ob = op + (b * H + r) * D;
        std::fill(ob, ob + D, 0.f);
        float total = 0.f;
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t i = (b * parts + part) * H + r;
          if (den[i] == 0.f) continue;
          const float f = std::exp(mx[i] - m);
          total += f * den[i];
          const float* a = acc.data() + i * D;
          for (int64_t d = 0; d < D; ++d) ob[d] += f * a[d];
        }
        if (total > 0.f)
          for (int64_t d = 0; d < D; ++d) ob[d] /= total;
      }
    return;
  }
  const int64_t nh = B >= 2 * threads ? Hkv : 1;
  const int64_t per_seq = Hkv / nh;
  pagoda::parallel_for(0, B * per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t R = nh * G;
    std::vector<float> acc(R * D), mx(R), den(R);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / per_seq, h0 = (w % per_seq) * nh, lo = first_pos(sl, b, window);
      attend_range<E, SCALED>(b, h0, nh, lo, sl[b], qp, c, bt, H, D, G, bs, W, scale, acc.data(), mx.data(),
                              den.data(), softcap);
      float* ob = op + (b * H + h0 * G) * D;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) ob[r * D + d] = den[r] > 0.f ? acc[r * D + d] / den[r] : 0.f;
    }
  });
}

#if !defined(PAGODA_CORE_ONLY)
// out/q: [B, H, D] float32; k_cache/v_cache: [blocks, block_size, Hkv, D]; block_tables: [B, W]
// int32; seq_lens: [B] int32; k_scale/v_scale: the quantized cache's scales or empty; softcap > 0:
// the scores soft-capped (cap * tanh(score / cap)).
void paged_decode(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window,
                  at::Tensor k_scale, at::Tensor v_scale, double softcap);
#endif

}  // namespace pagoda::attn
