// woq_core.h: weight-only quantized matmuls (int8 per channel or per group, int4 per group, fp8
// e4m3) on AVX-512 CPUs with integer (VNNI) and bfloat16 dot products; int8 and int4 also on AVX2.
//
// Design notes
// - A decode step is one pass over the weights, so the kernel must spend fewer instructions per
//   weight byte than the memory delivers; dequantizing each weight to float first left int8/int4
//   compute-bound at a third of the bandwidth.
// - int8/int4: integer dot products, no per-weight conversion. Each activation row is written as
//   16-bit fixed point with one scale per row, x ~ sx * (256 * hi + lo) (error at most
//   max|x| * 2^-16 per element; a bfloat16 rounding is |x| * 2^-9), split into two byte planes,
//   and vpdpbusd multiplies 64 weight bytes by 4 activation bytes per lane. Sums are exact in
//   int32 (per group for int4, then the group's float scale); int8's plane offsets are undone with
//   per-channel column sums computed at packing time. A row's result does not depend on the batch.
// - int4 reads 0.625 bytes a weight (group of 32): the codes, and per group and channel a float16
//   scale and a float16 zero term (gs, gb: [G, N] each). The row is quantized to |v| <= 32639 and
//   split as v = 256 * hi + lo with both planes signed bytes (hi = (v + 128) >> 8), so that
//   sum q * v = 256 * sum q * hi + sum q * lo needs no per-group code sum (an int32 per group and
//   channel until this layout). The cost is a 0.4% coarser activation step (2^-15.99 of max|x|).
//   Symmetric codes (term = -8 * scale in every group: GGUF Q4_0, symmetric GPTQ) leave gb out
//   (0.5625 bytes a weight): the fold computes -8 * scale in float, exactly the stored term.
// - int8 in groups (kind 3; GGUF Q8_0: a float16 scale per 32 columns and channel, 1.0625 bytes a
//   weight): codes stored as q + 128 (vpdpbusd's unsigned operand) times int4's signed activation
//   planes, so per group sum (q + 128) * v - 128 * sum v = sum q * v exactly in int32 (modular
//   adds: only that sum, at most 128 * 32639 * 256 < 2^31, must fit), rounded to float once, times
//   the group's scale. The scales are [N/16][G][16] (each block's in one stream: a one-row tile
//   reads them in order). Plain AVX2 multiplies the zero-extended codes by kWide8G's 16-bit values
//   (int4's, in kWide8's order), the same integers: all paths give the same bits. It replaced
//   running Q8_0 as two int4 planes (1.19 bytes a weight, two products, the row quantized twice).
// - fp8 (e4m3): each 16-channel block is dequantized into bfloat16 in the order vdpbf16ps reads
//   it; activations rounded to bfloat16; float32 sums.
// - Layouts are built by pagoda/kernels/woq.py (pack_int8 / pack_int8g / pack_int4 / pack_fp8).
// - The avx2 variant has both int8 kinds and int4 (its own notes below: the same activations and
//   layouts, int4 and grouped int8 bit-identical to the AVX-512 kernel, int8 per channel within
//   float rounding); fp8 needs AVX-512.
// - Variants with neither compile the stub below (`linear` returns false, woq.cpp's available()
//   is false) and the layers keep torch's ops or their dequantizing path.
// - The core (the activation quantizer, every path's tiles and rows, `linear`) is plain C++ over
//   pointers and sizes: it builds with -DPAGODA_CORE_ONLY and no ATen (tests/kernels/cpp/
//   cores_test.cpp checks it against a double-precision product on the dequantized weights on every
//   x86 variant, and that `linear` refuses where a variant has no kernel: scalar, NEON under qemu).
//   woq.cpp's op is a thin layer over it: the tensor checks, the int4 metadata, the errors.
#pragma once

#include "core.h"

namespace pagoda::woq {
// Bytes ahead of each weight stream that the loops prefetch (into L1).
#define PAGODA_WOQ_PREFETCH 1024
// int4 activations: |v| <= 32767 - 128, so that hi = (v + 128) >> 8 is a signed byte.
[[maybe_unused]] constexpr int32_t kInt4VMax = 32767 - 128;
// int8 in groups: each row's group offsets -128 * sum v (exact integers: |sum v| <= 256 * 32639),
// where a group's int32 sum starts, so that adding sum (q + 128) * v leaves sum q * v.
[[maybe_unused]] inline std::vector<int32_t> int8g_offsets(const std::vector<float>& xsum) {
  std::vector<int32_t> off(xsum.size());
  for (size_t i = 0; i < xsum.size(); ++i) off[i] = -128 * static_cast<int32_t>(xsum[i]);
  return off;
}
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)

namespace {

// ---- int8 / int4: integer dot products ----------------------------------------------------

// Rows of x as 16-bit fixed point, x[m][k] ~ sx[m] * (256 * hi + lo), stored as two byte planes
// with the offsets the kernel's operand signedness needs (int8: |v| <= 32767, both unsigned,
// hi + 128; int4: |v| <= kInt4VMax, both signed, hi rounded to nearest so that lo is in
// -128..127). xsum[m][g]: sum of the 16-bit values over each group (int4).
struct Act {
  std::vector<uint8_t> hi, lo;
  std::vector<float> sx, xsum;
};

// One row: its scale, byte planes and (int4) group sums. Vectorised, with the same float
// products and round-to-nearest-even as ``nearbyint``; the group sums are of integers below 2**24
// in magnitude, exact in float in any order (16 values of one group are added as one int32 sum:
// a division per value had made this loop a seventh of an int4 prefill).
void quantize_row(const float* xr, int64_t K, bool for_int4, int64_t group, uint8_t* hi, uint8_t* lo,
                  float* sx, float* xsum) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
  const int32_t vmax_i = for_int4 ? kInt4VMax : 32767;
  const float inv = amax > 0.f ? static_cast<float>(vmax_i) / amax : 0.f;
  *sx = amax / static_cast<float>(vmax_i);
  const uint8_t hi_flip = for_int4 ? 0 : 0x80, lo_flip = for_int4 ? 0x80 : 0;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i top = _mm512_set1_epi32(vmax_i), bottom = _mm512_set1_epi32(-vmax_i);
  const __m512i hflip = _mm512_set1_epi32(hi_flip), lflip = _mm512_set1_epi32(lo_flip);
  // int4 rounds hi to nearest (v + 128), so that lo = v - 256 * hi is a signed byte too
  const __m512i hround = _mm512_set1_epi32(for_int4 ? 128 : 0);
  alignas(64) int32_t v16[16];
  for (k = 0; k < K; k += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, K - k));
    const __mmask16 mask = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u);
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, xr + k), vinv));
    v = _mm512_max_epi32(bottom, _mm512_min_epi32(top, v));
    const __m512i u = _mm512_add_epi32(v, hround);
    const __m512i h = _mm512_xor_si512(_mm512_and_si512(_mm512_srai_epi32(u, 8), _mm512_set1_epi32(0xFF)), hflip);
    const __m512i l = _mm512_xor_si512(_mm512_and_si512(u, _mm512_set1_epi32(0xFF)), lflip);
    _mm512_mask_cvtepi32_storeu_epi8(hi + k, mask, h);
    _mm512_mask_cvtepi32_storeu_epi8(lo + k, mask, l);
    if (for_int4) {
      if (n == 16 && group % 16 == 0) {  // the 16 values share one group: their exact int32 sum
        xsum[k / group] += static_cast<float>(_mm512_reduce_add_epi32(v));
      } else {
        _mm512_store_si512(v16, v);
        for (int i = 0; i < n; ++i) xsum[(k + i) / group] += static_cast<float>(v16[i]);
      }
    }
  }
}

Act quantize_rows(const float* x, int64_t M, int64_t K, bool for_int4, int64_t group) {
  Act a;
  a.hi.resize(M * K);
  a.lo.resize(M * K);
  a.sx.resize(M);
  const int64_t G = for_int4 ? K / group : 0;
  a.xsum.assign(M * G, 0.f);
  // Rows in parallel once there are several (each row's values are its own).
  pagoda::parallel_for(0, M, 2, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, for_int4, group, a.hi.data() + m * K, a.lo.data() + m * K, a.sx.data() + m,
                   a.xsum.data() + m * G);
  });
  return a;
}

