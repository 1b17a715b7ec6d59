// amx.h: a bfloat16 matmul on Intel AMX tiles for the batched-decode shapes (a few to a few
// dozen rows).
//
// Design notes
// - A decode step of 8-64 sequences is still a pass over the weights, and oneDNN's bfloat16
//   kernels, built for large products, read L3-resident weights at 7-20 GB/s at those row counts.
//   Here the weight is packed once into the layout a tile multiply reads, 32 output features at a
//   time with each block's K values contiguous, so every thread streams its share front to back.
// - Rows are rounded to bfloat16 (as oneDNN does for a bfloat16 model) into tiles of 16; each
//   16 x 16 output block sums float32 products in one fixed order along K, so a row's result does
//   not depend on the other rows of the step.
// - Layout: [ceil(N/32), ceil(K/32), 2, 16, 32] bfloat16, zero padded; tile t of block (n, k)
//   holds features 32n + 16t .. and, per tile row, the pairs k, k+1 of its 16 features side by
//   side (the VNNI order TDPBF16PS takes).
// - Linux grants the tile state per process on request (arch_prctl); where it refuses, or the CPU
//   lacks AMX, `tiles_granted()` is false and oneDNN serves.
// - The core (the packer, the tile product `matmul`) is plain C++ over pointers, sizes and row
//   strides, bfloat16 as its uint16_t bits: it builds with -DPAGODA_CORE_ONLY and no ATen.
//   tests/kernels/cpp/cores_test.cpp checks the packer on every x86 variant and the product
//   against a double-precision reference where the CPU has AMX-BF16 and Linux grants the tiles.
//   amx.cpp's ops are a thin layer over it: the tensor checks, the allocations and the errors.
#pragma once

#include "core.h"

// The AVX-512 variant carries this kernel: the tile instructions are enabled for the kernel's own
// functions below (a target push/pop), and it runs only where the CPU reports AMX-BF16
// (available(), pagoda/kernels/select.py). GCC's target pragma enables the instructions but does
// not define __AMX_TILE__, so the code keys on its own PAGODA_AMX.
#if defined(__x86_64__) && defined(__AVX512BF16__) && !defined(PAGODA_NO_AMX)
#define PAGODA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if !defined(PAGODA_CORE_ONLY)
#include "pagoda.h"  // ATen, for the entry points at the end
#endif

namespace pagoda::amx {

constexpr int64_t NB = 32;            // output features per block: two 16-column tiles
constexpr int64_t KB = 32;            // bfloat16 values of K per tile step (64 bytes a row)
constexpr int64_t BLOCK_STEP = 2048;  // bytes of packed weight per block and K step

inline int64_t up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Values (bfloat16) of a packed [N, K] weight.
inline int64_t packed_size(int64_t N, int64_t K) { return up(N, NB) * up(K, KB); }

// weight [N, K] (bfloat16 bits, row-major) -> the packed layout at d (packed_size values).
static inline void pack_into(const uint16_t* s, int64_t N, int64_t K, uint16_t* d) {
  const int64_t NBc = up(N, NB) / NB, KS = up(K, KB) / KB;
  pagoda::parallel_for(0, NBc, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t ks = 0; ks < KS; ++ks)
        for (int64_t t = 0; t < 2; ++t)
          for (int64_t kk = 0; kk < 16; ++kk)
            for (int64_t j = 0; j < 16; ++j)
              for (int64_t p = 0; p < 2; ++p) {
                const int64_t n = b * NB + t * 16 + j, k = ks * KB + kk * 2 + p;
                d[(((b * KS + ks) * 2 + t) * 16 + kk) * 32 + j * 2 + p] = (n < N && k < K) ? s[n * K + k] : 0;
              }
  });
}

