"""A C++ paged decode-attention kernel for the CPU, compiled once on first use.

The torch path must gather every sequence's K/V into a fresh tensor before attending, so a
decode step copies the whole cache once per layer and reads it twice more. This kernel reads
each sequence's K/V in place through its block table, once, computing every query head of a
K/V group from the same row. It serves float32 decode rows; anything else (or a machine where
the compiler is unavailable, or ``PAGODA_CPU_KERNELS=0``) keeps the torch path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// One work item = sequence b and K/V heads [h0, h0 + nh). Each cached token's slot holds all
// K/V heads contiguously, so an item covering every head reads whole slots (no wasted cache
// lines); with fewer sequences than threads items split the heads instead.
static void decode_item(int64_t b, int64_t h0, int64_t nh, const float* qp, float* op, const float* kp,
                        const float* vp, const int32_t* bt, const int32_t* sl, int64_t H, int64_t D,
                        int64_t G, int64_t bs, int64_t sb, int64_t ss, int64_t sh, int64_t W, float scale,
                        int64_t window) {
  // With a sliding window only the last `window` keys are attended: positions lo..sl[b]-1.
  const int64_t lo = window > 0 && sl[b] > window ? sl[b] - window : 0;
  const int64_t L = sl[b] - lo, R = nh * G;  // R query heads served by this item
  const float* qb = qp + (b * H + h0 * G) * D;
  float* ob = op + (b * H + h0 * G) * D;
  if (L <= 0) { std::fill(ob, ob + R * D, 0.f); return; }
  std::vector<float> scores(R * L), acc(R * D, 0.f), denom(R);
  for (int64_t t = 0; t < L; ++t) {
    const float* slot = kp + bt[b * W + (t + lo) / bs] * sb + ((t + lo) % bs) * ss;
    for (int64_t r = 0; r < R; ++r) {
      const float* kr = slot + (h0 + r / G) * sh;
      const float* qr = qb + r * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qr[d] * kr[d];
      scores[r * L + t] = s * scale;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* sr = scores.data() + r * L;
    float m = sr[0];
    for (int64_t t = 1; t < L; ++t) m = sr[t] > m ? sr[t] : m;
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) { sr[t] = std::exp(sr[t] - m); sum += sr[t]; }
    denom[r] = sum;
  }
  for (int64_t t = 0; t < L; ++t) {
    const float* slot = vp + bt[b * W + (t + lo) / bs] * sb + ((t + lo) % bs) * ss;
    for (int64_t r = 0; r < R; ++r) {
      const float* vr = slot + (h0 + r / G) * sh;
      const float p = scores[r * L + t];
      float* ar = acc.data() + r * D;
      for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) ob[r * D + d] = acc[r * D + d] / denom[r];
}

// out/q: [B, H, D] contiguous. Caches: logical [num_blocks, block_size, Hkv, D] with unit stride
// on D. block_tables: [B, W] int32; seq_lens: [B] int32 (keys 0..seq_len-1 are attended, or only
// the last `window` of them when window > 0).
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  const int64_t nh = B >= 2 * at::get_num_threads() ? Hkv : 1;
  const int64_t per_seq = Hkv / nh;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t sb = k_cache.stride(0), ss = k_cache.stride(1), sh = k_cache.stride(2), W = block_tables.size(1);
  at::parallel_for(0, B * per_seq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w)
      decode_item(w / per_seq, (w % per_seq) * nh, nh, qp, op, kp, vp, bt, sl, H, D, G, bs, sb, ss, sh, W,
                  static_cast<float>(scale), window);
  });
}
"""

_MODULE = None
_FAILED = False


def load() -> object | None:
    """The compiled module, or None when it cannot be built here (the torch path is used)."""
    global _MODULE, _FAILED
    if _MODULE is not None or _FAILED:
        return _MODULE
    if os.environ.get("PAGODA_CPU_KERNELS", "1") in ("0", "false"):
        _FAILED = True
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        start = time.perf_counter()
        # The name carries a hash of the source, so an edited kernel is rebuilt, not reused.
        name = "pagoda_cpu_attention_" + hashlib.sha1(_SOURCE.encode()).hexdigest()[:10]
        _MODULE = load_inline(name, cpp_sources=_SOURCE, functions=["paged_decode"],
                              extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)
        logger.info("CPU paged-attention kernel ready in %.1fs", time.perf_counter() - start)
    except Exception as exc:  # no compiler, no ninja, ...: correct but slower torch path
        logger.warning("CPU attention kernel unavailable (%s); using the torch path", exc)
        _FAILED = True
    return _MODULE


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its ``seq_lens`` cached tokens (only the
    last ``sliding_window`` of them when given)."""
    module = load()
    assert module is not None
    q = q.contiguous()
    out = torch.empty_like(q)
    module.paged_decode(out, q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale,
                          sliding_window or 0)
    return out


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and k_cache.stride(-1) == 1 and load() is not None)