inline __m512i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Sixteen float16 values (an int4 group's scales or zero terms) as float32, exactly.
inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// int8, rows [0, MT) of the row chunk, NBL 16-channel blocks: per column quad one 64-byte load
// per block and two vpdpbusd per row (unsigned activation bytes x signed weights).
template <int MT, int NBL>
void int8_tile(const uint8_t* w, int64_t bstride, const uint8_t* hi, const uint8_t* lo, int64_t K,
               const float* sx, const float* cs, const int32_t* wsum128, int64_t n0, float* y, int64_t N,
               const float* bias) {
  __m512i ah[MT * NBL], al[MT * NBL];
  for (int i = 0; i < MT * NBL; ++i) ah[i] = al[i] = _mm512_setzero_si512();
  for (int64_t q = 0; q < K / 4; ++q) {
    __m512i wv[NBL];
    for (int j = 0; j < NBL; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + j * bstride + q * 64 + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
      wv[j] = _mm512_loadu_si512(w + j * bstride + q * 64);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512i h = bcast4(hi + m * K + 4 * q), l = bcast4(lo + m * K + 4 * q);
      for (int j = 0; j < NBL; ++j) {
        ah[m * NBL + j] = _mm512_dpbusd_epi32(ah[m * NBL + j], h, wv[j]);
        al[m * NBL + j] = _mm512_dpbusd_epi32(al[m * NBL + j], l, wv[j]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NBL; ++j) {
      const int64_t n = n0 + 16 * j;
      // sum w * (hi + 128) - 128 * sum w = sum w * hi, exact in int32
      const __m512i h = _mm512_sub_epi32(ah[m * NBL + j], _mm512_loadu_si512(wsum128 + n));
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(al[m * NBL + j]));
      // (v * sx) * cs + bias with one explicit rounding pattern (a fused multiply-add where there
      // is a bias), so that the compiler's contraction cannot differ between variants
      v = _mm512_mul_ps(v, _mm512_set1_ps(sx[m]));
      v = bias ? _mm512_fmadd_ps(v, _mm512_loadu_ps(cs + n), _mm512_loadu_ps(bias + n))
               : _mm512_mul_ps(v, _mm512_loadu_ps(cs + n));
      _mm512_storeu_ps(y + m * N + n, v);
    }
}

// int4: per 8 columns one 64-byte load per block (two nibbles per byte), the nibbles split
// with and/shift, four vpdpbusd per row (unsigned nibbles x signed activation bytes). Integer
// sums per group; the group's scale and zero are applied once per group in float.
template <int MT, int NBL>
void int4_tile(const uint8_t* w, int64_t bstride, const uint8_t* hi, const uint8_t* lo, const float* xsum,
               int64_t K, int64_t group, const float* sx, const uint16_t* gs, const uint16_t* gb, int64_t n0,
               float* y, int64_t N, const float* bias) {
  const int64_t G = K / group, opg = group / 8;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 tot[MT * NBL];
  for (int i = 0; i < MT * NBL; ++i) tot[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i ah[MT * NBL], al[MT * NBL];
    for (int i = 0; i < MT * NBL; ++i) ah[i] = al[i] = _mm512_setzero_si512();
    for (int64_t o = g * opg; o < (g + 1) * opg; ++o) {
      __m512i wl[NBL], wh[NBL];
      for (int j = 0; j < NBL; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w + j * bstride + o * 64 + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(w + j * bstride + o * 64);
        wl[j] = _mm512_and_si512(v, nib);
        wh[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
      for (int m = 0; m < MT; ++m) {
        const uint8_t* hr = hi + m * K + 8 * o;
        const uint8_t* lr = lo + m * K + 8 * o;
        const __m512i h0 = bcast4(hr), h1 = bcast4(hr + 4), l0 = bcast4(lr), l1 = bcast4(lr + 4);
        for (int j = 0; j < NBL; ++j) {
          const int i = m * NBL + j;
          ah[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ah[i], wl[j], h0), wh[j], h1);
          al[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(al[i], wl[j], l0), wh[j], l1);
        }
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NBL; ++j) {
        const int i = m * NBL + j;
        const int64_t n = n0 + 16 * j;
        // sum q * v = 256 * sum q * hi + sum q * lo; the group's float16 scale and zero term
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ah[i]), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(al[i]));
        const __m512 s = load_half16(gs + g * N + n);
        tot[i] = _mm512_fmadd_ps(v, s, tot[i]);
        const __m512 z = gb ? load_half16(gb + g * N + n) : _mm512_mul_ps(s, _mm512_set1_ps(-8.f));
        tot[i] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * G + g]), z, tot[i]);
      }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NBL; ++j) {
      const int64_t n = n0 + 16 * j;
      // tot * sx + bias: explicitly fused, as the AVX2 code does (the same bits)
      const __m512 v = bias ? _mm512_fmadd_ps(tot[m * NBL + j], _mm512_set1_ps(sx[m]), _mm512_loadu_ps(bias + n))
                            : _mm512_mul_ps(tot[m * NBL + j], _mm512_set1_ps(sx[m]));
      _mm512_storeu_ps(y + m * N + n, v);
    }
}

// int8 in groups (kind 3): codes stored as q + 128, vpdpbusd's unsigned operand, times int4's
// signed byte planes; per group sum (q + 128) * v = 256 * hi_sum + lo_sum exactly in int32
// (modular: only the final value must fit), and the low plane's sum starts at the row's group
// offset -128 * sum v (int8g_offsets), so the group ends at the exact sum q * v, rounded to float
// once and multiplied by the group's float16 scale. gs: [N/16][G][16] float16, each block's
// scales in one stream.
template <int MT, int NBL>
void int8g_tile(const uint8_t* w, int64_t bstride, const uint8_t* hi, const uint8_t* lo, const int32_t* xoff,
                int64_t K, int64_t group, const float* sx, const uint16_t* gs, int64_t n0, float* y, int64_t N,
                const float* bias) {
  const int64_t G = K / group, qpg = group / 4;
  const uint16_t* gb0 = gs + (n0 / 16) * G * 16;
  __m512 tot[MT * NBL];
  for (int i = 0; i < MT * NBL; ++i) tot[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i ah[MT * NBL], al[MT * NBL];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NBL; ++j) {
        ah[m * NBL + j] = _mm512_setzero_si512();
        al[m * NBL + j] = _mm512_set1_epi32(xoff[m * G + g]);
      }
    for (int64_t q = g * qpg; q < (g + 1) * qpg; ++q) {
      __m512i wv[NBL];
      for (int j = 0; j < NBL; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(w + j * bstride + q * 64 + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
        wv[j] = _mm512_loadu_si512(w + j * bstride + q * 64);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512i h = bcast4(hi + m * K + 4 * q), l = bcast4(lo + m * K + 4 * q);
        for (int j = 0; j < NBL; ++j) {
          ah[m * NBL + j] = _mm512_dpbusd_epi32(ah[m * NBL + j], wv[j], h);
          al[m * NBL + j] = _mm512_dpbusd_epi32(al[m * NBL + j], wv[j], l);
        }
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NBL; ++j) {
        const int i = m * NBL + j;
        const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(ah[i], 8), al[i]);
        tot[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), load_half16(gb0 + (j * G + g) * 16), tot[i]);
      }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NBL; ++j) {
      const int64_t n = n0 + 16 * j;
      const __m512 v = bias ? _mm512_fmadd_ps(tot[m * NBL + j], _mm512_set1_ps(sx[m]), _mm512_loadu_ps(bias + n))
                            : _mm512_mul_ps(tot[m * NBL + j], _mm512_set1_ps(sx[m]));
      _mm512_storeu_ps(y + m * N + n, v);
    }
}

// ---- fp8: dequantize to bfloat16, vdpbf16ps ------------------------------------------------

inline __m512 fp8_to_f32(__m128i bytes) {
  __m512i v = _mm512_cvtepu8_epi32(bytes);
  __m512i mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7F)), 20);
  __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
  __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

// k pair p of one 16-channel fp8 block: 32 bf16 in (channel, k parity) order.
inline __m512bh fp8_pair(const uint8_t* w, int64_t p) {
  const __m128i* src = reinterpret_cast<const __m128i*>(w + p * 32);
  return _mm512_cvtne2ps_pbh(fp8_to_f32(_mm_loadu_si128(src + 1)), fp8_to_f32(_mm_loadu_si128(src)));
}

// Few rows: dequantize in registers and multiply at once. NBL blocks side by side give
// independent accumulation chains (each sums its k pairs in order, as the scratch path does).
template <int MT, int NBL>
void fp8_fused(const uint8_t* w, int64_t bstride, const int32_t* xb, int64_t P, __m512* out) {
  __m512 acc[MT * NBL];
  for (int i = 0; i < MT * NBL; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    for (int j = 0; j < NBL; ++j) {
      const __m512bh wv = fp8_pair(w + j * bstride, p);
      for (int m = 0; m < MT; ++m)
        acc[m * NBL + j] = _mm512_dpbf16_ps(acc[m * NBL + j], (__m512bh)_mm512_set1_epi32(xb[m * P + p]), wv);
    }
  }
  for (int i = 0; i < MT * NBL; ++i) out[i] = acc[i];
}

template <int MT>
void fp8_fused_rows(const uint8_t* w, int64_t bstride, int nbl, const int32_t* xb, int64_t P, __m512* out) {
  switch (nbl) {
    case 4: fp8_fused<MT, 4>(w, bstride, xb, P, out); break;
    case 3: fp8_fused<MT, 3>(w, bstride, xb, P, out); break;
    case 2: fp8_fused<MT, 2>(w, bstride, xb, P, out); break;
    default: fp8_fused<MT, 1>(w, bstride, xb, P, out); break;
  }
}

// Rows [m0, m0 + MT) times two scratch blocks (32 channels).
template <int MT>
void micro(const int32_t* xb, int64_t P, const __m512bh* t0, const __m512bh* t1, __m512* out) {
  __m512 acc[2 * MT];
  for (int i = 0; i < 2 * MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const __m512bh w0 = t0[p], w1 = t1[p];
    for (int m = 0; m < MT; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xb[m * P + p]);
      acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], a, w0);
      acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], a, w1);
    }
  }
  for (int i = 0; i < 2 * MT; ++i) out[i] = acc[i];
}