#if defined(PAGODA_AMX)
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
#define PAGODA_AMX_TARGET_PUSHED 1
#endif
// Linux hands out the AMX tile state only to processes that ask for it (once per process).
inline bool request_tiles() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: the float32 outputs (rows m, m+16 x features n, n+16); 4-5: two 16-row slices of
// the activations; 6-7: the two weight tiles of a block. All 16 rows x 64 bytes.
static inline void configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// The rows as bfloat16 tiles [Mp/16][K/32][16][32], zero padded (float32 rows rounded to
// nearest even, as torch's conversion does).
template <typename T>
static inline void pack_rows(const T* x, int64_t M, int64_t K, int64_t ldx, uint16_t* a, int64_t Mp, int64_t KS) {
  for (int64_t r = 0; r < Mp; ++r) {
    for (int64_t ks = 0; ks < KS; ++ks) {
      uint16_t* dst = a + (((r / 16) * KS + ks) * 16 + r % 16) * KB;
      const int64_t k0 = ks * KB, n = r < M ? std::min<int64_t>(KB, K - k0) : 0;
      if (n <= 0) {
        std::memset(dst, 0, KB * 2);
        continue;
      }
      if constexpr (std::is_same_v<T, float>) {
        const __mmask16 lo = n >= 16 ? 0xFFFF : (1u << n) - 1, hi = n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0;
        const __m512 a0 = _mm512_maskz_loadu_ps(lo, x + r * ldx + k0);
        const __m512 a1 = _mm512_maskz_loadu_ps(hi, x + r * ldx + k0 + 16);
        _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(a1, a0));
      } else {
        std::memcpy(dst, x + r * ldx + k0, n * 2);
        if (n < KB) std::memset(dst + n, 0, (KB - n) * 2);
      }
    }
  }
}

// A thread's blocks are one contiguous stream of weight, but tile loads alone kept it well below
// the memory's pace (`perf`: the step stalled on its weight tile loads): each K step asks for the
// 2 KB it will read four steps on, into L2. (Past the end of the tensor a prefetch is a no-op,
// not a fault.) Over a 56M-parameter model's shapes on the Xeon VM: 1.3-1.5x at 1-16 rows,
// 1.7-2.3x at 32, weights in cache or from memory.
static inline void prefetch_ahead(const char* step) {
  for (int l = 0; l < (int)BLOCK_STEP; l += 64) _mm_prefetch(step + 4 * BLOCK_STEP + l, _MM_HINT_T1);
}

