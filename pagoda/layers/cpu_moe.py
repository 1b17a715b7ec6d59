"""A C++ grouped-expert kernel for the mixture-of-experts layer on CPU, compiled on first use.

One call does the whole expert computation of a step: group the ``T * k`` (token, slot) pairs
by expert (a counting sort), gather each pair's activation row, then per active expert
``act = silu(x W_gate^T) * (x W_up^T)`` and ``y = act W_down^T`` on that expert's contiguous
rows, and finally each token's weighted sum over its slots (in slot order). Work items are
(expert, chunk of output features) pairs handed out dynamically to the OpenMP threads inside one
parallel region, so the layer pays one fork/join per phase instead of a library call, an OpenMP
barrier and a Python round trip per expert, and an expert with no rows costs nothing.

The inner product is register-blocked: up to 14 activation rows (all of an expert's rows at
decode sizes, so its weights are read once) by 32 output features, the weights packed at start-up
into panels of 32 output features stored k-major (``pack_experts``), float32 or bfloat16 widened
in registers, float32 sums. Every cache line of a panel is prefetched a fixed distance ahead, so
the weight stream keeps flowing while the multiply-adds of many rows run. A token's result does
not depend on which other tokens share the batch (the same blocking for every row).

Where the compiler is missing or ``PAGODA_CPU_KERNELS=0`` the module reports itself unavailable
and ``FusedMoE`` keeps its per-expert oneDNN path.
"""
from __future__ import annotations

import torch

from pagoda.layers.cpu_build import InlineKernel

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <utility>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_AVX512 1
#include <immintrin.h>
#endif

#if defined(PAGODA_AVX512)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

constexpr int NP = 32;  // output features per packed panel (two vectors)
constexpr int PF = 32;  // software prefetch distance in k steps

// One panel: out[r * ldo + c] = sum_k x[r * K + k] * p[k * NP + c] for r < MT, c < ncols (<= NP).
// The panel is the weight's columns c0 .. c0 + NP - 1 stored k-major, so it is read as one
// sequential stream while each activation element is broadcast against two vectors of it.
template <typename W, int MT>
static inline void ptile(const float* x, const W* p, int64_t K, float* out, int64_t ldo, int ncols) {
#if defined(PAGODA_AVX512)
  __m512 a0[MT], a1[MT];
  for (int r = 0; r < MT; ++r) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const W* pk = p + k * NP;
    _mm_prefetch(reinterpret_cast<const char*>(pk + PF * NP), _MM_HINT_T0);
    if (sizeof(W) == 4) _mm_prefetch(reinterpret_cast<const char*>(pk + PF * NP + 16), _MM_HINT_T0);  // fp32: two lines per k
    const __m512 w0 = load16(pk), w1 = load16(pk + 16);
    for (int r = 0; r < MT; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      a0[r] = _mm512_fmadd_ps(w0, xb, a0[r]);
      a1[r] = _mm512_fmadd_ps(w1, xb, a1[r]);
    }
  }
  const __mmask16 m0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1u);
  const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1u);
  for (int r = 0; r < MT; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, m0, a0[r]);
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, a1[r]);
  }
#else
  for (int r = 0; r < MT; ++r) {
    float acc[NP] = {0.f};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * K + k];
      for (int c = 0; c < NP; ++c) acc[c] += xv * static_cast<float>(p[k * NP + c]);
    }
    for (int c = 0; c < ncols; ++c) out[r * ldo + c] = acc[c];
  }
#endif
}