void fp8_linear(float* op, const float* xp, int64_t M, int64_t K, int64_t N, const uint8_t* wp,
                const float* cs, const float* bp) {
  const int64_t P = K / 2, NB = N / 16, bstride = P * 32;
  std::vector<c10::BFloat16> xbv(M * K);
  for (int64_t i = 0; i < M * K; ++i) xbv[i] = c10::BFloat16(xp[i]);
  const int32_t* xb = reinterpret_cast<const int32_t*>(xbv.data());
  auto store = [&](int64_t row, int64_t n, __m512 y) {
    y = _mm512_mul_ps(y, _mm512_loadu_ps(cs + n));
    if (bp) y = _mm512_add_ps(y, _mm512_loadu_ps(bp + n));
    _mm512_storeu_ps(op + row * N + n, y);
  };
  if (M <= 4) {
    pagoda::parallel_for(0, (NB + 3) / 4, 1, [&](int64_t g_begin, int64_t g_end) {
      __m512 acc[16];
      for (int64_t gi = g_begin; gi < g_end; ++gi) {
        const int64_t nb0 = 4 * gi;
        const int nbl = static_cast<int>(std::min<int64_t>(4, NB - nb0));
        const uint8_t* w = wp + nb0 * bstride;
        switch (M) {
          case 4: fp8_fused_rows<4>(w, bstride, nbl, xb, P, acc); break;
          case 3: fp8_fused_rows<3>(w, bstride, nbl, xb, P, acc); break;
          case 2: fp8_fused_rows<2>(w, bstride, nbl, xb, P, acc); break;
          default: fp8_fused_rows<1>(w, bstride, nbl, xb, P, acc); break;
        }
        for (int64_t m = 0; m < M; ++m)
          for (int j = 0; j < nbl; ++j) store(m, (nb0 + j) * 16, acc[m * nbl + j]);
      }
    });
    return;
  }
  pagoda::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<__m512bh> scratch(2 * P);
    __m512 acc[16];
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t nb0 = 2 * t, nblocks = std::min<int64_t>(2, NB - nb0);
      for (int64_t j = 0; j < nblocks; ++j)
        for (int64_t p = 0; p < P; ++p) scratch[j * P + p] = fp8_pair(wp + (nb0 + j) * bstride, p);
      const __m512bh* t1 = nblocks == 2 ? scratch.data() + P : scratch.data();
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mt = static_cast<int>(std::min<int64_t>(8, M - m0));
        const int32_t* xr = xb + m0 * P;
        switch (mt) {
          case 8: micro<8>(xr, P, scratch.data(), t1, acc); break;
          case 7: micro<7>(xr, P, scratch.data(), t1, acc); break;
          case 6: micro<6>(xr, P, scratch.data(), t1, acc); break;
          case 5: micro<5>(xr, P, scratch.data(), t1, acc); break;
          case 4: micro<4>(xr, P, scratch.data(), t1, acc); break;
          case 3: micro<3>(xr, P, scratch.data(), t1, acc); break;
          case 2: micro<2>(xr, P, scratch.data(), t1, acc); break;
          default: micro<1>(xr, P, scratch.data(), t1, acc); break;
        }
        for (int m = 0; m < mt; ++m)
          for (int64_t j = 0; j < nblocks; ++j) store(m0 + m, (nb0 + j) * 16, acc[2 * m + j]);
      }
    }
  });
}

}  // namespace

// out [M, N] float32 = x [M, K] float32 @ W.T (+ bias); w packed for ``kind`` (0 int8, 1 fp8, 2 int4).
// int8: cs [N], aux [N] int32 = 128 * sum_k q[n, k]. int4: gs / gb [G, N] float16 bits, group scale
// and -scale * zero (gb null: -8 * scale); cs, aux unused. int8 in groups (kind 3): w holds q + 128,
// gs [N/16, G, 16] float16 bits, group a multiple of 4 up to 256; cs, gb, aux unused. fp8: cs [N].
// bias [N] or null.
// False (nothing written) where this variant has no kernel for ``kind``.
static inline bool linear(float* op, const float* xp, int64_t M, int64_t K, int64_t N, const uint8_t* wp, int kind,
                          const float* cs, const uint16_t* gsp, const uint16_t* gbp, int64_t group,
                          const int32_t* auxp, const float* bp) {
  if (kind != 0 && kind != 1 && kind != 2 && kind != 3) return false;
  const int64_t NB = N / 16;
  if (M == 0) return true;
  if (kind == 1) {
    fp8_linear(op, xp, M, K, N, wp, cs, bp);
    return true;
  }
  const bool int4 = kind == 2, int8g = kind == 3;
  const Act a = quantize_rows(xp, M, K, int4 || int8g, group);  // int8g: int4's signed planes, group sums
  const std::vector<int32_t> xoff = int8g ? int8g_offsets(a.xsum) : std::vector<int32_t>();
  const int64_t bstride = int4 ? K * 8 : K * 16;  // bytes per 16-channel block
  // Tasks of 64 channels; each runs its rows in chunks of up to 4 (its weights stay in cache).
  pagoda::parallel_for(0, (NB + 3) / 4, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t nb_end = std::min(NB, 4 * t + 4);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mt = static_cast<int>(std::min<int64_t>(4, M - m0));
        const int nbl_max = mt <= 2 ? 4 : 2;  // accumulators in registers: 2 * mt * nbl <= 16
        for (int64_t nb = 4 * t; nb < nb_end;) {
          const int nbl = static_cast<int>(std::min<int64_t>(nbl_max, nb_end - nb));
          const uint8_t* wb = wp + nb * bstride;
          const uint8_t* hi = a.hi.data() + m0 * K;
          const uint8_t* lo = a.lo.data() + m0 * K;
          const float* sx = a.sx.data() + m0;
          float* y = op + m0 * N;
#define PAGODA_WOQ_TILE(MT_, NBL_)                                                                          \
  if (int4)                                                                                                 \
    int4_tile<MT_, NBL_>(wb, bstride, hi, lo, a.xsum.data() + m0 * (K / group), K, group, sx, gsp, gbp,     \
                         nb * 16, y, N, bp);                                                                \
  else if (int8g)                                                                                           \
    int8g_tile<MT_, NBL_>(wb, bstride, hi, lo, xoff.data() + m0 * (K / group), K, group, sx, gsp, nb * 16, y,  \
                          N, bp);                                                                           \
  else                                                                                                      \
    int8_tile<MT_, NBL_>(wb, bstride, hi, lo, K, sx, cs, auxp, nb * 16, y, N, bp);
          switch (mt * 8 + nbl) {
            case 1 * 8 + 4: PAGODA_WOQ_TILE(1, 4) break;
            case 1 * 8 + 3: PAGODA_WOQ_TILE(1, 3) break;
            case 1 * 8 + 2: PAGODA_WOQ_TILE(1, 2) break;
            case 1 * 8 + 1: PAGODA_WOQ_TILE(1, 1) break;
            case 2 * 8 + 4: PAGODA_WOQ_TILE(2, 4) break;
            case 2 * 8 + 3: PAGODA_WOQ_TILE(2, 3) break;
            case 2 * 8 + 2: PAGODA_WOQ_TILE(2, 2) break;
            case 2 * 8 + 1: PAGODA_WOQ_TILE(2, 1) break;
            case 3 * 8 + 2: PAGODA_WOQ_TILE(3, 2) break;
            case 3 * 8 + 1: PAGODA_WOQ_TILE(3, 1) break;
            case 4 * 8 + 2: PAGODA_WOQ_TILE(4, 2) break;
            default: PAGODA_WOQ_TILE(4, 1) break;
          }
#undef PAGODA_WOQ_TILE
          nb += nbl;
        }
      }
    }
  });
  return true;
}

