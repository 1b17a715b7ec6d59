// moe.cpp: the moe_experts op, a thin layer over moe.h's torch-free core (design notes there):
// the tensor checks, the pair grouping's input, the scratch buffers and the weight dtype.
#include "pagoda.h"
#include "moe.h"

namespace pagoda::moe {

// x [T, H] float32; weights [T, k] float32; ids [T, k] int64 (global expert ids, this rank holding
// first .. first + E - 1); w13, w2 float32 or bfloat16 in the panel layout of moe.h's ``experts``.
// Returns [T, H] float32: each token's routing-weighted sum of its experts' outputs (pairs routed
// to another rank's experts contribute nothing).
at::Tensor moe_experts(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor w13,
                          at::Tensor w2, int64_t first, int64_t I) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous());
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous());
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && w13.scalar_type() == w2.scalar_type());
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = w13.size(0);
  const int64_t pi = (I + NP - 1) / NP, ph = (H + NP - 1) / NP;
  TORCH_CHECK(w13.dim() == 5 && w13.size(1) == 2 && w13.size(2) == pi && w13.size(3) == H && w13.size(4) == NP);
  TORCH_CHECK(w2.dim() == 4 && w2.size(0) == E && w2.size(1) == ph && w2.size(2) == I && w2.size(3) == NP);
  // Counting sort of the pairs by local expert.
  const Groups g = group_pairs(ids.data_ptr<int64_t>(), T, k, first, E);
  const int64_t P = g.offsets[E];
  auto f32 = x.options();
  at::Tensor out = at::empty({T, H}, f32);
  if (P == 0) return out.zero_();
  at::Tensor xs = at::empty({P, H}, f32), act = at::empty({P, I}, f32), y = at::empty({P, H}, f32);
  const int threads = static_cast<int>(pagoda::num_threads());
  float *xsp = xs.data_ptr<float>(), *ap = act.data_ptr<float>(), *yp = y.data_ptr<float>(), *op = out.data_ptr<float>();
  if (w13.scalar_type() == at::kBFloat16) {
    experts(x.data_ptr<float>(), weights.data_ptr<float>(), T, k, g, w13.data_ptr<at::BFloat16>(),
            w2.data_ptr<at::BFloat16>(), E, H, I, xsp, ap, yp, op, threads);
  } else {
    TORCH_CHECK(w13.scalar_type() == at::kFloat);
    experts(x.data_ptr<float>(), weights.data_ptr<float>(), T, k, g, w13.data_ptr<float>(), w2.data_ptr<float>(),
            E, H, I, xsp, ap, yp, op, threads);
  }
  return out;
}

}  // namespace pagoda::moe