// y[r * ldy + c] for r < M, c < ncols: x [M, K] times one panel, up to MT_MAX rows at a time
// (2 * MT_MAX accumulators, two weight vectors and a broadcast fill the 32 vector registers), so
// an expert's rows at decode sizes share one pass over the panel.
constexpr int MT_MAX = 14;
template <typename W, int... R>
static void tile_rows(int mt, const float* x, const W* p, int64_t K, float* y, int64_t ldy, int ncols,
                      std::integer_sequence<int, R...>) {
  using Tile = void (*)(const float*, const W*, int64_t, float*, int64_t, int);
  static constexpr Tile tiles[] = {&ptile<W, R + 1>...};  // tiles[i]: i + 1 rows
  tiles[mt - 1](x, p, K, y, ldy, ncols);
}
template <typename W>
static void panel(const float* x, int64_t M, const W* p, int64_t K, float* y, int64_t ldy, int ncols) {
  for (int64_t r = 0; r < M; r += MT_MAX)
    tile_rows<W>(static_cast<int>(std::min<int64_t>(MT_MAX, M - r)), x + r * K, p, K, y + r * ldy, ldy, ncols,
                 std::make_integer_sequence<int, MT_MAX>{});
}

// w13: [E, 2, I / NP, H, NP] (gate then up panels), w2: [E, H / NP, I, NP], both zero-padded to
// whole panels. Work items are (expert, panel) pairs of the experts that received rows.
template <typename W>
static void experts(const float* xs, const W* w13, const W* w2, const std::vector<int64_t>& offsets,
                    int64_t E, int64_t H, int64_t I, float* act, float* y) {
  const int64_t pi = (I + NP - 1) / NP, ph = (H + NP - 1) / NP;
  std::vector<std::pair<int64_t, int64_t>> items1, items2;
  int64_t max_rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m = offsets[e + 1] - offsets[e];
    if (m == 0) continue;
    max_rows = std::max(max_rows, m);
    for (int64_t c = 0; c < pi; ++c) items1.emplace_back(e, c);
    for (int64_t c = 0; c < ph; ++c) items2.emplace_back(e, c);
  }
  const int64_t n1 = (int64_t)items1.size(), n2 = (int64_t)items2.size();
  #pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> h(max_rows * 2 * NP);  // this thread's gate and up columns of one panel
    #pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n1; ++it) {
      const int64_t e = items1[it].first, c = items1[it].second;
      const int64_t p0 = offsets[e], m = offsets[e + 1] - p0;
      const int ncols = (int)std::min<int64_t>(NP, I - c * NP);
      const W* gate = w13 + ((e * 2 + 0) * pi + c) * H * NP;
      const W* up = w13 + ((e * 2 + 1) * pi + c) * H * NP;
      panel(xs + p0 * H, m, gate, H, h.data(), 2 * NP, ncols);
      panel(xs + p0 * H, m, up, H, h.data() + NP, 2 * NP, ncols);
      for (int64_t r = 0; r < m; ++r) {
        const float* hr = h.data() + r * 2 * NP;
        float* ar = act + (p0 + r) * I + c * NP;
        for (int j = 0; j < ncols; ++j) ar[j] = hr[j] / (1.f + std::exp(-hr[j])) * hr[NP + j];
      }
    }
    #pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n2; ++it) {
      const int64_t e = items2[it].first, c = items2[it].second;
      const int64_t p0 = offsets[e], m = offsets[e + 1] - p0;
      const int ncols = (int)std::min<int64_t>(NP, H - c * NP);
      panel(act + p0 * I, m, w2 + (e * ph + c) * I * NP, I, y + p0 * H + c * NP, H, ncols);
    }
  }
}

