// amx.h: the entry points of amx.cpp (design notes there).
#pragma once

#include "pagoda.h"

namespace pagoda::amx {

// Whether this variant carries the kernel; whether it has it and the process may use the tiles.
bool compiled();
bool available();
// weight [N, K] bfloat16 -> the packed layout.
at::Tensor pack(at::Tensor weight);
// y [M, N] float32 (row stride ldy) = x [M, K] (float32 or bfloat16, row stride ldx) @ weight^T.
void amx_linear(float* y, int64_t ldy, const void* x, bool x_bf16, int64_t ldx, int64_t M, int64_t K,
                const at::BFloat16* w, int64_t N);
// x [M, K] float32 or bfloat16 @ weight^T -> [M, n] float32.
at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t n);

}  // namespace pagoda::amx
