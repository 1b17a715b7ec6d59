// fused.h: the elementwise ops of a decoder layer (RMSNorm, residual add + RMSNorm, rotary,
// SiLU-and-mul) for float32 and bfloat16 rows, and the greedy sampler's argmax (one row, and
// a multi-step greedy round), shared by the ops (fused.cpp) and the fused decode blocks.
//
// Design notes
// - Why: at batch 1 a decode step's matrices are a few milliseconds of streaming, and the torch
//   versions of these ops cost 5-15 small tensor ops each, every one a dispatch of microseconds;
//   each op here is one call that reads its inputs once.
// - Same arithmetic as the torch references (pagoda/layers/fused_ops.py): float32 throughout, a
//   bfloat16 row widened on the way in and rounded once on the way out; the norm's sum of squares
//   is taken in another order and exp is vec.h's polynomial, so results agree to float32
//   rounding (bfloat16: but for the rare element a few float32 ulps move across a rounding
//   boundary).
// - The greedy argmax treats NaN as -inf and +inf as the largest finite float, as the sampler's
//   reference does, and returns the first index of the maximum.
#pragma once

#include "core.h"
#include "vec.h"
#if !defined(PAGODA_CORE_ONLY)
#include "pagoda.h"  // ATen, for the entry points at the end
#endif

namespace pagoda::fused {


inline void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) y[i] = x[i] * r * w[i];
}


// One value or sixteen widened to float32 (bfloat16 exactly: a shift).
static inline float widen1(float v) { return v; }
static inline float widen1(c10::BFloat16 v) { return static_cast<float>(v); }

// A bfloat16 row widened to float32 (exact), and a float32 row rounded to bfloat16 (to nearest
// even, as a dtype conversion does): the bfloat16 ops run the float32 arithmetic in between.
inline void widen_row(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#else
  using pagoda::vec::VecF;
  constexpr int64_t L = pagoda::vec::kVecWidth;
  for (; L > 1 && i + L <= n; i += L) VecF::load(src + i).store(dst + i);
#endif
  for (; i < n; ++i) dst[i] = widen1(src[i]);
}

inline void narrow_row(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // c10's rounding, sixteen at a time: add 0x7fff plus the kept part's lowest bit, keep the high
  // half; NaN becomes the quiet NaN 0x7fc0.
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), qnan = _mm512_set1_epi32(0x7fc0);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, bias)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(r));
  }
#elif defined(__AVX2__)
  // The same rounding eight at a time; the 32-bit results (at most 0xffff) are packed to 16 bits
  // (packus works within 128-bit lanes: the permute puts the eight values in order).
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), qnan = _mm256_set1_epi32(0x7fc0);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, bias)), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}


// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u over n floats.
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#else
  // vec.h's exp on the other widths (AVX2, NEON); the scalar variant keeps std::exp below.
  using pagoda::vec::VecF;
  constexpr int64_t L = pagoda::vec::kVecWidth;
  for (; L > 1 && i + L <= n; i += L) pagoda::vec::silu_mul(VecF::load(g + i), VecF::load(u + i)).store(o + i);
#endif
  for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}



// The greedy token of one row of V logits: the first index of the row's maximum once NaN counts
// as -inf and +inf as the largest finite float (the sampler's ``finite_logits`` of the float32
// values, then ``argmax``); 0 when every value is NaN or -inf. bfloat16 rows are widened exactly.

