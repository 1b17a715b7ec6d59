"""A C++ weight-only quantized matmul for AVX-512 CPUs with bfloat16 dot products
(``avx512_bf16``), compiled once per machine like the paged-attention kernel.

Why: torch's weight-only CPU ops (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
are fast for one row but no faster than a float32 GEMM from about 8 rows on, their float32
path is 10-100x slower than their bfloat16 one, and they round outputs to bfloat16. Here every
16-output-channel block of the weight is dequantized once per call into a small bfloat16
scratch tile, in the order ``vdpbf16ps`` consumes it, and multiplied by up to 8 rows at a time:
two multiply-adds per instruction, so a batch costs about half a float32 GEMM's arithmetic on
top of reading 1/4 (int8, fp8) or 1/8 (int4) of its bytes.

Numerics: activations are rounded to bfloat16 (relative 2**-9), dequantized weights are exact
(int8, fp8) or ``scale * (q - zero)`` rounded to bfloat16 (int4); products accumulate in
float32 and the output is float32. The same instruction sequence runs for every row whatever
the batch size, so a row's result does not depend on the other rows.

Weight layouts (``pack_*`` build them from ``[N, K]`` tensors; N a multiple of 16, K even):
one byte per weight ``[N/16][K/2][16][2]`` for int8 / fp8, and for int4 16 bytes per
(block, k-pair) whose byte ``b`` holds element ``b`` (low nibble) and ``b + 16`` (high) of
that pair's 32 elements.
"""
from __future__ import annotations


import torch

from pagoda.cpu_features import cpu_flags
from pagoda.layers.cpu_build import InlineKernel


KIND_INT8, KIND_FP8, KIND_INT4 = 0, 1, 2

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

namespace {

inline __m512 fp8_to_f32(__m128i bytes) {
  __m512i v = _mm512_cvtepu8_epi32(bytes);
  __m512i mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7F)), 20);
  __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
  __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

// Dequantizes one 16-channel block, k-pair by k-pair in order: entry p is 32 bf16 in
// (channel, k parity) order, as vdpbf16ps consumes them.
struct Deq {
  int kind;
  const uint8_t* w;
  const float* gs;
  const float* gb;
  int64_t N, n0, ppg, next = 0, g = -1;
  __m512 s_lo, s_hi, b_lo, b_hi;

  inline __m512bh at(int64_t p) {
    if (kind == 2) {
      if (p == next) {  // a new group: its scales and offsets, each duplicated for the k pair
        const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i hi_idx = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
        ++g;
        next += ppg;
        __m512 s = _mm512_loadu_ps(gs + g * N + n0), b = _mm512_loadu_ps(gb + g * N + n0);
        s_lo = _mm512_permutexvar_ps(lo_idx, s);
        s_hi = _mm512_permutexvar_ps(hi_idx, s);
        b_lo = _mm512_permutexvar_ps(lo_idx, b);
        b_hi = _mm512_permutexvar_ps(hi_idx, b);
      }
      __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 16)));
      __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s_hi, b_hi), _mm512_fmadd_ps(lo, s_lo, b_lo));
    }
    const __m128i* src = reinterpret_cast<const __m128i*>(w + p * 32);
    __m128i b0 = _mm_loadu_si128(src), b1 = _mm_loadu_si128(src + 1);
    if (kind == 0)
      return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1)),
                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0)));
    return _mm512_cvtne2ps_pbh(fp8_to_f32(b1), fp8_to_f32(b0));
  }
};

// Few rows: dequantize in registers and multiply at once (no scratch round trip). NBL blocks
// side by side give independent accumulation chains (each still sums its k pairs in order,
// exactly as the scratch path does).
template <int MT, int NBL>
void fused(Deq* d, const int32_t* xb, int64_t P, __m512* out) {
  __m512 acc[MT * NBL];
#pragma GCC unroll 16
  for (int i = 0; i < MT * NBL; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
#pragma GCC unroll 4
    for (int j = 0; j < NBL; ++j) {
      const __m512bh w = d[j].at(p);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m)
        acc[m * NBL + j] = _mm512_dpbf16_ps(acc[m * NBL + j], (__m512bh)_mm512_set1_epi32(xb[m * P + p]), w);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MT * NBL; ++i) out[i] = acc[i];
}

template <int MT>
void fused_rows(Deq* d, int nbl, const int32_t* xb, int64_t P, __m512* out) {
  switch (nbl) {
    case 4: fused<MT, 4>(d, xb, P, out); break;
    case 3: fused<MT, 3>(d, xb, P, out); break;
    case 2: fused<MT, 2>(d, xb, P, out); break;
    default: fused<MT, 1>(d, xb, P, out); break;
  }
}

// Rows [m0, m0 + MT) times two scratch blocks (32 channels). Accumulators are locals so they
// stay in registers (the output array could alias the inputs).
template <int MT>
void micro(const int32_t* xb, int64_t P, const __m512bh* t0, const __m512bh* t1, __m512* out) {
  __m512 acc[2 * MT];
#pragma GCC unroll 16
  for (int i = 0; i < 2 * MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const __m512bh w0 = t0[p], w1 = t1[p];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xb[m * P + p]);
      acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], a, w0);
      acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], a, w1);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < 2 * MT; ++i) out[i] = acc[i];
}

}  // namespace

