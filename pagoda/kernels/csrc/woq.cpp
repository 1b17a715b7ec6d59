// woq.cpp: the weight-only quantized matmul op (int8 per channel or per group, int4 per group, fp8 e4m3) over
// woq_core.h's torch-free kernels (design notes there).
//
// Design notes
// - This file is the tensor layer only: it checks the tensors (dtypes, contiguity, the int4 group
//   metadata's shape), takes their pointers and calls `linear`, and turns a variant without the
//   kernel into a clear error. The numbers are the core's.
// - decode.cpp calls woq_linear by address (its fused linear layers), so its signature stays.
#include "pagoda.h"
#include "woq.h"
#include "woq_core.h"

namespace pagoda::woq {

// int4's group scales and zero terms: float16 [G, N] each, as raw 16-bit words.
[[maybe_unused]] static std::pair<const uint16_t*, const uint16_t*> int4_meta(const at::Tensor& gs, const at::Tensor& gb,
                                                                              int64_t G, int64_t N) {
  const bool symmetric = gb.numel() == 0;  // no zero terms: every term is -8 * scale
  for (const at::Tensor* t : {&gs, &gb})
    TORCH_CHECK((t == &gb && symmetric) || (t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == G * N),
                "int4 weight-only kernel: group scales and zero terms must be contiguous float16 [G, N] "
                "(zero terms may be left out: symmetric codes, term = -8 * scale)");
  return {reinterpret_cast<const uint16_t*>(gs.data_ptr()),
          symmetric ? nullptr : reinterpret_cast<const uint16_t*>(gb.data_ptr())};
}

// int8 in groups: float16 scales [N/16, G, 16] (each block's in one stream), a group of whole column
// quads whose exact sums of q * v stay within int32 (at most 256 columns).
[[maybe_unused]] static const uint16_t* int8g_meta(const at::Tensor& gs, int64_t group, int64_t K, int64_t N) {
  TORCH_CHECK(group > 0 && group % 4 == 0 && group <= 256 && K % group == 0,
              "int8 weight-only kernel in groups: the group must be a multiple of 4 up to 256 that divides K");
  TORCH_CHECK(gs.scalar_type() == at::kHalf && gs.is_contiguous() && gs.numel() == (K / group) * N,
              "int8 weight-only kernel in groups: group scales must be contiguous float16 [N/16, G, 16]");
  return reinterpret_cast<const uint16_t*>(gs.data_ptr());
}

// out [M, N] float32 = x [M, K] float32 @ W.T (+ bias); w packed for ``kind``.
// int8: col_scale [N], aux [N] int32 = 128 * sum_k q[n, k].
// int4: gs / gb [G, N] float16 group scale and -scale * zero (gb empty: -8 * scale); aux unused.
// int8 in groups (kind 3): w holds q + 128, gs [N/16, G, 16] float16 group scales; col_scale, gb,
// aux unused. fp8: col_scale [N].
void woq_linear(at::Tensor out, at::Tensor x, at::Tensor w, int64_t kind, at::Tensor col_scale,
                at::Tensor gs, at::Tensor gb, int64_t group, at::Tensor aux, at::Tensor bias) {
  TORCH_CHECK(available(), "this kernel variant (" PAGODA_VARIANT ") has no weight-only quantized kernel");
  TORCH_CHECK(has_kind(kind), "this kernel variant (" PAGODA_VARIANT ") has no ", kind == 1 ? "fp8 " : "",
              "weight-only kernel (kind ", kind, ")");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && out.is_contiguous());
  if (M == 0) return;
  const uint16_t *gsp = nullptr, *gbp = nullptr;
  const float* cs = nullptr;
  const int32_t* auxp = nullptr;
  if (kind == 2) {
    std::tie(gsp, gbp) = int4_meta(gs, gb, K / group, N);
  } else if (kind == 3) {
    gsp = int8g_meta(gs, group, K, N);
  } else {
    cs = col_scale.data_ptr<float>();
    if (kind == 0 && aux.numel()) auxp = aux.data_ptr<int32_t>();
  }
  const bool ran = linear(out.data_ptr<float>(), x.data_ptr<float>(), M, K, N,
                          reinterpret_cast<const uint8_t*>(w.data_ptr()), static_cast<int>(kind), cs, gsp, gbp,
                          group, auxp, bias.numel() ? bias.data_ptr<float>() : nullptr);
  TORCH_CHECK(ran, "this kernel variant (" PAGODA_VARIANT ") has no weight-only kernel of kind ", kind);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
bool available() { return true; }
bool has_kind(int64_t kind) { return kind == 0 || kind == 1 || kind == 2 || kind == 3; }
// The 256-bit AVX-VNNI path is the avx2 variant's; this one has VNNI at full width throughout.
bool set_vnni(bool) { return false; }
bool vnni() { return false; }
#elif defined(__AVX2__) && defined(__FMA__)
bool available() { return true; }
bool has_kind(int64_t kind) { return kind == 0 || kind == 2 || kind == 3; }
bool set_vnni(bool on) { return g_vnni = on && cpu_has_avx_vnni(); }
bool vnni() { return g_vnni; }
#else  // this variant lacks the instructions
bool available() { return false; }
bool has_kind(int64_t) { return false; }
bool set_vnni(bool) { return false; }
bool vnni() { return false; }
#endif

}  // namespace pagoda::woq
