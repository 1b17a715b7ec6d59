// panel.h: the entry points of panel.cpp (design notes there).
#pragma once

#include "pagoda.h"

namespace pagoda::panel {

// Whether this variant has the float32 kernel (AVX-512) and the bfloat16 one (AVX512-BF16).
bool available();
bool available_bf16();
// weight [N, K] float32 -> [ceil(N/16), K, 16]; bfloat16 -> [ceil(N/16), ceil(K/2), 16, 2].
at::Tensor pack(at::Tensor weight);
at::Tensor pack_bf16(at::Tensor weight);
// y [M, N] float32 (row stride ldy) = x @ the packed weight^T (float32 panels, or bfloat16 panels
// with amx_linear's signature).
void panel_linear(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                  int64_t N);
void panel_linear_bf16(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                       const at::BFloat16* w, int64_t N);
// x [M, K] @ the packed weight^T -> [M, n] float32.
at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t n);

}  // namespace pagoda::panel