template <typename T>
inline int64_t greedy_row(const T* x, int64_t V) {
  float best = -INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  // Four independent maxima, so the pass runs at the loads' pace rather than one max's latency
  // per 16 values. A NaN lane keeps m (max takes the second operand); below, min(cap, NaN)
  // stays NaN and never equals the maximum.
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  for (; i + 64 <= V; i += 64) {
    m0 = _mm512_max_ps(load16(x + i), m0);
    m1 = _mm512_max_ps(load16(x + i + 16), m1);
    m2 = _mm512_max_ps(load16(x + i + 32), m2);
    m3 = _mm512_max_ps(load16(x + i + 48), m3);
  }
  for (; i + 16 <= V; i += 16) m0 = _mm512_max_ps(load16(x + i), m0);
  best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
#elif defined(__AVX2__)
  // The same four running maxima, eight lanes each (vec.h's loads widen bfloat16 exactly).
  using pagoda::vec::VecF;
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  for (; i + 32 <= V; i += 32) {
    m0 = _mm256_max_ps(VecF::load(x + i).v, m0);
    m1 = _mm256_max_ps(VecF::load(x + i + 8).v, m1);
    m2 = _mm256_max_ps(VecF::load(x + i + 16).v, m2);
    m3 = _mm256_max_ps(VecF::load(x + i + 24).v, m3);
  }
  for (; i + 8 <= V; i += 8) m0 = _mm256_max_ps(VecF::load(x + i).v, m0);
  best = VecF{_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3))}.reduce_max();
#endif
  for (; i < V; ++i) best = widen1(x[i]) > best ? widen1(x[i]) : best;
  best = std::min(best, FLT_MAX);
  if (best == -INFINITY) return 0;  // nothing but NaN and -inf: index 0, as argmax gives
  i = 0;
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(best), cap = _mm512_set1_ps(FLT_MAX);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_min_ps(cap, load16(x + i)), top, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(__AVX2__)
  const __m256 top = _mm256_set1_ps(best), cap = _mm256_set1_ps(FLT_MAX);
  for (; i + 8 <= V; i += 8) {
    const __m256 eq = _mm256_cmp_ps(_mm256_min_ps(cap, pagoda::vec::VecF::load(x + i).v), top, _CMP_EQ_OQ);
    const int hit = _mm256_movemask_ps(eq);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < V; ++i)
    if (std::min(widen1(x[i]), FLT_MAX) == best) return i;
  return 0;  // not reached: the maximum is in the row
}

#if !defined(PAGODA_CORE_ONLY)
inline void check(const at::Tensor& t) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.dim() == 2 &&
                  t.stride(1) == 1, "float32 or bfloat16 rows expected");
}

inline bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

// x [T, H] (unit inner stride) -> rms_norm(x) * w, contiguous.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
// (rms_norm(x + residual) * w, x + residual), both contiguous.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor res, at::Tensor w, double eps);
// silu(x[:, :I]) * x[:, I:] for x [T, 2I].
at::Tensor silu_and_mul(at::Tensor x);
// Rotate-half rotary embedding of one [T, heads, D] tensor into a new contiguous tensor.
at::Tensor rotate(at::Tensor x, at::Tensor pos, at::Tensor cache);
// The greedy token of each listed row of logits [N, V] (float32 or bfloat16, unit inner stride).
std::vector<int64_t> greedy_tokens(at::Tensor logits, std::vector<int64_t> rows);

// Multi-step greedy decoding on CPU: one round's host-side work between its forward passes,
// built once per round around the step's input tensors (checked here, once), so that a step is
// one call of two arguments. step(logits, advance) records each sequence i's greedy token (logits
// row i, as greedy_tokens); with ``advance`` that token becomes sequence i's next input (ids[i]),
// its position, context and sequence length move one on and its slot is looked up in its block
// table row (tables [N, W] int32, block_size tokens a block); with an ``embed`` table [vocab,
// hidden], row i of ``x`` [N, hidden] (made here, same dtype) becomes the token's embedding
// (embed_inputs).
// Returns whether every sequence's token is one of its ending tokens (``ends[i]``). ``tokens()``:
// each sequence's tokens so far, at most ``steps`` of them.
struct GreedyRound {
  at::Tensor ids_t, positions_t, context_lens_t, seq_lens_t, slots_t, tables_t, embed_t, x;
  std::vector<std::vector<int64_t>> ends, out;
  int64_t N, block_size, W, ld, steps;

