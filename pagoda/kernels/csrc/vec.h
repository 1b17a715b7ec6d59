// vec.h: the portable vector layer of pagoda's CPU kernels.
//
// Design notes
// - One type, `VecF`, holds kVecWidth float32 lanes: sixteen (one __m512) in the AVX-512 variant,
//   eight (one __m256) in the AVX2+FMA(+F16C) variant, four (float32x4_t) on ARM NEON, and one
//   plain float in the scalar variant. Kernels written against it (load, fma, reduce, exp, silu)
//   compile to the widest registers the variant's flags allow and to straight loops without them;
//   `#if defined(__AVX512F__)` blocks remain only where a kernel uses instructions the others lack
//   (VNNI, BF16 dot products, masks, AMX tiles).
// - Loads widen on the fly: bfloat16 -> float32 is exact (a 16-bit shift), float16 -> float32 uses
//   F16C's vcvtph2ps where the variant has it and c10's conversion otherwise.
// - exp follows one recipe on every width (2^k * exp(r), Cephes' polynomial on |r| <= ln2/2, about
//   one ulp), so the variants agree to float rounding, not merely to a tolerance.
// - The AVX-512 helpers `load16`, `exp16` and `silu_mul16` (sixteen lanes, by name) are the
//   older kernels' own and stay for them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

// Every vector primitive is always inlined: a kernel built with other optimisation options than
// this header (attention.h's fast-math loops inside decode.cpp, which includes vec.h first) would
// otherwise call each fma and load out of line, since GCC does not inline across such options.
#define PAGODA_VEC inline __attribute__((always_inline))

namespace pagoda::vec {

// Cephes expf coefficients and the split of ln 2 shared by every width.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// exp of one float by the same recipe as the vector versions (the scalar variant's lanes, and
// every kernel's tail elements).
PAGODA_VEC float exp1(float x) {
  if (x > 88.7f) return INFINITY;
  if (x < -103.9f) return 0.f;
  const float k = std::nearbyint(x * kLog2e);
  float r = x - k * kLn2Hi;
  r = r - k * kLn2Lo;
  float p = kP0;
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  p = p * (r * r) + (r + 1.f);
  return std::ldexp(p, static_cast<int>(k));
}

PAGODA_VEC float bf16_to_f32(const c10::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[0]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX512F__)
constexpr int kVecWidth = 16;
struct VecF {
  __m512 v;
  PAGODA_VEC static VecF zero() { return {_mm512_setzero_ps()}; }
  PAGODA_VEC static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  PAGODA_VEC static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  PAGODA_VEC static VecF load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  PAGODA_VEC static VecF load(const c10::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  PAGODA_VEC void store(float* p) const { _mm512_storeu_ps(p, v); }
  PAGODA_VEC float reduce_add() const { return _mm512_reduce_add_ps(v); }
  PAGODA_VEC float reduce_max() const { return _mm512_reduce_max_ps(v); }
};
PAGODA_VEC VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
PAGODA_VEC VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
PAGODA_VEC VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
PAGODA_VEC VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
PAGODA_VEC VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
PAGODA_VEC VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
PAGODA_VEC VecF exp(VecF x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x.v, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x.v);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return {_mm512_scalef_ps(p, k)};
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kVecWidth = 8;
struct VecF {
  __m256 v;
  PAGODA_VEC static VecF zero() { return {_mm256_setzero_ps()}; }
  PAGODA_VEC static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  PAGODA_VEC static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  PAGODA_VEC static VecF load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
#if defined(__F16C__)
  PAGODA_VEC static VecF load(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
#else
  PAGODA_VEC static VecF load(const c10::Half* p) {
    alignas(32) float t[8];
    for (int i = 0; i < 8; ++i) t[i] = static_cast<float>(p[i]);
    return {_mm256_load_ps(t)};
  }
#endif
  PAGODA_VEC void store(float* p) const { _mm256_storeu_ps(p, v); }
  PAGODA_VEC float reduce_add() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  PAGODA_VEC float reduce_max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
PAGODA_VEC VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
PAGODA_VEC VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
PAGODA_VEC VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
PAGODA_VEC VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
PAGODA_VEC VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
PAGODA_VEC VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
PAGODA_VEC VecF exp(VecF x) {
  // Clamp to the float range first (AVX2 has no scalef): 2^k is built in the exponent bits.
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x.v, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // k in [-126, 128]: 2^k as float bits; k = 128 (x near 88.7) splits into two factors.
  const __m256i ki = _mm256_cvtps_epi32(k);
  const __m256i half = _mm256_srai_epi32(ki, 1);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ki, half), _mm256_set1_epi32(127)), 23));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  // Past the range: exp's own limits (inf above, 0 below).
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x.v, _mm256_set1_ps(88.7f), _CMP_GT_OQ));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x.v, _mm256_set1_ps(-87.3f), _CMP_LT_OQ));
  return {y};
}

