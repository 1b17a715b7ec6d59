// panel.cpp: the panel ops, a thin layer over panel.h's torch-free core (design notes there):
// the tensor checks, the packed tensors' allocation, and the errors of a variant without the kernel.
#include "pagoda.h"
#include "panel.h"

namespace pagoda::panel {

bool available() { return kHasF32; }

bool available_bf16() { return kHasBF16; }

// weight [N, K] float32 -> [ceil(N/16), K, 16], zero padded.
at::Tensor pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "panel pack: a 2-D float32 weight");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + 15) / 16;
  at::Tensor out = at::zeros({P, K, 16}, w.options());
  pack_into(w.data_ptr<float>(), N, K, out.data_ptr<float>());
  return out;
}

// y [M, N] float32 (row stride ldy) = x [M, K] float32 (row stride ldx) @ weight^T, the weight
// packed by `pack`. Called directly by the fused decode blocks (through its address).
void panel_linear(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                  int64_t N) {
  const bool done = matmul(y, ldy, x, ldx, M, K, w, N);
  TORCH_CHECK(done, "this build has no float32 panel kernel (needs AVX2 or AVX-512)");
}

// weight [N, K] bfloat16 -> [ceil(N/16), ceil(K/2), 16, 2], zero padded: step k of panel p holds
// the pair (2k, 2k+1) of each of its 16 features.
at::Tensor pack_bf16(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "panel pack: a 2-D bfloat16 weight");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + 15) / 16, K2 = (K + 1) / 2;
  at::Tensor out = at::zeros({P, K2, 16, 2}, w.options());
  pack_bf16_into(reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K, reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// y [M, N] float32 (row stride ldy) = x [M, K] (float32, rounded to bfloat16 to nearest even as a
// conversion does, or bfloat16; row stride ldx) @ weight^T, the weight packed by `pack_bf16`. The
// signature of cpu_amx's amx_linear: the fused decode blocks call either through its address.
void panel_linear_bf16(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                       const at::BFloat16* w, int64_t N) {
  const bool done = matmul_bf16(y, ldy, x, x_bf16, ldx, M, K, w, N);
  TORCH_CHECK(done, "this build has no bfloat16 panel kernel (needs AVX512-BF16)");
}

// x [M, K] @ weight^T -> [M, n] float32: float32 rows over float32 panels (`pack`), float32 or
// bfloat16 rows over bfloat16 panels (`pack_bf16`).
at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t n) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || (bf16 && x.scalar_type() == at::kBFloat16)),
              "panel linear: float32 rows (or bfloat16 rows over bfloat16 panels)");
  const int64_t K = x.size(1);
  const bool shaped = bf16 ? packed.dim() == 4 && packed.size(1) == (K + 1) / 2 && packed.size(3) == 2
                           : packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(1) == K;
  TORCH_CHECK(packed.is_contiguous() && shaped && packed.size(0) == (n + 15) / 16 && packed.size(2) == 16,
              "panel linear: the packed weight is not [", n, ", ", K, "]");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0 || n == 0) return y;
  if (K == 0) return y.zero_();
  if (bf16)
    panel_linear_bf16(y.data_ptr<float>(), n, xc.data_ptr(), xc.scalar_type() == at::kBFloat16, xc.stride(0), M, K,
                      packed.data_ptr<at::BFloat16>(), n);
  else
    panel_linear(y.data_ptr<float>(), n, xc.data_ptr<float>(), xc.stride(0), M, K, packed.data_ptr<float>(), n);
  return y;
}


}  // namespace pagoda::panel
