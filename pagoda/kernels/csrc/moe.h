// moe.h: a mixture-of-experts layer's experts in one call (gate/up product, SiLU-and-mul,
// down product, the routing weights' sum), float32 or bfloat16 weights packed in panels.
//
// Design notes
// - The experts' rows are sorted by expert (a counting sort), so each active expert's weights are
//   read once for all its rows; inactive experts cost nothing.
// - Register-blocked: up to 28 activation rows by one vector of output features, or up to 14 rows
//   by two panels (gate with up, two adjacent down panels) so that with few rows each broadcast
//   activation still feeds two multiply-adds. Weights are packed at start-up into panels of 16
//   output features stored k-major (pagoda/kernels/moe.py's pack_experts), bfloat16 widened in
//   registers; float32 sums; the weight stream is prefetched a fixed distance ahead.
// - A token's result does not depend on which other tokens share the batch (same blocking for
//   every row). AVX2 takes a tile's rows six at a time (its sixteen registers), with the same
//   in-order fused multiply-adds per output, so it matches the AVX-512 kernel bit for bit; other
//   variants walk the panels with plain loops (the compiler vectorises them to their width).
// - The core (the pair grouping, the tiles, `experts`) is plain C++ over pointers and sizes: it
//   builds with -DPAGODA_CORE_ONLY and no ATen (tests/kernels/cpp/cores_test.cpp checks it on
//   every x86 variant and on NEON under qemu). moe.cpp's op is a thin layer over it: the tensor
//   checks, the buffers, the dtype dispatch. The threads are OpenMP's (`experts` takes their
//   number); a build without -fopenmp runs every part on the calling thread.
#pragma once