#elif defined(__AVX2__) && defined(__FMA__)
// ---- AVX2 (+FMA): int8 and int4; fp8 stays with the AVX-512 variant ---------------------------
//
// The same 16-bit fixed-point activations as the AVX-512 kernel (the same row quantizer, value
// for value), over the same packed layouts. AVX2 has no vpdpbusd, so the plain path multiplies
// 16-bit weights by the 16-bit activations with vpmaddwd (two products per int32 lane, sixteen
// per instruction: what the byte planes' two vpmaddubsw gave, without the widening):
// - Weights become 16-bit lanes by shifts within each lane, not by cross-lane widening: a lane
//   of a channel's 4-byte column quad holds two bytes (int8: columns 2i and 2i+1; int4: four
//   nibbles), so and/shift give, per lane pair, the columns (0, 2) and (1, 3) of the quad (int8,
//   arithmetic shifts) or (0, 2), (4, 6), (1, 3), (5, 7) of the octet (int4). The quantizer writes
//   each row's 16-bit values in that order (Planes::kWide8 / kWide4), so one 32-bit broadcast
//   pairs with each, and every int32 lane is one channel's sum: no folding of partial lanes.
//   It replaced byte planes through vpmaddubsw (int4) and cross-lane widening with vpmovsxbw
//   (int8), which spent more instructions per product (figures in docs/benchmarks.md).
// - int4: per group the exact integer sum of q * v (int32 over spans of up to kInt4Span
//   columns), whose float conversion is the one rounding the AVX-512 kernel's
//   256 * hi_sum + lo_sum also makes: with its float epilogue in order, the results are
//   bit-identical to the avx512 variant's. One row keeps the byte planes (int4_row: two
//   vpmaddubsw a 32-weight pair, tuned for the memory stream at batch 1; the same bits).
// - int8: a lane gains at most 4 * 128 * 32767 per column quad, so the int32 sums are folded
//   into float every 64 quads (256 columns): exact for K <= 256, otherwise one float rounding per
//   256 columns (relative 2^-24 each), against the AVX-512 kernel's two roundings of its
//   whole-row byte-plane sums. The activations' own rounding (2^-16 of the row's largest value)
//   is the same on both.
// - AVX-VNNI (Intel since Alder Lake, AMD since Zen 4): vpdpbusd on 256-bit registers. Where the
//   CPU has it (checked at run time; set_vnni turns it off) int8 and int4 take the AVX-512
//   kernel's scheme at half its width: the same byte planes, the same per-channel column sums and
//   float epilogue, so both kinds are bit-identical to the avx512 variant's. Per 64 int8 weights
//   two loads and, per row, four vpdpbusd (the plain path: four vpmaddwd and four adds); per
//   128 int4 weights, per row, eight vpdpbusd (plain: eight vpmaddwd and eight adds). These
//   functions carry target("avxvnni") so the rest of the variant stays x86-64-v3.
namespace {

// Row m of x as 16-bit fixed point x ~ sx * v, |v| <= 32767 (int4: kInt4VMax), rounded to nearest
// even exactly as the AVX-512 quantizer does (the same float product and rounding), written as:
// - kInt4: the AVX-512 kernel's two signed byte planes hi = (v + 128) >> 8 and lo = v - 256 * hi;
// - kInt8: the AVX-512 int8 kernel's planes, both unsigned: hi + 128 and lo (AVX-VNNI int8);
// - kWide8: v as int16 (v16), each column quad in the order 0 2 1 3 (plain int8);
// - kWide4: v as int16, each column octet in the order 0 2 4 6 1 3 5 7 (plain int4);
// - kWide8G: kWide8's order with int4's values (|v| <= kInt4VMax) and group sums (plain int8 in
//   groups: the same v as the byte planes the AVX-512 and AVX-VNNI kernels take, kInt4).
// int4 layouts (and kWide8G) also get the per-group sums of v, added 16 values at a time (one int32
// sum where a group holds them all), in the same order as the AVX-512 quantizer.
enum class Planes { kInt4, kInt8, kWide8, kWide4, kWide8G };

void quantize_row(const float* xr, int64_t K, Planes planes, int64_t group, int16_t* v16, uint8_t* hi, uint8_t* lo,
                  float* sx, float* xsum) {
  const bool for_int4 = planes == Planes::kInt4 || planes == Planes::kWide4 || planes == Planes::kWide8G;
  const bool wide8 = planes == Planes::kWide8 || planes == Planes::kWide8G;
  __m256 vmax = _mm256_setzero_ps();
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(xr + k), absmask));
  alignas(32) float m8[8];
  _mm256_store_ps(m8, vmax);
  float amax = 0.f;
  for (float v : m8) amax = std::max(amax, v);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
  const int32_t vmax_i = for_int4 ? kInt4VMax : 32767;
  const float inv = amax > 0.f ? static_cast<float>(vmax_i) / amax : 0.f;
  *sx = amax / static_cast<float>(vmax_i);
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i top = _mm256_set1_epi32(vmax_i), bottom = _mm256_set1_epi32(-vmax_i);
  // int4 rounds hi to nearest (v + 128, no int16 overflow below kInt4VMax): lo is a signed byte
  const __m256i hround = _mm256_set1_epi16(for_int4 ? 128 : 0);
  alignas(32) float buf[16];
  alignas(32) int32_t vi[16];
  alignas(32) int16_t s[16];
  // kWide4's octet order as a byte shuffle within each 128-bit lane (int16 element e: bytes 2e, 2e+1)
  const __m256i octet = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (k = 0; k < K; k += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, K - k));
    const float* src = xr + k;
    if (n < 16) {  // the tail, zero padded (as the AVX-512 quantizer's masked load)
      std::fill(buf, buf + 16, 0.f);
      std::memcpy(buf, src, n * sizeof(float));
      src = buf;
    }
    __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src), vinv));
    __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8), vinv));
    v0 = _mm256_max_epi32(bottom, _mm256_min_epi32(top, v0));
    v1 = _mm256_max_epi32(bottom, _mm256_min_epi32(top, v1));
    // 16 int16 in order (packs interleaves the 128-bit halves; the permute restores them).
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(v0, v1), 0xD8);
    if (wide8 || planes == Planes::kWide4) {
      // n is a whole number of quads (int8: K % 4 == 0) or octets (int4: K % 8 == 0)
      const __m256i o = wide8 ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(p, 0xD8), 0xD8)
                              : _mm256_shuffle_epi8(p, octet);
      _mm256_store_si256(reinterpret_cast<__m256i*>(s), o);
      std::memcpy(v16 + k, s, n * sizeof(int16_t));
    } else {
      const __m256i u = _mm256_add_epi16(p, hround);
      const __m256i h = _mm256_srai_epi16(u, 8);
      const __m256i l = _mm256_sub_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0xFF)), _mm256_set1_epi16(128));
      __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi16(h, l), 0xD8);  // [hi 0..15 | lo 0..15]
      if (!for_int4) b = _mm256_xor_si256(b, _mm256_set1_epi8(static_cast<char>(0x80)));  // unsigned planes
      alignas(32) uint8_t bytes[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), b);
      std::memcpy(hi + k, bytes, n);
      std::memcpy(lo + k, bytes + 16, n);
    }
    if (!for_int4) continue;
    _mm256_store_si256(reinterpret_cast<__m256i*>(vi), v0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(vi + 8), v1);
    if (n == 16 && group % 16 == 0) {  // the 16 values share one group: their exact int32 sum
      int32_t t = 0;
      for (int i = 0; i < 16; ++i) t += vi[i];
      xsum[k / group] += static_cast<float>(t);
    } else {
      for (int i = 0; i < n; ++i) xsum[(k + i) / group] += static_cast<float>(vi[i]);
    }
  }
}

struct Act {
  std::vector<int16_t> v16;
  std::vector<uint8_t> hi, lo;
  std::vector<float> sx, xsum;
};

Act quantize_rows(const float* x, int64_t M, int64_t K, Planes planes, int64_t group) {
  const bool for_int4 = planes == Planes::kInt4 || planes == Planes::kWide4 || planes == Planes::kWide8G;
  Act a;
  if (planes == Planes::kWide8 || planes == Planes::kWide4 || planes == Planes::kWide8G) {
    a.v16.resize(M * K);
  } else {
    a.hi.resize(M * K);
    a.lo.resize(M * K);
  }
  a.sx.resize(M);
  const int64_t G = for_int4 ? K / group : 0;
  a.xsum.assign(M * G, 0.f);
  pagoda::parallel_for(0, M, 2, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, planes, group, a.v16.empty() ? nullptr : a.v16.data() + m * K,
                   a.hi.empty() ? nullptr : a.hi.data() + m * K, a.lo.empty() ? nullptr : a.lo.data() + m * K,
                   a.sx.data() + m, a.xsum.data() + m * G);
  });
  return a;
}

inline __m256i bcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

constexpr int64_t kInt8Chunk = 64;  // column quads summed in int32 before folding into float

// A 16-channel block's column quad q (64 bytes: per channel 4 column bytes; h = 0/1 the channels
// 0-7 / 8-15) as 16-bit lanes: p = 0 the columns (0, 2) of each channel, p = 1 the columns (1, 3).
static inline __m256i int8_pairs(__m256i v, int p) {
  return p == 0 ? _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8) : _mm256_srai_epi16(v, 8);
}

// int8, MT rows x NBL 16-channel blocks (each two halves of 8 channels): per column quad one
// 32-byte load per half, its bytes as 16-bit column pairs (int8_pairs), and per row and pair one
// 32-bit broadcast of the matching kWide8 activations and one vpmaddwd + add per half.
template <int MT, int NBL>
void int8_tile(const int8_t* w, int64_t bstride, const int16_t* x16, int64_t K, const float* sx, const float* cs,
               int64_t n0, float* y, int64_t N, const float* bias) {
  constexpr int H = 2 * NBL;
  __m256 tot[MT * H];
  for (int i = 0; i < MT * H; ++i) tot[i] = _mm256_setzero_ps();
  const int64_t Q = K / 4;
  for (int64_t q0 = 0; q0 < Q; q0 += kInt8Chunk) {
    const int64_t q1 = std::min(Q, q0 + kInt8Chunk);
    __m256i acc[MT * H];
    for (int i = 0; i < MT * H; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t q = q0; q < q1; ++q) {
      __m256i v[H];
      for (int h = 0; h < H; ++h) {
        const int8_t* line = w + (h / 2) * bstride + q * 64 + 32 * (h % 2);
        if (h % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(line + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
        v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
      }
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {
        __m256i a[H];
        for (int h = 0; h < H; ++h) a[h] = int8_pairs(v[h], p);
        for (int m = 0; m < MT; ++m) {
          const __m256i b = bcast4(reinterpret_cast<const uint8_t*>(x16 + m * K + 4 * q + 2 * p));
          for (int h = 0; h < H; ++h) acc[m * H + h] = _mm256_add_epi32(acc[m * H + h], _mm256_madd_epi16(a[h], b));
        }
      }
    }
    // Each lane is below 64 * 4 * 128 * 32767 < 2^30.
    for (int i = 0; i < MT * H; ++i) tot[i] = _mm256_add_ps(tot[i], _mm256_cvtepi32_ps(acc[i]));
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < H; ++h) {
      const int64_t n = n0 + 8 * h;
      // (tot * sx) * cs + bias, the AVX-512 kernel's explicit pattern
      __m256 v = _mm256_mul_ps(tot[m * H + h], _mm256_set1_ps(sx[m]));
      v = bias ? _mm256_fmadd_ps(v, _mm256_loadu_ps(cs + n), _mm256_loadu_ps(bias + n))
               : _mm256_mul_ps(v, _mm256_loadu_ps(cs + n));
      _mm256_storeu_ps(y + m * N + n, v);
    }
}

// int8 in groups (kind 3), codes q + 128: a lane's two bytes as zero-extended 16-bit values (p = 0
// the columns (0, 2) of each channel, p = 1 the columns (1, 3); one and or shift each, where the
// signed codes of int8_pairs take two shifts or one).
static inline __m256i uint8_pairs(__m256i v, int p) {
  return p == 0 ? _mm256_and_si256(v, _mm256_set1_epi16(0x00FF)) : _mm256_srli_epi16(v, 8);
}

// The block's float16 scales of group g for half h (8 channels) of block j: gs is [N/16][G][16].
static inline __m256 int8g_scales(const uint16_t* gb0, int64_t G, int64_t g, int h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb0 + ((h / 2) * G + g) * 16 + 8 * (h % 2))));
}