// y[M, N] (row stride ldy) = rows x weight^T over blocks [b0, b1).
static inline void blocks(const uint16_t* a, const uint16_t* w, float* y, int64_t M, int64_t Mp, int64_t N,
                          int64_t ldy, int64_t KS, int64_t b0, int64_t b1) {
  configure();
  alignas(64) float part[16][16];
  const int64_t a_tile = KS * 16 * KB;  // bfloat16 values per 16-row slice
  for (int64_t b = b0; b < b1; ++b) {
    const char* wb = reinterpret_cast<const char*>(w) + b * KS * BLOCK_STEP;
    const int64_t n0 = b * NB, cols = std::min<int64_t>(NB, N - n0);
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
      const bool two = m0 + 16 < Mp;
      const char* a0 = reinterpret_cast<const char*>(a + (m0 / 16) * a_tile);
      const char* a1 = a0 + a_tile * 2;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      if (two) {
        for (int64_t ks = 0; ks < KS; ++ks) {
          prefetch_ahead(wb + ks * BLOCK_STEP);
          _tile_loadd(6, wb + ks * BLOCK_STEP, 64);
          _tile_loadd(7, wb + ks * BLOCK_STEP + 1024, 64);
          _tile_loadd(4, a0 + ks * 1024, 64);
          _tile_loadd(5, a1 + ks * 1024, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      } else {
        for (int64_t ks = 0; ks < KS; ++ks) {
          prefetch_ahead(wb + ks * BLOCK_STEP);
          _tile_loadd(6, wb + ks * BLOCK_STEP, 64);
          _tile_loadd(7, wb + ks * BLOCK_STEP + 1024, 64);
          _tile_loadd(4, a0 + ks * 1024, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
      }
      // Whole 16 x 16 outputs go straight to y; partial ones (the last rows or features) through
      // a buffer.
      auto put = [&](int64_t m, int64_t n, auto store_to) {
        const int64_t rows = std::min<int64_t>(16, M - m), c = std::min<int64_t>(16, cols - n);
        if (rows <= 0 || c <= 0) return;
        if (rows == 16 && c == 16) {
          store_to(y + m * ldy + n0 + n, ldy * 4);
        } else {
          store_to(&part[0][0], 64);
          for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (m + r) * ldy + n0 + n, part[r], c * 4);
        }
      };
      put(m0, 0, [](float* p, int64_t s) { _tile_stored(0, p, s); });
      put(m0, 16, [](float* p, int64_t s) { _tile_stored(1, p, s); });
      if (two) {
        put(m0 + 16, 0, [](float* p, int64_t s) { _tile_stored(2, p, s); });
        put(m0 + 16, 16, [](float* p, int64_t s) { _tile_stored(3, p, s); });
      }
    }
  }
  _tile_release();
}
#if defined(PAGODA_AMX_TARGET_PUSHED)
#pragma GCC pop_options
#undef PAGODA_AMX_TARGET_PUSHED
#endif
#endif  // PAGODA_AMX

// Whether this variant carries the kernel (whatever this CPU has).
#if defined(PAGODA_AMX)
constexpr bool kCompiled = true;
#else
constexpr bool kCompiled = false;
#endif

// Whether this variant has the kernel and the process may use the tiles.
static inline bool tiles_granted() {
#if defined(PAGODA_AMX)
  return request_tiles();
#else
  return false;
#endif
}

// y [M, N] float32 (row stride ldy) = x [M, K] (float32, or bfloat16 bits with x_bf16; row stride
// ldx) @ weight^T, the weight packed by pack_into. False (nothing computed) where the variant has
// no kernel or Linux refused the tiles.
static inline bool matmul(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                          const uint16_t* w, int64_t N) {
#if defined(PAGODA_AMX)
  if (!request_tiles()) return false;
  if (M == 0) return true;
  const int64_t Mp = up(M, 16), KS = up(K, KB) / KB, NBc = up(N, NB) / NB;
  std::vector<uint16_t> a(Mp * KS * KB + 32);
  uint16_t* ap = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(a.data()) + 63) & ~uintptr_t(63));
  if (x_bf16)
    pack_rows(static_cast<const uint16_t*>(x), M, K, ldx, ap, Mp, KS);
  else
    pack_rows(static_cast<const float*>(x), M, K, ldx, ap, Mp, KS);
  // Whole blocks per thread, in ascending order: each thread streams one stretch of the weights.
  pagoda::parallel_for(0, NBc, 1, [&](int64_t b0, int64_t b1) { blocks(ap, w, y, M, Mp, N, ldy, KS, b0, b1); });
  return true;
#else
  (void)y, (void)ldy, (void)x, (void)x_bf16, (void)ldx, (void)M, (void)K, (void)w, (void)N;
  return false;
#endif
}

#if !defined(PAGODA_CORE_ONLY)
// The ops (amx.cpp).
bool compiled();
bool available();
// weight [N, K] bfloat16 -> the packed layout.
at::Tensor pack(at::Tensor weight);
// y [M, N] float32 (row stride ldy) = x [M, K] (float32 or bfloat16, row stride ldx) @ weight^T;
// the fused decode blocks call it directly (decode.cpp). Raises where `matmul` cannot run.
void amx_linear(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                const at::BFloat16* w, int64_t N);
// x [M, K] float32 or bfloat16 @ weight^T -> [M, n] float32.
at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t n);
#endif

}  // namespace pagoda::amx
