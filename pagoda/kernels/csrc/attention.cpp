// attention.cpp: the paged decode-attention op over the loops of attention.h (design notes there).
#include "pagoda.h"
// fast-math for the loops below (as attention.h's notes say); set after the ATen headers so
// their inline code keeps the default semantics.
#pragma GCC optimize("fast-math")
#include "attention.h"

namespace pagoda::attn {


// out/q: [B, H, D] float32 contiguous. Caches: logical [num_blocks, block_size, Hkv, D] with
// unit stride on D, float32, bfloat16, float16, int8 or fp8; the scales (bf16 [num_blocks, block_size, Hkv]) are
// given exactly when the cache is int8/fp8 (empty tensors otherwise). block_tables: [B, W]
// int32; seq_lens: [B] int32 (keys 0..seq_len-1 are attended, or only the last `window` of
// them when window > 0). softcap > 0 caps the scores (cap * tanh(score / cap)); 0: none.
void paged_decode(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window,
                  at::Tensor k_scale, at::Tensor v_scale, double softcap) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  const bool scaled = k_scale.numel() > 0;
  Cache c{k_cache.data_ptr(), v_cache.data_ptr(),
          scaled ? static_cast<const uint16_t*>(k_scale.data_ptr()) : nullptr,
          scaled ? static_cast<const uint16_t*>(v_scale.data_ptr()) : nullptr,
          k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
          scaled ? k_scale.stride(0) : 0, scaled ? k_scale.stride(1) : 0, scaled ? k_scale.stride(2) : 0};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const float s = static_cast<float>(scale), cap = static_cast<float>(softcap);
  TORCH_CHECK(softcap >= 0, "paged_decode: softcap must be positive (0: none)");
  switch (k_cache.scalar_type()) {
    case at::kFloat: run<F32, false>(op, qp, c, bt, sl, B, H, D, Hkv, bs, W, s, window, cap); break;
    case at::kBFloat16: run<BF16, false>(op, qp, c, bt, sl, B, H, D, Hkv, bs, W, s, window, cap); break;
    case at::kHalf: run<F16, false>(op, qp, c, bt, sl, B, H, D, Hkv, bs, W, s, window, cap); break;
    case at::kChar: run<I8, true>(op, qp, c, bt, sl, B, H, D, Hkv, bs, W, s, window, cap); break;
    case at::kFloat8_e4m3fn: run<E4M3, true>(op, qp, c, bt, sl, B, H, D, Hkv, bs, W, s, window, cap); break;
    case at::kFloat8_e5m2: run<E5M2, true>(op, qp, c, bt, sl, B, H, D, Hkv, bs, W, s, window, cap); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported cache dtype ", k_cache.scalar_type());
  }
}

}  // namespace pagoda::attn
