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
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= V; i += 16) m = _mm512_max_ps(load16(x + i), m);  // a NaN lane keeps m; below, min(cap, NaN) stays NaN
  best = _mm512_reduce_max_ps(m);
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

// Multi-step decoding on CPU, one call per step: the greedy token of each row i of logits [N, V]
// (as greedy_tokens), and with ``advance`` that token becomes sequence i's next input (ids[i]),
// its position, context and sequence length move one on and its slot is looked up in its block
// table row (tables [N, W] int32, block_size tokens a block); with an ``embed`` table [vocab,
// hidden], row i of ``x`` [N, hidden] (same dtype) becomes the token's embedding.
std::vector<int64_t> greedy_advance(torch::Tensor logits, torch::Tensor ids, torch::Tensor positions,
                                    torch::Tensor context_lens, torch::Tensor seq_lens, torch::Tensor slots,
                                    torch::Tensor tables, int64_t block_size, bool advance, torch::Tensor embed,
                                    torch::Tensor x) {
  const int64_t N = logits.dim() == 2 ? logits.size(0) : -1;
  std::vector<int64_t> rows(std::max<int64_t>(N, 0));
  for (int64_t i = 0; i < N; ++i) rows[i] = i;
  std::vector<int64_t> out = greedy_tokens(logits, rows);
  if (!advance) return out;
  TORCH_CHECK(ids.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong &&
              slots.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kInt &&
              seq_lens.scalar_type() == torch::kInt && tables.scalar_type() == torch::kInt && tables.dim() == 2 &&
              ids.numel() == N && positions.numel() == N && slots.numel() == N && context_lens.numel() == N &&
              seq_lens.numel() == N && tables.size(0) == N && ids.is_contiguous() && positions.is_contiguous() &&
              slots.is_contiguous() && context_lens.is_contiguous() && seq_lens.is_contiguous() &&
              tables.stride(1) == 1, "greedy_advance: unexpected decode inputs");
  int64_t* id = ids.data_ptr<int64_t>();
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  int32_t* ctx = context_lens.data_ptr<int32_t>();
  int32_t* len = seq_lens.data_ptr<int32_t>();
  const int32_t* table = tables.data_ptr<int32_t>();
  const int64_t W = tables.size(1), ld = tables.stride(0);
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK((pos[i] + 1) / block_size < W, "greedy_advance: position ", pos[i] + 1, " past the block table");
  if (embed.numel()) {
    TORCH_CHECK(embed.dim() == 2 && x.dim() == 2 && x.size(0) == N && x.size(1) == embed.size(1) &&
                x.scalar_type() == embed.scalar_type() && x.is_contiguous() && embed.is_contiguous(),
                "greedy_advance: unexpected embedding table or rows");
    const int64_t rows = embed.size(0), bytes = embed.size(1) * embed.element_size();
    const char* table_rows = static_cast<const char*>(embed.data_ptr());
    char* dst = static_cast<char*>(x.data_ptr());
    for (int64_t i = 0; i < N; ++i) {
      TORCH_CHECK(out[i] >= 0 && out[i] < rows, "greedy_advance: token ", out[i], " outside the embedding");
      std::memcpy(dst + i * bytes, table_rows + out[i] * bytes, bytes);
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    const int64_t p = pos[i] + 1;
    id[i] = out[i];
    pos[i] = p;
    ctx[i] += 1;
    len[i] += 1;
    slot[i] = (int64_t)table[i * ld + p / block_size] * block_size + p % block_size;
  }
  return out;
}
"""

_KERNEL = InlineKernel("pagoda_cpu_fused_", _SOURCE,
                       ["rms_norm", "add_rms_norm", "silu_and_mul", "rotate", "greedy_tokens", "greedy_advance"],
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


def greedy_steps(logits: torch.Tensor, inputs: "ModelInput", block_size: int, steps: int,
                 forward: Callable[..., torch.Tensor], ends: list[frozenset[int]],
                 embed: torch.Tensor | None = None, stop: Callable[[], bool] | None = None) -> list[list[int]]:
    """Multi-step greedy decoding on CPU (``serves_steps``, and ``serves_greedy`` for the
    logits): from the first step's ``logits`` [one row per sequence], each sequence's greedy
    token, fed back for up to ``steps`` more steps of ``forward`` (the logits of ``inputs``),
    which move on in place between steps, tensors and all, in one C++ call per step; given the
    ``embed`` table, that call also writes the tokens' embedding rows, and ``forward(inputs, x)``
    takes them. Stops early once every sequence ``i``'s latest token is in ``ends[i]``, or when
    ``stop()`` (asked before each further step) is true. Returns each sequence's tokens, 1 to
    ``steps + 1`` of them."""
    step = module().greedy_advance  # type: ignore[union-attr]
    meta = inputs.meta
    out: list[list[int]] = [[] for _ in ends]
    x = _NONE if embed is None else torch.empty(len(ends), embed.shape[1], dtype=embed.dtype)
    table = _NONE if embed is None else embed
    for k in range(steps + 1):
        more = k < steps
        tokens = step(logits, inputs.input_ids, inputs.positions, meta.context_lens, meta.seq_lens,
                      meta.slot_mapping, meta.block_tables, block_size, more, table if more else _NONE, x)
        for acc, t in zip(out, tokens):
            acc.append(t)
        if not more or all(t in e for t, e in zip(tokens, ends)) or (stop is not None and stop()):
            break
        meta.seq_lens_cpu = [v + 1 for v in meta.seq_lens_cpu]
        meta.context_lens_cpu = [v + 1 for v in meta.context_lens_cpu]
        meta.max_seq_len += 1
        logits = forward(inputs) if embed is None else forward(inputs, x)
    return out


def _unit_inner(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