// x [T, H] float32; weights [T, k] float32; ids [T, k] int64 (global expert ids, this rank holding
// first .. first + E - 1); w13, w2 float32 or bfloat16 in the panel layout of ``experts`` above.
// Returns [T, H] float32: each token's routing-weighted sum of its experts' outputs (pairs routed
// to another rank's experts contribute nothing).
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor w13,
                          torch::Tensor w2, int64_t first, int64_t I) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2);
  TORCH_CHECK(weights.scalar_type() == torch::kFloat && weights.is_contiguous());
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.is_contiguous());
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && w13.scalar_type() == w2.scalar_type());
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = w13.size(0);
  const int64_t pi = (I + NP - 1) / NP, ph = (H + NP - 1) / NP;
  TORCH_CHECK(w13.dim() == 5 && w13.size(1) == 2 && w13.size(2) == pi && w13.size(3) == H && w13.size(4) == NP);
  TORCH_CHECK(w2.dim() == 4 && w2.size(0) == E && w2.size(1) == ph && w2.size(2) == I && w2.size(3) == NP);
  const int64_t* idp = ids.data_ptr<int64_t>();
  // Counting sort of the pairs by local expert; pos[p] = row of pair p in expert order, -1 if remote.
  std::vector<int64_t> offsets(E + 1, 0), pos(T * k, -1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = idp[p] - first;
    if (e >= 0 && e < E) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = idp[p] - first;
    if (e >= 0 && e < E) pos[p] = fill[e]++;
  }
  const int64_t P = offsets[E];
  auto f32 = x.options();
  torch::Tensor out = torch::zeros({T, H}, f32);
  if (P == 0) return out;
  torch::Tensor xs = torch::empty({P, H}, f32);
  torch::Tensor act = torch::empty({P, I}, f32), y = torch::empty({P, H}, f32);
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t p = 0; p < T * k; ++p)
    if (pos[p] >= 0) std::memcpy(xsp + pos[p] * H, xp + (p / k) * H, H * sizeof(float));
  if (w13.scalar_type() == torch::kBFloat16) {
    experts(xsp, w13.data_ptr<at::BFloat16>(), w2.data_ptr<at::BFloat16>(), offsets, E, H, I,
            act.data_ptr<float>(), y.data_ptr<float>());
  } else {
    TORCH_CHECK(w13.scalar_type() == torch::kFloat);
    experts(xsp, w13.data_ptr<float>(), w2.data_ptr<float>(), offsets, E, H, I,
            act.data_ptr<float>(), y.data_ptr<float>());
  }
  // Each token's slots in order, weighted.
  const float* wp = weights.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t s = 0; s < k; ++s) {
        const int64_t q = pos[t * k + s];
        if (q < 0) continue;
        const float wt = wp[t * k + s];
        for (int64_t c = 0; c < H; ++c) op[t * H + c] += wt * yp[q * H + c];
      }
  });
  return out;
}
"""

_KERNEL = InlineKernel("pagoda_cpu_moe_", _SOURCE, ["moe_experts"], ["-O3", "-march=native", "-fopenmp"],
                       "CPU grouped-expert kernel", "MoE layers use per-expert oneDNN matmuls")


def load() -> object | None:
    """The compiled module, or None when it cannot be built here."""
    return _KERNEL.load()


PANEL = 32  # output features per packed panel (NP in the kernel)


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and load() is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` -> ``[..., ceil(N / PANEL), K, PANEL]``: the output features in panels of
    ``PANEL``, each stored k-major (zero-padded to a whole panel)."""
    n, k = weight.shape[-2:]
    panels = -(-n // PANEL)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, panels * PANEL - n))
    return padded.reshape(*weight.shape[:-2], panels, PANEL, k).transpose(-1, -2).contiguous()


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``FusedMoE``'s stacked ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in the kernel's layout:
    ``[E, 2, I / PANEL, H, PANEL]`` (gate panels, then up panels) and ``[E, H / PANEL, I, PANEL]``."""
    e, two_i, h = w13.shape
    return pack_panels(w13.reshape(e, 2, two_i // 2, h)), pack_panels(w2)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, first_expert: int, intermediate: int) -> torch.Tensor:
    """Each token's routing-weighted sum of its experts' SiLU-gated MLP outputs (``[T, H]`` in
    ``x``'s dtype) with ``w13``/``w2`` from ``pack_experts``; pairs whose expert is not in
    ``first_expert .. first_expert + E - 1`` add 0."""
    module = load()
    assert module is not None
    out = module.moe_experts(x.float().contiguous(), weights.float().contiguous(),  # type: ignore[attr-defined]
                             ids.long().contiguous(), w13, w2, first_expert, intermediate)
    return out.to(x.dtype)