// int8 in groups, MT rows x NBL 16-channel blocks, plain AVX2: int8_tile's loop over the group's
// column quads with unsigned codes (kWide8G activations), each group's int32 sums starting at the
// row's offset -128 * sum v, so that they end at the exact sum q * v (modular adds: only that sum
// must fit), rounded to float once and times the group's float16 scale: the AVX-512 kernel's value
// and operations, so the same bits. QPG: the group's quads when known at compile time (Q8_0's 8:
// the loop unrolls, and the per-group work had cost a fifth of the time at 2-32 rows), else 0.
template <int MT, int NBL, int QPG>
void int8g_tile(const uint8_t* w, int64_t bstride, const int16_t* x16, const int32_t* xoff, int64_t K, int64_t group,
                const float* sx, const uint16_t* gs, int64_t n0, float* y, int64_t N, const float* bias) {
  constexpr int H = 2 * NBL;
  const int64_t G = K / group, qpg = QPG ? QPG : group / 4;
  const uint16_t* gb0 = gs + (n0 / 16) * G * 16;
  __m256 tot[MT * H];
  for (int i = 0; i < MT * H; ++i) tot[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[MT * H];
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < H; ++h) acc[m * H + h] = _mm256_set1_epi32(xoff[m * G + g]);
    for (int64_t q = g * qpg; q < (g + 1) * qpg; ++q) {
      __m256i v[H];
      for (int h = 0; h < H; ++h) {
        const uint8_t* line = w + (h / 2) * bstride + q * 64 + 32 * (h % 2);
        if (h % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(line + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
        v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
      }
#pragma GCC unroll 2
      for (int p = 0; p < 2; ++p) {
        __m256i a[H];
        for (int h = 0; h < H; ++h) a[h] = uint8_pairs(v[h], p);
        for (int m = 0; m < MT; ++m) {
          const __m256i b = bcast4(reinterpret_cast<const uint8_t*>(x16 + m * K + 4 * q + 2 * p));
          for (int h = 0; h < H; ++h) acc[m * H + h] = _mm256_add_epi32(acc[m * H + h], _mm256_madd_epi16(a[h], b));
        }
      }
    }
    for (int i = 0; i < MT * H; ++i)
      tot[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), int8g_scales(gb0, G, g, i % H), tot[i]);
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < H; ++h) {
      const int64_t n = n0 + 8 * h;
      const __m256 t = tot[m * H + h], s = _mm256_set1_ps(sx[m]);  // tot * sx + bias, fused as AVX-512
      _mm256_storeu_ps(y + m * N + n, bias ? _mm256_fmadd_ps(t, s, _mm256_loadu_ps(bias + n)) : _mm256_mul_ps(t, s));
    }
}

// Two vpdpbusd's worth of products on AVX2, left in 16 bits: acc16 + per 16-bit lane the two
// products u8(u0) * s8(s0) and the two of u1, s1 (vpmaddubsw). A nibble times a signed byte is at
// most 15 * 128, so each call adds at most 4 * 15 * 128 = 7680 to a lane and four calls stay
// below 2^15: nothing saturates, and vpmaddwd by ones then widens the pairs into vpdpbusd's
// int32 lanes (its exact sums).
constexpr int kInt4Octets16 = 4;  // octets summed in 16 bits before widening
inline __m256i dot2_16(__m256i acc16, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  return _mm256_add_epi16(acc16, _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)));
}

// Fetch, at the start of a one-row int4 tile, what it reads outside its weight streams: each
// group's float16 scales and zero terms ([G, N] arrays: 32 bytes per array, group and block,
// N * 2 bytes apart, a pattern no stream prefetcher follows; each had been a miss the group fold
// waited on), and the first lines of its NB weight streams, so those misses overlap.
// Bytes ahead of each weight stream that the one-row int4 tiles prefetch: twice the tiles' distance
// (PAGODA_WOQ_PREFETCH), since a row's two streams at 1 KB each kept too few lines in flight for
// the memory's latency (one thread streaming a token's int4 weights: 16 -> 18 GB/s at 2 KB).
constexpr int64_t kRowAhead = 2048;

template <int NB>
static inline void prefetch_int4_row(const uint8_t* w, int64_t bstride, const uint16_t* gs, const uint16_t* gb,
                                     int64_t G, int64_t N, int64_t n0) {
  for (int64_t g = 0; g < G; ++g)
    for (int b = 0; b < NB; ++b) {
      const int64_t at = g * N + n0 + 16 * b;
      _mm_prefetch(reinterpret_cast<const char*>(gs + at), _MM_HINT_T0);
      if (gb) _mm_prefetch(reinterpret_cast<const char*>(gb + at), _MM_HINT_T0);
    }
  for (int b = 0; b < NB; ++b)
    for (int64_t off = 0; off < std::min<int64_t>(bstride, kRowAhead); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + b * bstride + off), _MM_HINT_T0);
}

// Eight float16 values (an int4 group's scales or zero terms) as float32, exactly (F16C).
static inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One group's sum of q * v (v: as float, one rounding of the exact integer) folded into a running
// float total of eight output columns: times the group's scales, plus the activation row's group
// sum times the group's zero-point terms (``gb``); the AVX-512 kernel's operations in order.
static inline __m256 fold_group_sum(__m256 tot, __m256 v, const uint16_t* gs, const uint16_t* gb, int64_t at,
                                    float xsum) {
  const __m256 s = load_half8(gs + at);
  tot = _mm256_fmadd_ps(v, s, tot);
  const __m256 z = gb ? load_half8(gb + at) : _mm256_mul_ps(s, _mm256_set1_ps(-8.f));  // symmetric: -8 * scale
  return _mm256_fmadd_ps(_mm256_set1_ps(xsum), z, tot);
}

// The same from the byte planes' int32 sums: sum q * v = 256 * sum q * hi + sum q * lo, exact
// inside the fma and rounded once.
static inline __m256 fold_group(__m256 tot, __m256i hi_sum, __m256i lo_sum, const uint16_t* gs, const uint16_t* gb,
                                int64_t at, float xsum) {
  const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_sum), _mm256_set1_ps(256.f), _mm256_cvtepi32_ps(lo_sum));
  return fold_group_sum(tot, v, gs, gb, at, xsum);
}

// The int4 tile's rows out: tot * sx + bias, explicitly fused as in the AVX-512 kernel (the same
// bits), sixteen columns from n0 for each of MT rows.
template <int MT>
static inline void store_int4_rows(const __m256* tot, const float* sx, const float* bias, float* y, int64_t N,
                                   int64_t n0) {
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + 8 * h;
      const __m256 v = bias ? _mm256_fmadd_ps(tot[2 * m + h], _mm256_set1_ps(sx[m]), _mm256_loadu_ps(bias + n))
                            : _mm256_mul_ps(tot[2 * m + h], _mm256_set1_ps(sx[m]));
      _mm256_storeu_ps(y + m * N + n, v);
    }
}

// The int4 tiles' rows out: tot * sx + bias, explicitly fused as in the AVX-512 kernel (the same
// bits), sixteen columns from n0 (two halves of eight) for each of MT rows.
template <int MT>
static inline void store_int4_tile(const float (*tot)[8], const float* sx, const float* bias, float* y, int64_t N,
                                   int64_t n0) {
  for (int i = 0; i < 2 * MT; ++i) {
    const int64_t n = n0 + 8 * (i % 2);
    const __m256 t = _mm256_load_ps(tot[i]), s = _mm256_set1_ps(sx[i / 2]);
    const __m256 v = bias ? _mm256_fmadd_ps(t, s, _mm256_loadu_ps(bias + n)) : _mm256_mul_ps(t, s);
    _mm256_storeu_ps(y + (i / 2) * N + n, v);
  }
}

// A 16-channel block's column octet (64 bytes: per half of 8 channels a 32-byte line, per channel
// 4 bytes whose low nibbles are columns 0-3 and high nibbles 4-7) as 16-bit lanes: p = 0..3 the
// columns (0, 2), (4, 6), (1, 3), (5, 7) of each channel, the kWide4 activations' order.
static inline __m256i int4_pairs(__m256i v, int p) {
  const __m256i m4 = _mm256_set1_epi16(0x000F);
  switch (p) {
    case 0: return _mm256_and_si256(v, m4);
    case 1: return _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    case 2: return _mm256_and_si256(_mm256_srli_epi16(v, 8), m4);
    default: return _mm256_srli_epi16(v, 12);
  }
}

// Columns a group's int32 sums of q * v may span: |q * v| <= 15 * 32639, so 4096 columns stay
// below 2^31. A longer group (a whole-row GPTQ one) adds its spans' sums as 65536 * high + low
// parts, each exact in float, and converts them with one rounding as a short group's sum is.
constexpr int64_t kInt4Span = 4096;

// Keeps a register's value as computed here: GCC otherwise reassociates a chain of integer adds
// into a tree of products held at once, which spilled the int4 tiles' accumulators to the stack
// (the int8 tile is faster left as GCC orders it).
#define PAGODA_PIN(v) asm("" : "+x"(v))

// The int32 sums of q * v over octets [o0, o1) for MT rows x one 16-channel block (two halves of
// 8 channels), plain AVX2: per octet two 32-byte loads, their nibbles as 16-bit column pairs
// (int4_pairs), and per row and pair one 32-bit broadcast of the kWide4 activations and one
// vpmaddwd + add per half. acc[2 * m + h]: row m, half h.
template <int MT>
static inline __attribute__((always_inline)) void int4_span(const uint8_t* w, const int16_t* x16, int64_t K,
                                                            int64_t o0, int64_t o1, __m256i* acc) {
  for (int i = 0; i < 2 * MT; ++i) acc[i] = _mm256_setzero_si256();
  for (int64_t o = o0; o < o1; ++o) {
    _mm_prefetch(reinterpret_cast<const char*>(w + o * 64 + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * 64));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * 64 + 32));
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256i a0 = int4_pairs(v0, p), a1 = int4_pairs(v1, p);
      for (int m = 0; m < MT; ++m) {
        const __m256i b = bcast4(reinterpret_cast<const uint8_t*>(x16 + m * K + 8 * o + 2 * p));
        acc[2 * m] = _mm256_add_epi32(acc[2 * m], _mm256_madd_epi16(a0, b));
        acc[2 * m + 1] = _mm256_add_epi32(acc[2 * m + 1], _mm256_madd_epi16(a1, b));
        PAGODA_PIN(acc[2 * m]);
        PAGODA_PIN(acc[2 * m + 1]);
      }
    }
  }
}