#include "core.h"
#include "vec.h"
#if !defined(PAGODA_CORE_ONLY)
#include "pagoda.h"  // ATen, for the entry point at the end
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace pagoda::moe {
constexpr int NP = 16;  // output features per packed panel (one vector)
constexpr int PF = 64;  // software prefetch distance in k steps (4 KB of float32 panel)
constexpr int MT_MAX = 28;  // rows per tile: 28 accumulators, the weight vector and a broadcast

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2: R rows (of a tile whose rows are `stride` apart in each k step) against one panel, two
// 8-lane vectors per row; `fetch`: prefetch the panel ahead (the first pass over it).
template <typename W, int R>
static inline void ptile_rows(const float* x, int stride, const W* p, int64_t K, float* out, int64_t ldo,
                              bool fetch) {
  using vec::VecF;
  VecF a[R], b[R];
  for (int r = 0; r < R; ++r) a[r] = b[r] = VecF::zero();
  for (int64_t k = 0; k < K; ++k) {
    const W* pk = p + k * NP;
    if (fetch && (sizeof(W) == 4 || (k & 1) == 0))
      _mm_prefetch(reinterpret_cast<const char*>(pk + PF * NP), _MM_HINT_T1);
    const VecF w0 = VecF::load(pk), w1 = VecF::load(pk + 8);
    const float* xk = x + k * stride;
    for (int r = 0; r < R; ++r) {
      const VecF xb = VecF::set1(xk[r]);
      a[r] = vec::fma(w0, xb, a[r]);
      b[r] = vec::fma(w1, xb, b[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    a[r].store(out + r * ldo);
    b[r].store(out + r * ldo + 8);
  }
}
#endif

// One tile of MT rows against one panel: out[r * ldo + c] = sum_k x[k * MT + r] * p[k * NP + c].
// x is the tile's rows stored k-major; p is the weight's output features c0 .. c0 + NP - 1
// stored k-major, read as one sequential stream.
template <typename W, int MT>
static void ptile(const float* x, const W* p, int64_t K, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  __m512 a[MT];
#pragma GCC unroll 32
  for (int r = 0; r < MT; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* pk = p + k * NP;
    if (sizeof(W) == 4 || (k & 1) == 0)  // one cache line per float32 step, per two bfloat16 ones
      _mm_prefetch(reinterpret_cast<const char*>(pk + PF * NP), _MM_HINT_T1);
    const __m512 w = load16(pk);
    const float* xk = x + k * MT;
#pragma GCC unroll 32
    for (int r = 0; r < MT; ++r) a[r] = _mm512_fmadd_ps(w, _mm512_set1_ps(xk[r]), a[r]);
  }
#pragma GCC unroll 32
  for (int r = 0; r < MT; ++r) _mm512_storeu_ps(out + r * ldo, a[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  // Sixteen registers: up to six rows per pass (two 8-lane accumulators each), the later passes
  // reading the panel from cache. Each output sums its products in k order with fused
  // multiply-adds, as the AVX-512 loop does, so the two variants agree to the bit.
  int r0 = 0;
  for (; r0 + 6 <= MT; r0 += 6) ptile_rows<W, 6>(x + r0, MT, p, K, out + r0 * ldo, ldo, r0 == 0);
  switch (MT - r0) {
    case 5: ptile_rows<W, 5>(x + r0, MT, p, K, out + r0 * ldo, ldo, r0 == 0); break;
    case 4: ptile_rows<W, 4>(x + r0, MT, p, K, out + r0 * ldo, ldo, r0 == 0); break;
    case 3: ptile_rows<W, 3>(x + r0, MT, p, K, out + r0 * ldo, ldo, r0 == 0); break;
    case 2: ptile_rows<W, 2>(x + r0, MT, p, K, out + r0 * ldo, ldo, r0 == 0); break;
    case 1: ptile_rows<W, 1>(x + r0, MT, p, K, out + r0 * ldo, ldo, r0 == 0); break;
    default: break;
  }
#else
  for (int r = 0; r < MT; ++r) {
    float acc[NP] = {0.f};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[k * MT + r];
      for (int c = 0; c < NP; ++c) acc[c] += xv * static_cast<float>(p[k * NP + c]);
    }
    for (int c = 0; c < NP; ++c) out[r * ldo + c] = acc[c];
  }
#endif
}

// Two panels against one tile of MT <= MT2_MAX rows: pa's sums to out[r * ldo + c], pb's to
// out[r * ldo + NP + c]. Each broadcast activation feeds two multiply-adds, which a tile of few
// rows needs: with one panel its loads (a broadcast per row and the weight vector) would outnumber
// the multiply-adds.
constexpr int MT2_MAX = 14;
template <typename W, int MT>
static void ptile2(const float* x, const W* pa, const W* pb, int64_t K, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  __m512 a[MT], b[MT];
#pragma GCC unroll 16
  for (int r = 0; r < MT; ++r) { a[r] = _mm512_setzero_ps(); b[r] = _mm512_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const W* pak = pa + k * NP;
    const W* pbk = pb + k * NP;
    if (sizeof(W) == 4 || (k & 1) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(pak + PF * NP), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pbk + PF * NP), _MM_HINT_T1);
    }
    const __m512 wa = load16(pak), wb = load16(pbk);
    const float* xk = x + k * MT;
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) {
      const __m512 xb = _mm512_set1_ps(xk[r]);
      a[r] = _mm512_fmadd_ps(wa, xb, a[r]);
      b[r] = _mm512_fmadd_ps(wb, xb, b[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MT; ++r) {
    _mm512_storeu_ps(out + r * ldo, a[r]);
    _mm512_storeu_ps(out + r * ldo + NP, b[r]);
  }
#else
  ptile<W, MT>(x, pa, K, out, ldo);
  ptile<W, MT>(x, pb, K, out + NP, ldo);
#endif
}

template <typename W, int... R>
static void tile_rows(int mt, const float* x, const W* p, int64_t K, float* y, int64_t ldy,
                      std::integer_sequence<int, R...>) {
  using Tile = void (*)(const float*, const W*, int64_t, float*, int64_t);
  static constexpr Tile tiles[] = {&ptile<W, R + 1>...};  // tiles[i]: i + 1 rows
  tiles[mt - 1](x, p, K, y, ldy);
}

template <typename W, int... R>
static void tile_rows2(int mt, const float* x, const W* pa, const W* pb, int64_t K, float* y, int64_t ldy,
                       std::integer_sequence<int, R...>) {
  using Tile = void (*)(const float*, const W*, const W*, int64_t, float*, int64_t);
  static constexpr Tile tiles[] = {&ptile2<W, R + 1>...};
  tiles[mt - 1](x, pa, pb, K, y, ldy);
}

// An expert's m rows as tiles: as few as MT_MAX allows, evenly sized (30 rows: 15 + 15).
static inline int64_t num_tiles(int64_t m) { return (m + MT_MAX - 1) / MT_MAX; }
static inline int64_t tile_start(int64_t m, int64_t t) {
  const int64_t n = num_tiles(m);
  return m / n * t + std::min(t, m % n);
}

// Rows p0 .. p0 + m - 1 (one expert's) times one panel into y[r * ldy + c]. Activations are kept
// per tile, k-major: tile t (rows r0 .. r1 - 1) at (p0 + r0) * K, element (r, k) at
// (p0 + r0) * K + k * (r1 - r0) + (r - r0).
template <typename W>
static void panel(const float* xt, int64_t p0, int64_t m, const W* p, int64_t K, float* y, int64_t ldy) {
  for (int64_t t = 0; t < num_tiles(m); ++t) {
    const int64_t r0 = tile_start(m, t), r1 = tile_start(m, t + 1);
    tile_rows<W>(static_cast<int>(r1 - r0), xt + (p0 + r0) * K, p, K, y + r0 * ldy, ldy,
                 std::make_integer_sequence<int, MT_MAX>{});
  }
}

// The same for two panels whose outputs are side by side (pb's at y + NP): one pass over both
// where a tile has at most MT2_MAX rows, else one panel after the other.
template <typename W>
static void panel_pair(const float* xt, int64_t p0, int64_t m, const W* pa, const W* pb, int64_t K, float* y,
                       int64_t ldy) {
  for (int64_t t = 0; t < num_tiles(m); ++t) {
    const int64_t r0 = tile_start(m, t), r1 = tile_start(m, t + 1);
    const int mt = static_cast<int>(r1 - r0);
    const float* xs = xt + (p0 + r0) * K;
    if (mt <= MT2_MAX) {
      tile_rows2<W>(mt, xs, pa, pb, K, y + r0 * ldy, ldy, std::make_integer_sequence<int, MT2_MAX>{});
    } else {
      tile_rows<W>(mt, xs, pa, K, y + r0 * ldy, ldy, std::make_integer_sequence<int, MT_MAX>{});
      tile_rows<W>(mt, xs, pb, K, y + r0 * ldy + NP, ldy, std::make_integer_sequence<int, MT_MAX>{});
    }
  }
}

struct Groups {
  std::vector<int64_t> offsets;  // expert e's rows: offsets[e] .. offsets[e + 1] - 1
  std::vector<int64_t> pos;      // pair p's row, -1 if its expert is another rank's
  std::vector<int64_t> token;    // row's token
};

// The T * k (token, slot) pairs of ids [T, k] (global expert ids, this rank holding first ..
// first + E - 1) grouped by local expert, a counting sort: rows offsets[E] in all.
static inline Groups group_pairs(const int64_t* idp, int64_t T, int64_t k, int64_t first, int64_t E) {
  Groups g;
  g.offsets.assign(E + 1, 0);
  g.pos.assign(T * k, -1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = idp[p] - first;
    if (e >= 0 && e < E) ++g.offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) g.offsets[e + 1] += g.offsets[e];
  const int64_t P = g.offsets[E];
  std::vector<int64_t> fill(g.offsets.begin(), g.offsets.end() - 1);
  g.token.resize(P);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = idp[p] - first;
    if (e >= 0 && e < E) {
      g.pos[p] = fill[e]++;
      g.token[g.pos[p]] = p / k;
    }
  }
  return g;
}

// w13: [E, 2, I / NP, H, NP] (gate then up panels), w2: [E, H / NP, I, NP], both zero-padded to
// whole panels. x [T, H], wts [T, k]; out [T, H]. g: group_pairs of the ids, P = g.offsets[E]
// rows; scratch xs [P, H], act [P, I], y [P, H]. `threads`: OpenMP threads to run on (a build
// without OpenMP runs on the caller's); each output's sums do not depend on it.
template <typename W>
static void experts(const float* x, const float* wts, int64_t T, int64_t k, const Groups& g, const W* w13,
                    const W* w2, int64_t E, int64_t H, int64_t I, float* xs, float* act, float* y, float* out,
                    int threads) {
  const int64_t pi = (I + NP - 1) / NP, ph = (H + NP - 1) / NP;
  const std::vector<int64_t>& off = g.offsets;
  int64_t max_rows = 0;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (expert, tile) for the gather
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m = off[e + 1] - off[e];
    max_rows = std::max(max_rows, m);
    for (int64_t t = 0; t < num_tiles(m); ++t) tiles.emplace_back(e, t);
  }
  #pragma omp parallel num_threads(threads)
  {
#if defined(_OPENMP)
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
#else
    const int nt = 1, tid = 0;
    (void)threads;
#endif
    // Gather: each tile's rows, k-major.
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < (int64_t)tiles.size(); ++i) {
      const int64_t e = tiles[i].first, m = off[e + 1] - off[e];
      const int64_t r0 = tile_start(m, tiles[i].second), mt = tile_start(m, tiles[i].second + 1) - r0;
      float* blk = xs + (off[e] + r0) * H;
      for (int64_t r = 0; r < mt; ++r) {
        const float* xr = x + g.token[off[e] + r0 + r] * H;
        for (int64_t c = 0; c < H; ++c) blk[c * mt + r] = xr[c];
      }
    }
    // Gate and up: this thread's panels of every active expert, then silu(gate) * up written
    // k-major per tile as the down projection's activations.
    std::vector<float> h(max_rows * 2 * NP);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t p0 = off[e], m = off[e + 1] - p0;
      if (m == 0) continue;
      for (int64_t c = pi * tid / nt; c < pi * (tid + 1) / nt; ++c) {
        panel_pair(xs, p0, m, w13 + ((e * 2 + 0) * pi + c) * H * NP, w13 + ((e * 2 + 1) * pi + c) * H * NP, H,
                   h.data(), 2 * NP);
        const int64_t cols = std::min<int64_t>(NP, I - c * NP);
        for (int64_t t = 0; t < num_tiles(m); ++t) {
          const int64_t r0 = tile_start(m, t), mt = tile_start(m, t + 1) - r0;
          float* blk = act + (p0 + r0) * I + c * NP * mt;
          for (int64_t r = 0; r < mt; ++r) {
            const float* hr = h.data() + (r0 + r) * 2 * NP;
            float a[NP];
            // vec.h's SiLU on every width (one exp polynomial: the variants agree)
            for (int j = 0; j < NP; j += vec::kVecWidth)
              vec::silu_mul(vec::VecF::load(hr + j), vec::VecF::load(hr + NP + j)).store(a + j);
            for (int64_t j = 0; j < cols; ++j) blk[j * mt + r] = a[j];
          }
        }
      }
    }
    #pragma omp barrier
    // Down: this thread's panels of every active expert, rows of y [P, H].
    for (int64_t e = 0; e < E; ++e) {
      const int64_t p0 = off[e], m = off[e + 1] - p0;
      if (m == 0) continue;
      const int64_t c1 = ph * (tid + 1) / nt;
      for (int64_t c = ph * tid / nt; c < c1; ++c) {
        const W* p = w2 + (e * ph + c) * I * NP;
        if (c + 1 < c1 && (c + 2) * NP <= H) {  // two whole panels at once
          panel_pair(act, p0, m, p, p + I * NP, I, y + p0 * H + c * NP, H);
          ++c;
        } else if ((c + 1) * NP <= H) {
          panel(act, p0, m, p, I, y + p0 * H + c * NP, H);
        } else {  // a last, partial panel: through the buffer
          panel(act, p0, m, p, I, h.data(), NP);
          for (int64_t r = 0; r < m; ++r)
            std::memcpy(y + (p0 + r) * H + c * NP, h.data() + r * NP, (H - c * NP) * sizeof(float));
        }
      }
    }
    #pragma omp barrier
    // Each token's slots in order, weighted (0 where every slot went to another rank).
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* o = out + t * H;
      std::fill(o, o + H, 0.f);
      for (int64_t s = 0; s < k; ++s) {
        const int64_t q = g.pos[t * k + s];
        if (q < 0) continue;
        const float wt = wts[t * k + s];
        const float* yq = y + q * H;
        for (int64_t c = 0; c < H; ++c) o[c] += wt * yq[c];
      }
    }
  }
}

#if !defined(PAGODA_CORE_ONLY)
// The routed experts of x [T, H] float32: weights/ids [T, k]; w13/w2 packed panels (see above).
at::Tensor moe_experts(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor w13, at::Tensor w2,
                       int64_t first, int64_t I);
#endif

}  // namespace pagoda::moe
