// moe.h: the entry points of moe.cpp (design notes there).
#pragma once

#include "pagoda.h"

namespace pagoda::moe {

// The routed experts of x [T, H] float32: weights/ids [T, k]; w13/w2 packed panels (see moe.cpp).
at::Tensor moe_experts(at::Tensor x, at::Tensor weights, at::Tensor ids, at::Tensor w13, at::Tensor w2,
                       int64_t first, int64_t I);

}  // namespace pagoda::moe