void woq_linear(torch::Tensor out, torch::Tensor x, torch::Tensor w, int64_t kind, torch::Tensor col_scale,
                torch::Tensor gs, torch::Tensor gb, int64_t group, torch::Tensor bias) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = K / 2, NB = N / 16;
  torch::Tensor xbt = x.to(torch::kBFloat16).contiguous();
  const int32_t* xb = reinterpret_cast<const int32_t*>(xbt.data_ptr());
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const int64_t block_bytes = kind == 2 ? P * 16 : P * 32;
  const float* cs = col_scale.numel() ? col_scale.data_ptr<float>() : nullptr;
  const float* gsp = gs.numel() ? gs.data_ptr<float>() : nullptr;
  const float* gbp = gb.numel() ? gb.data_ptr<float>() : nullptr;
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  auto store = [&](int64_t row, int64_t n, __m512 y) {
    if (cs) y = _mm512_mul_ps(y, _mm512_loadu_ps(cs + n));
    if (bp) y = _mm512_add_ps(y, _mm512_loadu_ps(bp + n));
    _mm512_storeu_ps(op + row * N + n, y);
  };
  auto deq = [&](int64_t nb) { return Deq{static_cast<int>(kind), wp + nb * block_bytes, gsp, gbp, N, nb * 16,
                                          group / 2}; };
  if (M <= 4) {
    const int64_t groups = (NB + 3) / 4;
    at::parallel_for(0, groups, 1, [&](int64_t g_begin, int64_t g_end) {
      __m512 acc[16];
      Deq d[4];
      for (int64_t gi = g_begin; gi < g_end; ++gi) {
        const int64_t nb0 = 4 * gi;
        const int nbl = static_cast<int>(std::min<int64_t>(4, NB - nb0));
        for (int j = 0; j < nbl; ++j) d[j] = deq(nb0 + j);
        switch (M) {
          case 4: fused_rows<4>(d, nbl, xb, P, acc); break;
          case 3: fused_rows<3>(d, nbl, xb, P, acc); break;
          case 2: fused_rows<2>(d, nbl, xb, P, acc); break;
          default: fused_rows<1>(d, nbl, xb, P, acc); break;
        }
        for (int64_t m = 0; m < M; ++m)
          for (int j = 0; j < nbl; ++j) store(m, (nb0 + j) * 16, acc[m * nbl + j]);
      }
    });
    return;
  }
  const int64_t tiles = (NB + 1) / 2;
  at::parallel_for(0, tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<__m512bh> scratch(2 * P);
    __m512 acc[16];
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t nb0 = 2 * t, nblocks = std::min<int64_t>(2, NB - nb0);
      for (int64_t j = 0; j < nblocks; ++j) {
        Deq d = deq(nb0 + j);
        __m512bh* dst = scratch.data() + j * P;
        for (int64_t p = 0; p < P; ++p) dst[p] = d.at(p);
      }
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
"""


def supported() -> bool:
    """AVX-512 with bfloat16 dot products, as the compiled kernel needs."""
    return {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_flags()


_KERNEL = InlineKernel("pagoda_cpu_woq_", _SOURCE, ["woq_linear"],
                       ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma", "-fopenmp"],
                       "CPU weight-only quantized matmul kernel", "using torch's ops", supported)


def load() -> object | None:
    """The compiled module, or None (no such CPU, no compiler, ``PAGODA_CPU_KERNELS=0``)."""
    return _KERNEL.load()


def usable(n: int, k: int, device: torch.device) -> bool:
    return device.type == "cpu" and n % 16 == 0 and k % 2 == 0 and load() is not None


def _blocked_pairs(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[N/16, K/2, 16, 2]`` (contiguous)."""
    n, k = q.shape
    return q.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_bytes(q: torch.Tensor) -> torch.Tensor:
    """int8 or float8 ``[N, K]`` as the kernel's one-byte layout."""
    return _blocked_pairs(q.view(torch.uint8) if q.dtype != torch.uint8 else q)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 ``[N, K]`` as the kernel's nibble layout."""
    elems = _blocked_pairs(q.to(torch.uint8)).reshape(q.shape[0] // 16, q.shape[1] // 2, 32)
    return (elems[..., :16] | (elems[..., 16:] << 4)).contiguous()


_EMPTY = torch.empty(0)


class WoqCPU:
    """The compiled kernel over one packed weight; ``__call__(x, bias)`` like the others."""

    kernel = "woq"

    def __init__(self, kind: int, packed: torch.Tensor, n: int, k: int, col_scale: torch.Tensor | None = None,
                 group_scale: torch.Tensor | None = None, group_bias: torch.Tensor | None = None,
                 group_size: int = 0, perm: torch.Tensor | None = None) -> None:
        self.kind, self.packed, self.n, self.k, self.group_size, self.perm = kind, packed, n, k, group_size, perm
        f32 = lambda t: _EMPTY if t is None else t.to(torch.float32).contiguous()  # noqa: E731
        self.col_scale, self.group_scale, self.group_bias = f32(col_scale), f32(group_scale), f32(group_bias)
        self.module = load()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.col_scale, self.group_scale,
                                                           self.group_bias))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x[..., self.perm]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k).to(torch.float32).contiguous()
        out = torch.empty(x2.shape[0], self.n, dtype=torch.float32)
        b = _EMPTY if bias is None else bias.to(torch.float32).contiguous()
        self.module.woq_linear(out, x2, self.packed, self.kind, self.col_scale, self.group_scale,
                               self.group_bias, self.group_size, b)
        return out.to(x.dtype).view(*lead, self.n)
