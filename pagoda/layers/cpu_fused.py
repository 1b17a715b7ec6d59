"""C++ versions of the elementwise ops of a decoder layer for float32 and bfloat16 on CPU
(RMSNorm, residual add + RMSNorm, rotary embedding, SiLU-and-mul) and of the greedy sampler's
argmax, compiled on first use.

Why: at batch 1 a decode step's matrices are a few milliseconds of streaming, and the torch
versions of these ops cost 5-15 small tensor ops each (upcasts, a reduction, chunk, cat...),
every one a dispatch of a few microseconds: tens of microseconds per layer, a share of the
step that grows as the matmuls get faster (quantized weights). In a bfloat16 prefill the torch
versions' upcasts and downcasts were a third of the time (a 512-token prompt on the 2-core AMD
EPYC: 147-170 ms before, 109-117 ms after). Each op here is one call that reads its inputs once.
Same arithmetic as the torch references in ``fused_ops``: float32 throughout, a bfloat16 row
widened on the way in and rounded once on the way out (the residual sum rounded before the norm
reads it, as the reference's bfloat16 add does); the norm's sum of squares is taken in another
order and ``exp`` is a vectorised polynomial, so results agree to float32 rounding (bfloat16:
but for the rare element that a few float32 ulps move across a rounding boundary).

Used for float32 or bfloat16 CPU tensors when the module builds (``fused_ops`` dispatches);
elsewhere, or with ``PAGODA_CPU_KERNELS=0``, the torch versions run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pagoda.layers.cpu_build import VECTOR_HELPERS, InlineKernel

if TYPE_CHECKING:
    from pagoda.executor.input import ModelInput

_SOURCE = r"""
#include <torch/extension.h>
#include <cstring>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <vector>
#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
""" + VECTOR_HELPERS + r"""
namespace {

inline void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) y[i] = x[i] * r * w[i];
}

void check(const torch::Tensor& t) {
  TORCH_CHECK((t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16) && t.dim() == 2 &&
                  t.stride(1) == 1, "float32 or bfloat16 rows expected");
}

// One value or sixteen widened to float32 (bfloat16 exactly: a shift).
static inline float widen1(float v) { return v; }
static inline float widen1(at::BFloat16 v) { return static_cast<float>(v); }

// A bfloat16 row widened to float32 (exact), and a float32 row rounded to bfloat16 (to nearest
// even, as a dtype conversion does): the bfloat16 ops run the float32 arithmetic in between.
inline void widen_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
  for (; i < n; ++i) dst[i] = widen1(src[i]);
}

inline void narrow_row(const float* src, at::BFloat16* dst, int64_t n) {
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
#endif
  for (; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}


// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u over n floats.
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
  for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }

}  // namespace

// x [T, H] (unit inner stride) -> rms_norm(x) * w, contiguous.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check(x);
  const int64_t T = x.size(0), H = x.size(1), sx = x.stride(0);
  torch::Tensor y = torch::empty({T, H}, x.options());
  if (is_bf16(x)) {  // bfloat16 rows: float32 arithmetic, the output rounded once
    const torch::Tensor wf = w.to(torch::kFloat).contiguous();
    const float* wp = wf.data_ptr<float>();
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      std::vector<float> buf(2 * H);
      for (int64_t t = b; t < e; ++t) {
        widen_row(xp + t * sx, buf.data(), H);
        norm_row(buf.data(), wp, buf.data() + H, H, static_cast<float>(eps));
        narrow_row(buf.data() + H, yp + t * H, H);
      }
    });
    return y;
  }
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row(xp + t * sx, wp, yp + t * H, H, static_cast<float>(eps));
  });
  return y;
}

// (rms_norm(x + residual) * w, x + residual), both contiguous.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor res, torch::Tensor w, double eps) {
  check(x);
  check(res);
  const int64_t T = x.size(0), H = x.size(1), sx = x.stride(0), sr = res.stride(0);
  torch::Tensor y = torch::empty({T, H}, x.options()), nr = torch::empty({T, H}, x.options());
  if (is_bf16(x)) {  // bfloat16: the sum is rounded (it is the new residual), then normed from that
    TORCH_CHECK(is_bf16(res), "bfloat16 rows and residual expected");
    const torch::Tensor wf = w.to(torch::kFloat).contiguous();
    const float* wp = wf.data_ptr<float>();
    const at::BFloat16 *xp = x.data_ptr<at::BFloat16>(), *rp = res.data_ptr<at::BFloat16>();
    at::BFloat16 *yp = y.data_ptr<at::BFloat16>(), *np = nr.data_ptr<at::BFloat16>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      std::vector<float> buf(3 * H);
      float *s = buf.data(), *r = s + H, *o = r + H;
      for (int64_t t = b; t < e; ++t) {
        widen_row(xp + t * sx, s, H);
        widen_row(rp + t * sr, r, H);
        for (int64_t i = 0; i < H; ++i) s[i] += r[i];
        narrow_row(s, np + t * H, H);
        widen_row(np + t * H, s, H);
        norm_row(s, wp, o, H, static_cast<float>(eps));
        narrow_row(o, yp + t * H, H);
      }
    });
    return {y, nr};
  }
  const float *xp = x.data_ptr<float>(), *rp = res.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *np = nr.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* s = np + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) s[i] = xp[t * sx + i] + rp[t * sr + i];
      norm_row(s, wp, yp + t * H, H, static_cast<float>(eps));
    }
  });
  return {y, nr};
}