#elif defined(__ARM_NEON) && defined(__aarch64__)
constexpr int kVecWidth = 4;
struct VecF {
  float32x4_t v;
  PAGODA_VEC static VecF zero() { return {vdupq_n_f32(0.f)}; }
  PAGODA_VEC static VecF set1(float x) { return {vdupq_n_f32(x)}; }
  PAGODA_VEC static VecF load(const float* p) { return {vld1q_f32(p)}; }
  PAGODA_VEC static VecF load(const c10::BFloat16* p) {
    return {vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))), 16))};
  }
  PAGODA_VEC static VecF load(const c10::Half* p) {
    return {vcvt_f32_f16(vld1_f16(reinterpret_cast<const __fp16*>(p)))};
  }
  PAGODA_VEC void store(float* p) const { vst1q_f32(p, v); }
  PAGODA_VEC float reduce_add() const { return vaddvq_f32(v); }
  PAGODA_VEC float reduce_max() const { return vmaxvq_f32(v); }
};
PAGODA_VEC VecF fma(VecF a, VecF b, VecF c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
PAGODA_VEC VecF operator+(VecF a, VecF b) { return {vaddq_f32(a.v, b.v)}; }
PAGODA_VEC VecF operator-(VecF a, VecF b) { return {vsubq_f32(a.v, b.v)}; }
PAGODA_VEC VecF operator*(VecF a, VecF b) { return {vmulq_f32(a.v, b.v)}; }
PAGODA_VEC VecF operator/(VecF a, VecF b) { return {vdivq_f32(a.v, b.v)}; }
PAGODA_VEC VecF max(VecF a, VecF b) { return {vmaxq_f32(a.v, b.v)}; }
PAGODA_VEC VecF exp(VecF x) {
  float t[4];
  vst1q_f32(t, x.v);
  for (float& e : t) e = exp1(e);
  return {vld1q_f32(t)};
}

#else  // scalar: one lane
constexpr int kVecWidth = 1;
struct VecF {
  float v;
  PAGODA_VEC static VecF zero() { return {0.f}; }
  PAGODA_VEC static VecF set1(float x) { return {x}; }
  PAGODA_VEC static VecF load(const float* p) { return {*p}; }
  PAGODA_VEC static VecF load(const c10::BFloat16* p) { return {bf16_to_f32(p)}; }
  PAGODA_VEC static VecF load(const c10::Half* p) { return {static_cast<float>(*p)}; }
  PAGODA_VEC void store(float* p) const { *p = v; }
  PAGODA_VEC float reduce_add() const { return v; }
  PAGODA_VEC float reduce_max() const { return v; }
};
PAGODA_VEC VecF fma(VecF a, VecF b, VecF c) { return {std::fma(a.v, b.v, c.v)}; }
PAGODA_VEC VecF operator+(VecF a, VecF b) { return {a.v + b.v}; }
PAGODA_VEC VecF operator-(VecF a, VecF b) { return {a.v - b.v}; }
PAGODA_VEC VecF operator*(VecF a, VecF b) { return {a.v * b.v}; }
PAGODA_VEC VecF operator/(VecF a, VecF b) { return {a.v / b.v}; }
PAGODA_VEC VecF max(VecF a, VecF b) { return {a.v > b.v ? a.v : b.v}; }
PAGODA_VEC VecF exp(VecF x) { return {exp1(x.v)}; }
#endif

// silu(g) * u = g / (1 + exp(-g)) * u, on every width.
PAGODA_VEC VecF silu_mul(VecF g, VecF u) { return g / (VecF::set1(1.f) + exp(VecF::zero() - g)) * u; }
PAGODA_VEC float silu_mul1(float g, float u) { return g / (1.f + exp1(-g)) * u; }

}  // namespace pagoda::vec

#if defined(__AVX512F__)
// The sixteen-lane helpers the AVX-512 blocks of the older kernels call by name.
static PAGODA_VEC __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static PAGODA_VEC __m512 load16(const c10::BFloat16* p) { return pagoda::vec::VecF::load(p).v; }
static PAGODA_VEC __m512 exp16(__m512 x) { return pagoda::vec::exp(pagoda::vec::VecF{x}).v; }
static PAGODA_VEC __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  return _mm512_mul_ps(_mm512_div_ps(g, den), u);
}
#endif