// int4, MT rows x one 16-channel block, plain AVX2: per group the exact int32 sum of q * v
// (int4_span), folded as the AVX-512 kernel folds its byte planes' sums (the same float value,
// one rounding of the same integer), then its scale and zero term in that kernel's order; the
// totals stay in registers. Groups longer than kInt4Span take int4_tile_long.
template <int MT>
void int4_tile(const uint8_t* w, const int16_t* x16, const float* xsum, int64_t K, int64_t group, const float* sx,
               const uint16_t* gs, const uint16_t* gb, int64_t n0, float* y, int64_t N, const float* bias) {
  const int64_t G = K / group, opg = group / 8;
  __m256 tot[2 * MT];
  for (int i = 0; i < 2 * MT; ++i) tot[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[2 * MT];
    int4_span<MT>(w, x16, K, g * opg, (g + 1) * opg, acc);
    for (int i = 0; i < 2 * MT; ++i)
      tot[i] = fold_group_sum(tot[i], _mm256_cvtepi32_ps(acc[i]), gs, gb, g * N + n0 + 8 * (i % 2),
                              xsum[(i / 2) * G + g]);
  }
  store_int4_rows<MT>(tot, sx, bias, y, N, n0);
}

// int4_tile for groups longer than kInt4Span (a whole-row GPTQ group): each span's int32 sums
// are added as 65536 * high + low parts (each exact in float), converted with one rounding of
// the group's exact sum, as a short group's is.
template <int MT>
void int4_tile_long(const uint8_t* w, const int16_t* x16, const float* xsum, int64_t K, int64_t group,
                    const float* sx, const uint16_t* gs, const uint16_t* gb, int64_t n0, float* y, int64_t N,
                    const float* bias) {
  const int64_t G = K / group, opg = group / 8, span = kInt4Span / 8;
  __m256 tot[2 * MT];
  for (int i = 0; i < 2 * MT; ++i) tot[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i hs[2 * MT], ls[2 * MT], acc[2 * MT];
    for (int i = 0; i < 2 * MT; ++i) hs[i] = ls[i] = _mm256_setzero_si256();
    for (int64_t s0 = g * opg; s0 < (g + 1) * opg; s0 += span) {
      int4_span<MT>(w, x16, K, s0, std::min((g + 1) * opg, s0 + span), acc);
      for (int i = 0; i < 2 * MT; ++i) {
        hs[i] = _mm256_add_epi32(hs[i], _mm256_srai_epi32(acc[i], 16));
        ls[i] = _mm256_add_epi32(ls[i], _mm256_and_si256(acc[i], _mm256_set1_epi32(0xFFFF)));
      }
    }
    for (int i = 0; i < 2 * MT; ++i) {
      const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hs[i]), _mm256_set1_ps(65536.f), _mm256_cvtepi32_ps(ls[i]));
      tot[i] = fold_group_sum(tot[i], v, gs, gb, g * N + n0 + 8 * (i % 2), xsum[(i / 2) * G + g]);
    }
  }
  store_int4_rows<MT>(tot, sx, bias, y, N, n0);
}

// int4, one activation row x NB 16-channel blocks side by side (batch-1 decode): int4_tile's
// sums for one row, with each octet's four activation broadcasts shared by the blocks and NB
// weight streams in flight (one stream left the memory idle between its prefetches). The int32 group sums are
// the same integers in another order, so the results are the same bits.
template <int NB>
void int4_row(const uint8_t* w, int64_t bstride, const uint8_t* hi, const uint8_t* lo, const float* xsum, int64_t K,
              int64_t group, const float* sx, const uint16_t* gs, const uint16_t* gb, int64_t n0, float* y,
              int64_t N, const float* bias) {
  constexpr int H = 2 * NB;  // halves of 8 channels
  const int64_t G = K / group, opg = group / 8;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  prefetch_int4_row<NB>(w, bstride, gs, gb, G, N, n0);
  __m256 tot[H];
  for (int i = 0; i < H; ++i) tot[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i ah[H], al[H];
    for (int i = 0; i < H; ++i) ah[i] = al[i] = _mm256_setzero_si256();
    for (int64_t o0 = g * opg; o0 < (g + 1) * opg; o0 += kInt4Octets16) {
      const int64_t o1 = std::min((g + 1) * opg, o0 + kInt4Octets16);
      __m256i ph[H], pl[H];
      for (int i = 0; i < H; ++i) ph[i] = pl[i] = _mm256_setzero_si256();
      for (int64_t o = o0; o < o1; ++o) {
        const __m256i h0 = bcast4(hi + 8 * o), h1 = bcast4(hi + 8 * o + 4);
        const __m256i l0 = bcast4(lo + 8 * o), l1 = bcast4(lo + 8 * o + 4);
#pragma GCC unroll 8
        for (int i = 0; i < H; ++i) {
          const uint8_t* line = w + (i / 2) * bstride + o * 64 + 32 * (i % 2);
          if (i % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(line + kRowAhead), _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
          const __m256i wl = _mm256_and_si256(v, nib), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          ph[i] = dot2_16(ph[i], wl, h0, wh, h1);
          pl[i] = dot2_16(pl[i], wl, l0, wh, l1);
        }
      }
      for (int i = 0; i < H; ++i) {
        ah[i] = _mm256_add_epi32(ah[i], _mm256_madd_epi16(ph[i], ones));
        al[i] = _mm256_add_epi32(al[i], _mm256_madd_epi16(pl[i], ones));
      }
    }
    for (int i = 0; i < H; ++i) {
      const int64_t n = n0 + 8 * i;
      tot[i] = fold_group(tot[i], ah[i], al[i], gs, gb, g * N + n, xsum[g]);
    }
  }
  for (int b = 0; b < NB; ++b) store_int4_rows<1>(tot + 2 * b, sx, bias, y, N, n0 + 16 * b);
}

// ---- AVX-VNNI ---------------------------------------------------------------------------------

#define PAGODA_AVXVNNI __attribute__((target("avxvnni")))

}  // namespace

inline bool cpu_has_avx_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
}

// Whether the VNNI functions run: on by default where the CPU has them (set_vnni may turn them
// off). One variable for the whole program, whichever files include this header.
inline bool g_vnni = cpu_has_avx_vnni();