// silu(x[:, :I]) * x[:, I:] for x [T, 2I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  check(x);
  const int64_t T = x.size(0), I = x.size(1) / 2, sx = x.stride(0);
  torch::Tensor y = torch::empty({T, I}, x.options());
  if (is_bf16(x)) {
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      std::vector<float> buf(3 * I);
      float *g = buf.data(), *u = g + I, *o = u + I;
      for (int64_t t = b; t < e; ++t) {
        widen_row(xp + t * sx, g, 2 * I);
        silu_mul_row(g, u, o, I);
        narrow_row(o, yp + t * I, I);
      }
    });
    return y;
  }
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = xp + t * sx;
      silu_mul_row(g, g + I, yp + t * I, I);
    }
  });
  return y;
}

// Rotate-half rotary embedding of one [T, heads, D] tensor (unit inner stride) into a new
// contiguous tensor; cache [max_pos, rot] = [cos(rot/2) | sin(rot/2)]; dims >= rot pass through.
torch::Tensor rotate(torch::Tensor x, torch::Tensor pos, torch::Tensor cache) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) && x.dim() == 3 &&
              x.stride(2) == 1);
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), s0 = x.stride(0), s1 = x.stride(1);
  const int64_t rot = cache.size(1), half = rot / 2;
  torch::Tensor y = torch::empty({T, NH, D}, x.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cache.size(0), "position ", pp[t], " outside the rotary table");
  if (is_bf16(x)) {  // bfloat16 rows (and cos|sin table, widened row by row): float32 arithmetic
    const at::BFloat16* cache16 = is_bf16(cache) ? cache.data_ptr<at::BFloat16>() : nullptr;
    const float* cache32 = cache16 ? nullptr : cache.data_ptr<float>();
    const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      std::vector<float> buf(rot + 2 * D);
      float *cs = buf.data(), *a = cs + rot, *o = a + D;
      for (int64_t t = b; t < e; ++t) {
        const float* c = cs;
        if (cache16) widen_row(cache16 + pp[t] * rot, cs, rot);
        else c = cache32 + pp[t] * rot;
        const float* s = c + half;
        for (int64_t h = 0; h < NH; ++h) {
          widen_row(xp + t * s0 + h * s1, a, D);
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            o[i] = a[i] * c[i] - a[i + half] * s[i];
            o[i + half] = a[i + half] * c[i] + a[i] * s[i];
          }
          for (int64_t i = rot; i < D; ++i) o[i] = a[i];
          narrow_row(o, yp + (t * NH + h) * D, D);
        }
      }
    });
    return y;
  }
  const float *xp = x.data_ptr<float>(), *cp = cache.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *c = cp + pp[t] * rot, *s = c + half;
      for (int64_t h = 0; h < NH; ++h) {
        const float* a = xp + t * s0 + h * s1;
        float* o = yp + (t * NH + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = a[i] * c[i] - a[i + half] * s[i];
          o[i + half] = a[i + half] * c[i] + a[i] * s[i];
        }
        for (int64_t i = rot; i < D; ++i) o[i] = a[i];
      }
    }
  });
  return y;
}
// The greedy token of one row of V logits: the first index of the row's maximum once NaN counts
// as -inf and +inf as the largest finite float (the sampler's ``finite_logits`` of the float32
// values, then ``argmax``); 0 when every value is NaN or -inf. bfloat16 rows are widened exactly.

template <typename T>
int64_t greedy_row(const T* x, int64_t V) {
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
#endif
  for (; i < V; ++i)
    if (std::min(widen1(x[i]), FLT_MAX) == best) return i;
  return 0;  // not reached: the maximum is in the row
}

