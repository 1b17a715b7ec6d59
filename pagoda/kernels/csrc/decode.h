// decode.h: the entry points of decode.cpp (design notes there).
#pragma once

#include "pagoda.h"

namespace pagoda::decode {

// Register a layer's attention block / MLP block (its tensors and constants, checked once);
// returns a handle for attn_block / mlp_block / layers; release forgets one.
int64_t register_attn(std::vector<at::Tensor> t, std::vector<at::Tensor> qkv_t, std::vector<at::Tensor> o_t,
                      std::vector<int64_t> iv, std::vector<double> fv);
int64_t register_mlp(at::Tensor norm_w, std::vector<at::Tensor> gu_t, std::vector<at::Tensor> down_t,
                     std::vector<int64_t> iv, double eps);
void release(int64_t handle);
// One block over the step's rows: {the block's output, the new residual}.
std::vector<at::Tensor> attn_block(int64_t handle, at::Tensor x, at::Tensor residual, at::Tensor positions,
                                   at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens);
std::vector<at::Tensor> mlp_block(int64_t handle, at::Tensor x, at::Tensor residual, bool bf16_out);
// A stack of layers (attention then MLP each) and the final norm, in one call.
std::vector<at::Tensor> layers(std::vector<int64_t> attn_handles, std::vector<int64_t> mlp_handles, at::Tensor x,
                               at::Tensor residual, at::Tensor positions, at::Tensor slots,
                               at::Tensor block_tables, at::Tensor seq_lens, bool bf16_out,
                               at::Tensor final_w, double final_eps);

}  // namespace pagoda::decode
