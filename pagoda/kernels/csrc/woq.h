// woq.h: the entry points of woq.cpp, the op over woq_core.h's torch-free kernels (design notes there).
#pragma once

#include "pagoda.h"

namespace pagoda::woq {

// Whether this variant has the kernel, and which weight kinds it takes (0 int8 per channel, 1 fp8,
// 2 int4, 3 int8 in groups).
bool available();
bool has_kind(int64_t kind);
// The avx2 variant's AVX-VNNI int8/int4 path (256-bit vpdpbusd): on by default where the CPU has
// AVX-VNNI. set_vnni(false) turns it off, set_vnni(true) on where the CPU has it; both return
// whether it is on. Always false in the other variants.
bool set_vnni(bool on);
bool vnni();
// out [M, N] float32 = x [M, K] float32 @ dequant(w)^T (+ bias); kind 0 int8, 1 fp8, 2 int4, 3 int8
// in groups. int4: gs / gb float16 [G, N] (group scale, -scale * zero), aux unused; int8: col_scale [N]
// float32, aux [N] int32 (128 * row sums of the codes); int8 in groups: w holds q + 128, gs float16
// [N/16, G, 16]; fp8: col_scale [N].
void woq_linear(at::Tensor out, at::Tensor x, at::Tensor w, int64_t kind, at::Tensor col_scale,
                at::Tensor gs, at::Tensor gb, int64_t group, at::Tensor aux, at::Tensor bias);

}  // namespace pagoda::woq