// The greedy token of each listed row of logits [N, V] (float32 or bfloat16, unit inner stride).
std::vector<int64_t> greedy_tokens(torch::Tensor logits, std::vector<int64_t> rows) {
  TORCH_CHECK((logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16) &&
              logits.dim() == 2 && logits.stride(1) == 1, "float32 or bfloat16 rows expected");
  const int64_t N = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  std::vector<int64_t> out(rows.size(), 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    TORCH_CHECK(rows[r] >= 0 && rows[r] < N, "row ", rows[r], " outside the logits");
    out[r] = bf16 ? greedy_row(logits.data_ptr<at::BFloat16>() + rows[r] * ld, V)
                  : greedy_row(logits.data_ptr<float>() + rows[r] * ld, V);
  }
  return out;
}

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
  torch::Tensor ids_t, positions_t, context_lens_t, seq_lens_t, slots_t, tables_t, embed_t, x;
  std::vector<std::vector<int64_t>> ends, out;
  int64_t N, block_size, W, ld, steps;

  GreedyRound(torch::Tensor ids, torch::Tensor positions, torch::Tensor context_lens, torch::Tensor seq_lens,
              torch::Tensor slots, torch::Tensor tables, int64_t block_size_, torch::Tensor embed,
              std::vector<std::vector<int64_t>> ends_, int64_t steps_)
      : ids_t(ids), positions_t(positions), context_lens_t(context_lens), seq_lens_t(seq_lens), slots_t(slots),
        tables_t(tables), embed_t(embed), ends(std::move(ends_)), N(ids.numel()), block_size(block_size_),
        steps(steps_) {
    TORCH_CHECK(ids.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong &&
                slots.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kInt &&
                seq_lens.scalar_type() == torch::kInt && tables.scalar_type() == torch::kInt && tables.dim() == 2 &&
                positions.numel() == N && slots.numel() == N && context_lens.numel() == N &&
                seq_lens.numel() == N && tables.size(0) == N && ids.is_contiguous() && positions.is_contiguous() &&
                slots.is_contiguous() && context_lens.is_contiguous() && seq_lens.is_contiguous() &&
                tables.stride(1) == 1 && block_size > 0 && N > 0 && (int64_t)ends.size() == N && steps > 0,
                "GreedyRound: unexpected decode inputs");
    if (embed.numel()) {
      TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "GreedyRound: unexpected embedding table");
      x = torch::empty({N, embed.size(1)}, embed.options());
    } else {
      x = torch::empty({0});
    }
    W = tables.size(1);
    ld = tables.stride(0);
    out.resize(N);
    for (auto& o : out) o.reserve(steps);
  }

  bool step(torch::Tensor logits, bool advance) {
    TORCH_CHECK((logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16) &&
                logits.dim() == 2 && logits.stride(1) == 1 && logits.size(0) == N, "GreedyRound: unexpected logits");
    TORCH_CHECK((int64_t)out[0].size() < steps, "GreedyRound: more steps than the round has");
    const int64_t V = logits.size(1), lld = logits.stride(0);
    const bool bf16 = logits.scalar_type() == torch::kBFloat16;
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
  torch::Tensor embed_inputs() {
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

"""

# Its own bindings (to bind a class), apart from the source that ``cpu_decode`` pastes in.
_BINDINGS = r"""
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotate", &rotate);
  m.def("greedy_tokens", &greedy_tokens);
  pybind11::class_<GreedyRound>(m, "GreedyRound")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          int64_t, torch::Tensor, std::vector<std::vector<int64_t>>, int64_t>())
      .def("step", &GreedyRound::step)
      .def("tokens", &GreedyRound::tokens)
      .def("embed_inputs", &GreedyRound::embed_inputs)
      .def_readonly("x", &GreedyRound::x);
}
"""

_KERNEL = InlineKernel("pagoda_cpu_fused_", _SOURCE + _BINDINGS, None,  # the source binds its functions and class
                       ["-O3", "-march=native", "-fopenmp"], "CPU fused elementwise ops",
                       "using the torch versions")


def module() -> object | None:
    """The compiled module, or None when it cannot be built here."""
    return _KERNEL.load()


_DTYPES = (torch.float32, torch.bfloat16)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the C++ ops serve these tensors: all float32 or all bfloat16, on CPU, and the
    module built (bfloat16 rows are widened, computed in float32 and rounded once, as the torch
    references do)."""
    dtype = tensors[0].dtype
    return (dtype in _DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and module() is not None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return module().rms_norm(_rows(x), weight.contiguous(), eps).view(x.shape)  # type: ignore[union-attr]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, new_residual = module().add_rms_norm(_rows(x), _rows(residual), weight.contiguous(), eps)  # type: ignore[union-attr]
    return y.view(x.shape), new_residual.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return module().silu_and_mul(_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)  # type: ignore[union-attr]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = module()
    pos = positions.to(torch.int64).contiguous()
    cache = cos_sin_cache.contiguous()
    return m.rotate(_unit_inner(q), pos, cache), m.rotate(_unit_inner(k), pos, cache)  # type: ignore[union-attr]


def serves_greedy(logits: torch.Tensor) -> bool:
    """Whether ``greedy_tokens`` takes these logits: float32 or bfloat16 on CPU, the module built
    (checked in the order of their cost: this runs once a step, with every cache cold)."""
    dtype = logits.dtype
    return ((dtype is torch.float32 or dtype is torch.bfloat16) and logits.is_cpu
            and (_KERNEL.module is not None or module() is not None))


def greedy_tokens(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """The greedy token of each of ``logits``' listed ``rows`` (float32 or bfloat16), as
    ``finite_logits(logits[rows].float()).argmax(-1).tolist()`` gives it, in one pass over each
    row without copying it."""
    flat = logits if logits.dim() == 2 and logits.stride(1) == 1 else _rows(logits)  # no reshape op per step
    return module().greedy_tokens(flat, rows)  # type: ignore[union-attr]


def serves_steps(inputs: "ModelInput") -> bool:
    """Whether ``greedy_steps`` can run a multi-step round of these inputs: one-token decodes on
    the host whose every hidden row gets logits, no LoRA, the module built (the logits' dtype is
    checked with ``serves_greedy`` once the first step has them)."""
    return (inputs.lora_slots is None and inputs.logits_all_rows and inputs.meta.max_query_len == 1
            and inputs.input_ids.is_cpu and (_KERNEL.module is not None or module() is not None))


_NONE = torch.empty(0)


def greedy_round(inputs: "ModelInput", block_size: int, steps: int, ends: list[frozenset[int]],
                 embed: torch.Tensor | None = None) -> object:
    """The host-side state of a multi-step greedy round over ``inputs`` (``serves_steps``) of at
    most ``steps + 1`` tokens per sequence: ``GreedyRound`` above. Given the ``embed`` table, its
    ``embed_inputs()`` is the embedding rows of the inputs' tokens (for the round's first step)."""
    meta = inputs.meta
    return module().GreedyRound(  # type: ignore[union-attr]
        inputs.input_ids, inputs.positions, meta.context_lens, meta.seq_lens, meta.slot_mapping, meta.block_tables,
        block_size, _NONE if embed is None else embed, [list(e) for e in ends], steps + 1)


def greedy_steps(rnd: object, logits: torch.Tensor, inputs: "ModelInput", steps: int,
                 forward: Callable[..., torch.Tensor], stop: Callable[[], bool] | None = None,
                 host_meta: bool = True) -> list[list[int]]:
    """Multi-step greedy decoding on CPU: from the first step's ``logits`` (``serves_greedy``;
    one row per sequence), each sequence's greedy token, fed back for up to ``steps`` more steps
    of ``forward`` (the logits of ``inputs``), which move on in place between steps, tensors and
    all, in one C++ call per step (``rnd``, the round's ``greedy_round``, which also records the
    tokens and checks them against the ending tokens); with an embedding table in ``rnd``, that
    call also writes the tokens' embedding rows, and ``forward(inputs, x)`` takes them. Stops
    early once every sequence's latest token is one of its ending tokens, or when ``stop()``
    (asked before each further step) is true. ``host_meta``: whether ``forward`` reads the
    host-side lengths (``seq_lens_cpu``, ``context_lens_cpu``, ``max_seq_len``), which are then
    moved on before every step; otherwise (the fused decode stack reads only the tensors) once,
    at the end, by as much as those steps would have. Returns each sequence's tokens, 1 to
    ``steps + 1`` of them.

    Why a C++ round: after a step has streamed the weights, the host's own work runs with every
    cache cold, and the per-step Python (lists, set lookups, a dozen argument conversions) took
    as long as the argmax itself (~35 us of a 1.2 ms int4 step; now ~20 us in all)."""
    meta = inputs.meta
    advance = rnd.step  # type: ignore[attr-defined]
    x = rnd.x if rnd.x.numel() else None  # type: ignore[attr-defined]
    k = 0
    while True:
        more = k < steps
        if advance(logits, more) or not more or (stop is not None and stop()):
            break
        k += 1
        if host_meta:
            _move_host_meta(meta, 1)
        logits = forward(inputs) if x is None else forward(inputs, x)
    if not host_meta and k:
        _move_host_meta(meta, k)
    return rnd.tokens()  # type: ignore[attr-defined]


def _move_host_meta(meta, by: int) -> None:
    meta.seq_lens_cpu = [v + by for v in meta.seq_lens_cpu]
    meta.context_lens_cpu = [v + by for v in meta.context_lens_cpu]
    meta.max_seq_len += by


def _unit_inner(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
