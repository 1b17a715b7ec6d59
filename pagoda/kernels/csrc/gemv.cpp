// gemv.cpp: the gemv op over the loops of gemv.h (design notes there).
#include "gemv.h"

namespace pagoda::gemv_k {

at::Tensor gemv(at::Tensor x, at::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 4 && w.size(1) == K && w.is_contiguous());
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Chunks of >= 16 output rows keep each thread on whole cache lines of y.
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  if (w.scalar_type() == at::kBFloat16) {
    const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
    at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) { run(xp, wp, yp, M, K, N, b, e); });
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat);
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) { run(xp, wp, yp, M, K, N, b, e); });
  }
  return y;
}

}  // namespace pagoda::gemv_k