namespace {

// int8, MT rows x NBL 16-channel blocks (each two halves of 8 channels): per column quad two
// 32-byte loads per block and, per row, a vpdpbusd per half and byte plane (unsigned activation
// bytes x signed weights); the AVX-512 kernel's epilogue, lane for lane.
template <int MT, int NBL>
PAGODA_AVXVNNI void int8_tile_vnni(const uint8_t* w, int64_t bstride, const uint8_t* hi, const uint8_t* lo,
                                   int64_t K, const float* sx, const float* cs, const int32_t* wsum128, int64_t n0,
                                   float* y, int64_t N, const float* bias) {
  constexpr int A = MT * NBL * 2;
  __m256i ah[A], al[A];
  for (int i = 0; i < A; ++i) ah[i] = al[i] = _mm256_setzero_si256();
  for (int64_t q = 0; q < K / 4; ++q) {
    __m256i wv[NBL * 2];
    for (int j = 0; j < NBL; ++j) {
      const uint8_t* line = w + j * bstride + q * 64;
      _mm_prefetch(reinterpret_cast<const char*>(line + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
      wv[2 * j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
      wv[2 * j + 1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32));
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i h = bcast4(hi + m * K + 4 * q), l = bcast4(lo + m * K + 4 * q);
      for (int i = 0; i < NBL * 2; ++i) {
        ah[m * NBL * 2 + i] = _mm256_dpbusd_avx_epi32(ah[m * NBL * 2 + i], h, wv[i]);
        al[m * NBL * 2 + i] = _mm256_dpbusd_avx_epi32(al[m * NBL * 2 + i], l, wv[i]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int i = 0; i < NBL * 2; ++i) {
      const int64_t n = n0 + 8 * i;
      const int a = m * NBL * 2 + i;
      // sum w * (hi + 128) - 128 * sum w = sum w * hi, exact in int32; then as the AVX-512 kernel
      const __m256i h = _mm256_sub_epi32(ah[a], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wsum128 + n)));
      __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(256.f), _mm256_cvtepi32_ps(al[a]));
      v = _mm256_mul_ps(v, _mm256_set1_ps(sx[m]));
      v = bias ? _mm256_fmadd_ps(v, _mm256_loadu_ps(cs + n), _mm256_loadu_ps(bias + n))
               : _mm256_mul_ps(v, _mm256_loadu_ps(cs + n));
      _mm256_storeu_ps(y + m * N + n, v);
    }
}

// int8 in groups, MT rows x NBL 16-channel blocks on AVX-VNNI: the AVX-512 int8g_tile at half
// width (unsigned codes q + 128 x int4's signed byte planes, the same exact group sums, float
// epilogue in the same order), so the same bits.
template <int MT, int NBL>
PAGODA_AVXVNNI void int8g_tile_vnni(const uint8_t* w, int64_t bstride, const uint8_t* hi, const uint8_t* lo,
                                    const int32_t* xoff, int64_t K, int64_t group, const float* sx,
                                    const uint16_t* gs, int64_t n0, float* y, int64_t N, const float* bias) {
  constexpr int H = 2 * NBL, A = MT * H;
  const int64_t G = K / group, qpg = group / 4;
  const uint16_t* gb0 = gs + (n0 / 16) * G * 16;
  __m256 tot[A];
  for (int i = 0; i < A; ++i) tot[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i ah[A], al[A];
    for (int i = 0; i < A; ++i) {
      ah[i] = _mm256_setzero_si256();
      al[i] = _mm256_set1_epi32(xoff[(i / H) * G + g]);
    }
    for (int64_t q = g * qpg; q < (g + 1) * qpg; ++q) {
      __m256i wv[H];
      for (int h = 0; h < H; ++h) {
        const uint8_t* line = w + (h / 2) * bstride + q * 64 + 32 * (h % 2);
        if (h % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(line + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
        wv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
      }
      for (int m = 0; m < MT; ++m) {
        const __m256i hb = bcast4(hi + m * K + 4 * q), lb = bcast4(lo + m * K + 4 * q);
        for (int h = 0; h < H; ++h) {
          ah[m * H + h] = _mm256_dpbusd_avx_epi32(ah[m * H + h], wv[h], hb);
          al[m * H + h] = _mm256_dpbusd_avx_epi32(al[m * H + h], wv[h], lb);
        }
      }
    }
    for (int i = 0; i < A; ++i) {
      const __m256i s = _mm256_add_epi32(_mm256_slli_epi32(ah[i], 8), al[i]);
      tot[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), int8g_scales(gb0, G, g, i % H), tot[i]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < H; ++h) {
      const int64_t n = n0 + 8 * h;
      const __m256 t = tot[m * H + h], s = _mm256_set1_ps(sx[m]);
      _mm256_storeu_ps(y + m * N + n, bias ? _mm256_fmadd_ps(t, s, _mm256_loadu_ps(bias + n)) : _mm256_mul_ps(t, s));
    }
}

// int4, MT rows x one 16-channel block on AVX-VNNI: int4_tile's loop with vpdpbusd (unsigned
// nibbles x signed activation bytes) in place of vpmaddubsw + vpmaddwd; the same int32 group
// sums. (One row takes int4_row_vnni.)
template <int MT>
PAGODA_AVXVNNI void int4_tile_vnni(const uint8_t* w, const uint8_t* hi, const uint8_t* lo, const float* xsum,
                                   int64_t K, int64_t group, const float* sx, const uint16_t* gs,
                                   const uint16_t* gb, int64_t n0, float* y, int64_t N, const float* bias) {
  const int64_t G = K / group, opg = group / 8;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  alignas(32) float tot[2 * MT][8] = {};
  for (int64_t g = 0; g < G; ++g) {
    __m256i ah[2 * MT], al[2 * MT];
    for (int i = 0; i < 2 * MT; ++i) ah[i] = al[i] = _mm256_setzero_si256();
    for (int64_t o = g * opg; o < (g + 1) * opg; ++o) {
      _mm_prefetch(reinterpret_cast<const char*>(w + o * 64 + PAGODA_WOQ_PREFETCH), _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + o * 64 + 32));
      const __m256i wl0 = _mm256_and_si256(v0, nib), wh0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);
      const __m256i wl1 = _mm256_and_si256(v1, nib), wh1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
      for (int m = 0; m < MT; ++m) {
        const uint8_t* hr = hi + m * K + 8 * o;
        const uint8_t* lr = lo + m * K + 8 * o;
        __m256i b = bcast4(hr);
        ah[2 * m] = _mm256_dpbusd_avx_epi32(ah[2 * m], wl0, b);
        ah[2 * m + 1] = _mm256_dpbusd_avx_epi32(ah[2 * m + 1], wl1, b);
        b = bcast4(hr + 4);
        ah[2 * m] = _mm256_dpbusd_avx_epi32(ah[2 * m], wh0, b);
        ah[2 * m + 1] = _mm256_dpbusd_avx_epi32(ah[2 * m + 1], wh1, b);
        b = bcast4(lr);
        al[2 * m] = _mm256_dpbusd_avx_epi32(al[2 * m], wl0, b);
        al[2 * m + 1] = _mm256_dpbusd_avx_epi32(al[2 * m + 1], wl1, b);
        b = bcast4(lr + 4);
        al[2 * m] = _mm256_dpbusd_avx_epi32(al[2 * m], wh0, b);
        al[2 * m + 1] = _mm256_dpbusd_avx_epi32(al[2 * m + 1], wh1, b);
      }
    }
    for (int i = 0; i < 2 * MT; ++i)
      _mm256_store_ps(tot[i], fold_group(_mm256_load_ps(tot[i]), ah[i], al[i], gs, gb, g * N + n0 + 8 * (i % 2),
                                         xsum[(i / 2) * G + g]));
  }
  store_int4_tile<MT>(tot, sx, bias, y, N, n0);
}

// int4, one activation row x NB 16-channel blocks on AVX-VNNI (batch-1 decode): each octet's
// four activation broadcasts shared by the blocks, NB weight streams in flight, and per half and
// byte plane one accumulator (two dependent vpdpbusd per octet; NB = 2 gives sixteen per octet,
// enough to cover their latency). Written with its accumulators indexed by constants only (a
// one-row int4_tile_vnni had compiled into register copies and stack stores in its inner loop).
// The same int32 group sums as int4_tile_vnni, so the same bits.
template <int NB>
PAGODA_AVXVNNI void int4_row_vnni(const uint8_t* w, int64_t bstride, const uint8_t* hi, const uint8_t* lo,
                                  const float* xsum, int64_t K, int64_t group, const float* sx, const uint16_t* gs,
                                  const uint16_t* gb, int64_t n0, float* y, int64_t N, const float* bias) {
  constexpr int H = 2 * NB;  // halves of 8 channels
  const int64_t G = K / group, opg = group / 8;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  prefetch_int4_row<NB>(w, bstride, gs, gb, G, N, n0);
  __m256 tot[H];
  for (int i = 0; i < H; ++i) tot[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i ah[H], al[H];
    for (int i = 0; i < H; ++i) ah[i] = al[i] = _mm256_setzero_si256();
    for (int64_t o = g * opg; o < (g + 1) * opg; ++o) {
      const __m256i h0 = bcast4(hi + 8 * o), h1 = bcast4(hi + 8 * o + 4);
      const __m256i l0 = bcast4(lo + 8 * o), l1 = bcast4(lo + 8 * o + 4);
#pragma GCC unroll 8
      for (int i = 0; i < H; ++i) {
        const uint8_t* line = w + (i / 2) * bstride + o * 64 + 32 * (i % 2);
        if (i % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(line + kRowAhead), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
        const __m256i wl = _mm256_and_si256(v, nib), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        ah[i] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(ah[i], wl, h0), wh, h1);
        al[i] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(al[i], wl, l0), wh, l1);
      }
    }
    for (int i = 0; i < H; ++i) {
      const int64_t n = n0 + 8 * i;
      tot[i] = fold_group(tot[i], ah[i], al[i], gs, gb, g * N + n, xsum[g]);
    }
  }
  for (int b = 0; b < NB; ++b) store_int4_rows<1>(tot + 2 * b, sx, bias, y, N, n0 + 16 * b);
}

// The int8 tasks on plain AVX2 (kWide8 activations): rows in chunks of up to 3, blocks in pairs
// for one row.
static inline void int8_task(const int8_t* wp, int64_t bstride, const Act& a, int64_t M, int64_t K, int64_t N,
                             const float* cs, int64_t nb_begin, int64_t nb_end, float* op, const float* bp) {
  for (int64_t m0 = 0; m0 < M; m0 += 3) {
    const int mt = static_cast<int>(std::min<int64_t>(3, M - m0));
    const int16_t* xr = a.v16.data() + m0 * K;
    const float* sx = a.sx.data() + m0;
    float* yr = op + m0 * N;
    for (int64_t nb = nb_begin; nb < nb_end;) {
      const int8_t* wb = wp + nb * bstride;
      if (mt == 1 && nb_end - nb >= 2) {
        int8_tile<1, 2>(wb, bstride, xr, K, sx, cs, nb * 16, yr, N, bp);
        nb += 2;
        continue;
      }
      if (mt == 3) int8_tile<3, 1>(wb, bstride, xr, K, sx, cs, nb * 16, yr, N, bp);
      else if (mt == 2) int8_tile<2, 1>(wb, bstride, xr, K, sx, cs, nb * 16, yr, N, bp);
      else int8_tile<1, 1>(wb, bstride, xr, K, sx, cs, nb * 16, yr, N, bp);
      ++nb;
    }
  }
}

// The int8 tasks of woq_linear on AVX-VNNI: rows in pairs (a tile of three held 16 registers' worth
// of accumulators and operands and spilled), blocks in pairs for one row.
PAGODA_AVXVNNI void int8_task_vnni(const uint8_t* wp, int64_t bstride, const Act& a, int64_t M, int64_t K,
                                   int64_t N, const float* cs, const int32_t* wsum128, int64_t nb_begin,
                                   int64_t nb_end, float* op, const float* bp) {
  for (int64_t m0 = 0; m0 < M; m0 += 2) {
    const bool one = M - m0 == 1;
    const uint8_t* hi = a.hi.data() + m0 * K;
    const uint8_t* lo = a.lo.data() + m0 * K;
    const float* sx = a.sx.data() + m0;
    float* yr = op + m0 * N;
    for (int64_t nb = nb_begin; nb < nb_end;) {
      const uint8_t* wb = wp + nb * bstride;
      if (one && nb_end - nb >= 2) {
        int8_tile_vnni<1, 2>(wb, bstride, hi, lo, K, sx, cs, wsum128, nb * 16, yr, N, bp);
        nb += 2;
        continue;
      }
      if (one) int8_tile_vnni<1, 1>(wb, bstride, hi, lo, K, sx, cs, wsum128, nb * 16, yr, N, bp);
      else int8_tile_vnni<2, 1>(wb, bstride, hi, lo, K, sx, cs, wsum128, nb * 16, yr, N, bp);
      ++nb;
    }
  }
}

// The int8-in-groups tasks (kind 3): plain AVX2 (kWide8G activations) in row chunks of up to 3,
// or AVX-VNNI (kInt4 byte planes) in row pairs; one row takes two blocks at a time, as int8's.
template <int QPG>
static inline void int8g_task(const uint8_t* wp, int64_t bstride, const Act& a, const int32_t* xoff, bool vnni,
                              int64_t M, int64_t K, int64_t N, int64_t group, const uint16_t* gs, int64_t nb_begin,
                              int64_t nb_end, float* op, const float* bp) {
  const int64_t G = K / group, chunk = vnni ? 2 : 3;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int mt = static_cast<int>(std::min<int64_t>(chunk, M - m0));
    const int32_t* xs = xoff + m0 * G;
    const float* sx = a.sx.data() + m0;
    float* y = op + m0 * N;
    for (int64_t nb = nb_begin; nb < nb_end;) {
      const uint8_t* wb = wp + nb * bstride;
      const int nbl = mt == 1 && nb_end - nb >= 2 ? 2 : 1;
      if (vnni) {
        const uint8_t *hi = a.hi.data() + m0 * K, *lo = a.lo.data() + m0 * K;
        if (nbl == 2) int8g_tile_vnni<1, 2>(wb, bstride, hi, lo, xs, K, group, sx, gs, nb * 16, y, N, bp);
        else if (mt == 2) int8g_tile_vnni<2, 1>(wb, bstride, hi, lo, xs, K, group, sx, gs, nb * 16, y, N, bp);
        else int8g_tile_vnni<1, 1>(wb, bstride, hi, lo, xs, K, group, sx, gs, nb * 16, y, N, bp);
      } else {
        const int16_t* x16 = a.v16.data() + m0 * K;
        if (nbl == 2) int8g_tile<1, 2, QPG>(wb, bstride, x16, xs, K, group, sx, gs, nb * 16, y, N, bp);
        else if (mt == 3) int8g_tile<3, 1, QPG>(wb, bstride, x16, xs, K, group, sx, gs, nb * 16, y, N, bp);
        else if (mt == 2) int8g_tile<2, 1, QPG>(wb, bstride, x16, xs, K, group, sx, gs, nb * 16, y, N, bp);
        else int8g_tile<1, 1, QPG>(wb, bstride, x16, xs, K, group, sx, gs, nb * 16, y, N, bp);
      }
      nb += nbl;
    }
  }
}

// The one-row kernels as class templates (a function template cannot be a template argument).
template <int NB> struct RowPlain { template <class... A> static void run(A... a) { int4_row<NB>(a...); } };
template <int NB> struct RowVnni { template <class... A> static void run(A... a) { int4_row_vnni<NB>(a...); } };

// One activation row of int4 over a task's blocks, in pairs: `Row` is the path's one-row kernel.
template <template <int> class Row>
static inline void int4_single_row(const uint8_t* wp, int64_t bstride, const uint8_t* hi, const uint8_t* lo,
                                   const float* xs, int64_t K, int64_t N, int64_t group, const float* sx,
                                   const uint16_t* gs, const uint16_t* gb, int64_t nb_begin, int64_t nb_end,
                                   float* y, const float* bp) {
  int64_t nb = nb_begin;
  for (; nb + 2 <= nb_end; nb += 2) Row<2>::run(wp + nb * bstride, bstride, hi, lo, xs, K, group, sx, gs, gb, nb * 16, y, N, bp);
  if (nb < nb_end) Row<1>::run(wp + nb * bstride, bstride, hi, lo, xs, K, group, sx, gs, gb, nb * 16, y, N, bp);
}

// The int4 tasks on AVX-VNNI (byte planes): rows in pairs, each pair over the task's blocks one
// at a time; a last single row takes the one-row kernel, blocks in pairs.
static inline void int4_task_vnni(const uint8_t* wp, int64_t bstride, const Act& a, int64_t M, int64_t K, int64_t N,
                                  int64_t group, const uint16_t* gs, const uint16_t* gb, int64_t nb_begin,
                                  int64_t nb_end, float* op, const float* bp) {
  for (int64_t m0 = 0; m0 < M; m0 += 2) {
    const float* xs = a.xsum.data() + m0 * (K / group);
    const uint8_t *hi = a.hi.data() + m0 * K, *lo = a.lo.data() + m0 * K;
    const float* sx = a.sx.data() + m0;
    float* y = op + m0 * N;
    if (M - m0 == 1) {
      int4_single_row<RowVnni>(wp, bstride, hi, lo, xs, K, N, group, sx, gs, gb, nb_begin, nb_end, y, bp);
      continue;
    }
    for (int64_t nb = nb_begin; nb < nb_end; ++nb)
      int4_tile_vnni<2>(wp + nb * bstride, hi, lo, xs, K, group, sx, gs, gb, nb * 16, y, N, bp);
  }
}

// The int4 tasks on plain AVX2, several rows (kWide4 activations): rows in chunks of up to four,
// each chunk over the task's blocks one at a time.
template <template <int> class Tile>
static inline void int4_rows_wide(const uint8_t* wp, int64_t bstride, const Act& a, int64_t M, int64_t K, int64_t N,
                                  int64_t group, const uint16_t* gs, const uint16_t* gb, int64_t nb_begin,
                                  int64_t nb_end, float* op, const float* bp) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* xs = a.xsum.data() + m0 * (K / group);
    const int16_t* x16 = a.v16.data() + m0 * K;
    const float* sx = a.sx.data() + m0;
    float* y = op + m0 * N;
    const int64_t mt = std::min<int64_t>(4, M - m0);
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const uint8_t* wb = wp + nb * bstride;
      if (mt == 4) Tile<4>::run(wb, x16, xs, K, group, sx, gs, gb, nb * 16, y, N, bp);
      else if (mt == 3) Tile<3>::run(wb, x16, xs, K, group, sx, gs, gb, nb * 16, y, N, bp);
      else if (mt == 2) Tile<2>::run(wb, x16, xs, K, group, sx, gs, gb, nb * 16, y, N, bp);
      else Tile<1>::run(wb, x16, xs, K, group, sx, gs, gb, nb * 16, y, N, bp);
    }
  }
}

