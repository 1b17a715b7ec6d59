// amx.cpp: the AMX tile product's ops, a thin layer over amx.h's core (design notes there): the
// tensor checks, the allocations and the errors of a build or process without the kernel.
#include "amx.h"

namespace pagoda::amx {

bool compiled() { return kCompiled; }

bool available() { return tiles_granted(); }

at::Tensor pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "AMX pack: a 2-D bfloat16 weight");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({packed_size(N, K)}, w.options());
  pack_into(reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K, reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

void amx_linear(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                const at::BFloat16* w, int64_t N) {
  TORCH_CHECK(kCompiled, "this build has no AMX kernel");
  const bool done = matmul(y, ldy, x, x_bf16, ldx, M, K, reinterpret_cast<const uint16_t*>(w), N);
  TORCH_CHECK(done, "Linux refused this process the AMX tile state");
}

at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "AMX linear: float32 or bfloat16 rows");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "AMX linear: packed weight");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  TORCH_CHECK(packed.numel() == packed_size(n, K), "AMX linear: the packed weight is not [", n, ", ", K, "]");
  at::Tensor y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  amx_linear(y.data_ptr<float>(), n, xc.data_ptr(), xc.scalar_type() == at::kBFloat16, xc.stride(0), M, K,
             packed.data_ptr<at::BFloat16>(), n);
  return y;
}

}  // namespace pagoda::amx