  GreedyRound(at::Tensor ids, at::Tensor positions, at::Tensor context_lens, at::Tensor seq_lens,
              at::Tensor slots, at::Tensor tables, int64_t block_size_, at::Tensor embed,
              std::vector<std::vector<int64_t>> ends_, int64_t steps_)
      : ids_t(ids), positions_t(positions), context_lens_t(context_lens), seq_lens_t(seq_lens), slots_t(slots),
        tables_t(tables), embed_t(embed), ends(std::move(ends_)), N(ids.numel()), block_size(block_size_),
        steps(steps_) {
    TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                slots.scalar_type() == at::kLong && context_lens.scalar_type() == at::kInt &&
                seq_lens.scalar_type() == at::kInt && tables.scalar_type() == at::kInt && tables.dim() == 2 &&
                positions.numel() == N && slots.numel() == N && context_lens.numel() == N &&
                seq_lens.numel() == N && tables.size(0) == N && ids.is_contiguous() && positions.is_contiguous() &&
                slots.is_contiguous() && context_lens.is_contiguous() && seq_lens.is_contiguous() &&
                tables.stride(1) == 1 && block_size > 0 && N > 0 && (int64_t)ends.size() == N && steps > 0,
                "GreedyRound: unexpected decode inputs");
    if (embed.numel()) {
      TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "GreedyRound: unexpected embedding table");
      x = at::empty({N, embed.size(1)}, embed.options());
    } else {
      x = at::empty({0});
    }
    W = tables.size(1);
    ld = tables.stride(0);
    out.resize(N);
    for (auto& o : out) o.reserve(steps);
  }

  bool step(at::Tensor logits, bool advance) {
    TORCH_CHECK((logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                logits.dim() == 2 && logits.stride(1) == 1 && logits.size(0) == N, "GreedyRound: unexpected logits");
    TORCH_CHECK((int64_t)out[0].size() < steps, "GreedyRound: more steps than the round has");
    const int64_t V = logits.size(1), lld = logits.stride(0);
    const bool bf16 = logits.scalar_type() == at::kBFloat16;
    bool ended = true;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = bf16 ? greedy_row(logits.data_ptr<at::BFloat16>() + i * lld, V)
                             : greedy_row(logits.data_ptr<float>() + i * lld, V);
      out[i].push_back(t);
      ended = ended && std::find(ends[i].begin(), ends[i].end(), t) != ends[i].end();
    }
    if (!advance) return ended;
    int64_t* id = ids_t.data_ptr<int64_t>();
    int64_t* pos = positions_t.data_ptr<int64_t>();
    int64_t* slot = slots_t.data_ptr<int64_t>();
    int32_t* ctx = context_lens_t.data_ptr<int32_t>();
    int32_t* len = seq_lens_t.data_ptr<int32_t>();
    const int32_t* table = tables_t.data_ptr<int32_t>();
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK((pos[i] + 1) / block_size < W, "GreedyRound: position ", pos[i] + 1, " past the block table");
    for (int64_t i = 0; i < N; ++i) {
      const int64_t p = pos[i] + 1;
      id[i] = out[i].back();
      pos[i] = p;
      ctx[i] += 1;
      len[i] += 1;
      slot[i] = (int64_t)table[i * ld + p / block_size] * block_size + p % block_size;
    }
    if (embed_t.numel()) embed_inputs();
    return ended;
  }

  // x's rows: the embedding rows of the sequences' current input tokens (the round's first step
  // takes them too: torch.embedding was ~80 us of cold dispatch there).
  at::Tensor embed_inputs() {
    TORCH_CHECK(embed_t.numel(), "GreedyRound: no embedding table");
    const int64_t rows = embed_t.size(0), bytes = embed_t.size(1) * embed_t.element_size();
    const char* table_rows = static_cast<const char*>(embed_t.data_ptr());
    char* dst = static_cast<char*>(x.data_ptr());
    const int64_t* id = ids_t.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < rows, "GreedyRound: token ", id[i], " outside the embedding");
      std::memcpy(dst + i * bytes, table_rows + id[i] * bytes, bytes);
    }
    return x;
  }

  std::vector<std::vector<int64_t>> tokens() const { return out; }
};
#endif

}  // namespace pagoda::fused