// The wide tiles as class templates for int4_rows_wide.
template <int MT> struct TileWide { template <class... A> static void run(A... a) { int4_tile<MT>(a...); } };
template <int MT> struct TileWideLong { template <class... A> static void run(A... a) { int4_tile_long<MT>(a...); } };

static inline void int4_task_wide(const uint8_t* wp, int64_t bstride, const Act& a, int64_t M, int64_t K, int64_t N,
                                  int64_t group, const uint16_t* gs, const uint16_t* gb, int64_t nb_begin,
                                  int64_t nb_end, float* op, const float* bp) {
  if (group > kInt4Span) int4_rows_wide<TileWideLong>(wp, bstride, a, M, K, N, group, gs, gb, nb_begin, nb_end, op, bp);
  else int4_rows_wide<TileWide>(wp, bstride, a, M, K, N, group, gs, gb, nb_begin, nb_end, op, bp);
}

}  // namespace

// The AVX-512 entry's contract; this variant has int8, int4 and int8 in groups (kind 0, 2, 3), not fp8.
static inline bool linear(float* op, const float* xp, int64_t M, int64_t K, int64_t N, const uint8_t* wp, int kind,
                          const float* cs, const uint16_t* gsp, const uint16_t* gbp, int64_t group,
                          const int32_t* auxp, const float* bp) {
  if (kind != 0 && kind != 2 && kind != 3) return false;
  const int64_t NB = N / 16;
  if (M == 0) return true;
  const bool int4 = kind == 2, int8g = kind == 3, vnni = g_vnni;
  // plain AVX2 takes 16-bit activations (kWide*), except one int4 row: int4_row's byte planes
  const Planes planes = int8g ? (vnni ? Planes::kInt4 : Planes::kWide8G)
                        : vnni ? (int4 ? Planes::kInt4 : Planes::kInt8)
                               : (int4 ? (M == 1 ? Planes::kInt4 : Planes::kWide4) : Planes::kWide8);
  const Act a = quantize_rows(xp, M, K, planes, group);
  const std::vector<int32_t> xoff = int8g ? int8g_offsets(a.xsum) : std::vector<int32_t>();
  const int64_t bstride = int4 ? K * 8 : K * 16;  // bytes per 16-channel block
  // Tasks of 64 channels; each runs its rows in chunks (its weights stay in cache between them).
  pagoda::parallel_for(0, (NB + 3) / 4, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t nb_end = std::min(NB, 4 * t + 4);
      if (int8g) {
        if (group == 32) int8g_task<8>(wp, bstride, a, xoff.data(), vnni, M, K, N, group, gsp, 4 * t, nb_end, op, bp);
        else int8g_task<0>(wp, bstride, a, xoff.data(), vnni, M, K, N, group, gsp, 4 * t, nb_end, op, bp);
      } else if (int4 && vnni) {
        int4_task_vnni(wp, bstride, a, M, K, N, group, gsp, gbp, 4 * t, nb_end, op, bp);
      } else if (int4 && M == 1) {
        int4_single_row<RowPlain>(wp, bstride, a.hi.data(), a.lo.data(), a.xsum.data(), K, N, group, a.sx.data(),
                                  gsp, gbp, 4 * t, nb_end, op, bp);
      } else if (int4) {
        int4_task_wide(wp, bstride, a, M, K, N, group, gsp, gbp, 4 * t, nb_end, op, bp);
      } else if (vnni) {
        int8_task_vnni(wp, bstride, a, M, K, N, cs, auxp, 4 * t, nb_end, op, bp);
      } else {
        int8_task(reinterpret_cast<const int8_t*>(wp), bstride, a, M, K, N, cs, 4 * t, nb_end, op, bp);
      }
    }
  });
  return true;
}

#else
// This variant lacks the instructions: no kernel for any kind.
static inline bool linear(float*, const float*, int64_t, int64_t, int64_t, const uint8_t*, int, const float*,
                          const uint16_t*, const uint16_t*, int64_t, const int32_t*, const float*) {
  return false;
}
#endif

}  // namespace pagoda::woq
