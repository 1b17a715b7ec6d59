// fused.cpp: the elementwise ops and the greedy argmax (design notes in fused.h).
#include "fused.h"

namespace pagoda::fused {


// x [T, H] (unit inner stride) -> rms_norm(x) * w, contiguous.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check(x);
  const int64_t T = x.size(0), H = x.size(1), sx = x.stride(0);
  at::Tensor y = at::empty({T, H}, x.options());
  if (is_bf16(x)) {  // bfloat16 rows: float32 arithmetic, the output rounded once
    const at::Tensor wf = w.to(at::kFloat).contiguous();
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
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor res, at::Tensor w, double eps) {
  check(x);
  check(res);
  const int64_t T = x.size(0), H = x.size(1), sx = x.stride(0), sr = res.stride(0);
  at::Tensor y = at::empty({T, H}, x.options()), nr = at::empty({T, H}, x.options());
  if (is_bf16(x)) {  // bfloat16: the sum is rounded (it is the new residual), then normed from that
    TORCH_CHECK(is_bf16(res), "bfloat16 rows and residual expected");
    const at::Tensor wf = w.to(at::kFloat).contiguous();
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
at::Tensor silu_and_mul(at::Tensor x) {
  check(x);
  const int64_t T = x.size(0), I = x.size(1) / 2, sx = x.stride(0);
  at::Tensor y = at::empty({T, I}, x.options());
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
at::Tensor rotate(at::Tensor x, at::Tensor pos, at::Tensor cache) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 3 &&
              x.stride(2) == 1);
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), s0 = x.stride(0), s1 = x.stride(1);
  const int64_t rot = cache.size(1), half = rot / 2;
  at::Tensor y = at::empty({T, NH, D}, x.options());
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

// The greedy token of each listed row of logits [N, V] (float32 or bfloat16, unit inner stride).
std::vector<int64_t> greedy_tokens(at::Tensor logits, std::vector<int64_t> rows) {
  TORCH_CHECK((logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
              logits.dim() == 2 && logits.stride(1) == 1, "float32 or bfloat16 rows expected");
  const int64_t N = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  std::vector<int64_t> out(rows.size(), 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    TORCH_CHECK(rows[r] >= 0 && rows[r] < N, "row ", rows[r], " outside the logits");
    out[r] = bf16 ? greedy_row(logits.data_ptr<at::BFloat16>() + rows[r] * ld, V)
                  : greedy_row(logits.data_ptr<float>() + rows[r] * ld, V);
  }
  return out;
}

}  // namespace pagoda::fused
