"""Whole decoder-layer blocks in one C++ call each, for the decode steps on CPU.

Why: a batch-1 decode step of a small model is a few milliseconds of weight streaming, and
around it every layer made about thirty small calls from Python (norms, the projections'
split and reshapes, rotary, the cache write and its checks, the paged-attention call and the
indexing around it, SiLU-and-mul...). Each costs microseconds on its own, and several times
that inside a real step: the step streams the weights through every cache level, so the
interpreter's and the dispatcher's code and data are cold at each call. Measured on the
2-core development machine, those calls took about as long as the layers' matrices at batch 1,
and a quarter of a batch-8 step.

Here each layer is two calls while a step is all decodes (one token per sequence) of at most
``MAX_ROWS`` sequences:

- ``attn_block``: residual add + RMSNorm, the fused q/k/v projection (+ bias), q/k RMSNorm
  (Qwen3), rotary, the K/V written into the paged cache, paged decode attention (sliding
  window included) and the output projection;
- ``mlp_block``: residual add + RMSNorm, gate/up projection, SiLU-and-mul, down projection
  (dense MLPs; a mixture-of-experts layer runs its own MLP after the fused attention block).

The pieces are the project's other CPU kernels, compiled into this module from their own
sources (``cpu_gemv``'s matrix-vector loop, ``cpu_kernel``'s paged attention, ``cpu_fused``'s
norm and SiLU ops), so the arithmetic is theirs, and the products go to the kernel the layer
itself would use: ``cpu_amx``'s tile kernel or ``cpu_panel``'s panels (by their addresses) for
as many rows as the layer chose them for, the gemv loop for up to four rows where the layer kept
its dense weight, oneDNN over the weight ``cpu_gemm`` packed (through the dispatcher) otherwise,
and ``cpu_woq``'s int8 / int4 / fp8 kernel (by its address) for weights quantized for it. What a layer needs is checked
once, when the KV cache is attached (``attach``): float32 or bfloat16 weights of those kinds (no
LoRA wrapper, no act-order permutation), a float32 or bfloat16 KV cache, one tensor-parallel rank, NeoX-style
rotary with one-dimensional positions. Every other layer, and every step with a prefill chunk,
draft rows or more than ``MAX_ROWS`` sequences, runs the module code as before.
``PAGODA_CPU_FUSED_DECODE=0`` (or ``PAGODA_CPU_KERNELS=0``) turns it off.
"""
from __future__ import annotations

import logging
import os
import re
import weakref

import torch
from torch import nn

from pagoda.layers import cpu_amx, cpu_fused, cpu_gemv, cpu_panel
from pagoda.layers.attention import cpu_kernel
from pagoda.layers.cpu_build import InlineKernel
from pagoda.layers.quantization import cpu_woq

logger = logging.getLogger(__name__)

ENV_VAR = "PAGODA_CPU_FUSED_DECODE"
# Decode steps of more sequences spend little of their time in the per-call overheads the blocks save.
MAX_ROWS = 64


def _body(source: str) -> str:
    """A kernel source without its ``#include`` lines, to be wrapped in a namespace."""
    return re.sub(r"^#include[^\n]*\n", "", source, flags=re.M)


_OWN = r"""
namespace {

// The compiled weight-only quantized matmul (cpu_woq's woq_linear), called through its address.
using WoqFn = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, torch::Tensor, torch::Tensor,
                       torch::Tensor, int64_t, torch::Tensor, torch::Tensor);
WoqFn woq_fn = nullptr;

// The compiled AMX bfloat16 matmul (cpu_amx's amx_linear), called through its address.
using AmxFn = void (*)(float*, int64_t, const void*, bool, int64_t, int64_t, int64_t, const at::BFloat16*, int64_t);
AmxFn amx_fn = nullptr;

// The compiled float32 panel matmul (cpu_panel's panel_linear), called through its address;
// its bfloat16 twin (panel_linear_bf16) has amx_linear's signature.
using PanelFn = void (*)(float*, int64_t, const float*, int64_t, int64_t, int64_t, const float*, int64_t);
PanelFn panel_fn = nullptr;
AmxFn panel_bf16_fn = nullptr;

// One linear layer. kind -1: a float32 or bfloat16 [N, K] weight, dense `w` (kept where the gemv
// kernel serves few rows; else empty) and/or `packed` in oneDNN's layout (or empty), and/or `tiles`
// for up to `group` rows (or empty: cpu_panel's float32 panels [P, K, 16], cpu_panel's bfloat16
// panels [P, K/2, 16, 2], or cpu_amx's flat bfloat16 layout), plus `bias`.
// Kinds >= 0: cpu_woq's packed weight and its tensors, `n` output features.
struct Linear {
  torch::Tensor w, col_scale, gs, gb, aux, bias, packed, tiles;
  int64_t kind, group, n;
};

Linear make_linear(const std::vector<torch::Tensor>& t, int64_t kind, int64_t group) {
  TORCH_CHECK(t.size() == 8, "fused decode: eight tensors per linear layer");
  TORCH_CHECK(kind < 0 || woq_fn != nullptr, "fused decode: quantized layer without the quantized kernel");
  const bool tiles = kind < 0 && t[7].numel();
  // A dense layer with tiles: `group` = N + (the most rows the tiles serve) << 32.
  const int64_t n = tiles ? (group & 0xFFFFFFFFLL) : kind >= 0 ? t[0].size(0) * 16 : -1, rows = tiles ? group >> 32 : 0;
  const bool linked = t[7].scalar_type() == torch::kFloat ? panel_fn != nullptr
                      : t[7].scalar_type() != torch::kBFloat16 ? false
                      : t[7].dim() == 4 ? panel_bf16_fn != nullptr : amx_fn != nullptr;
  TORCH_CHECK(!tiles || (linked && n > 0 && rows > 0),
              "fused decode: tiles without their kernel, the output size or the row limit");
  return Linear{t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], kind, tiles ? rows : group, n};
}

// oneDNN's linear over a weight packed by cpu_gemm (the op the module path calls), through the
// dispatcher.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.defined() && bias.numel() ? c10::IValue(bias) : c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [M, K] @ W^T (+ bias) as a new contiguous float32 [M, N] tensor. Dense weights: the tile
// kernel (AMX or panel) for as many rows as the layer chose it for, the gemv loop for up to four
// rows where the layer kept its dense weight, else oneDNN.
torch::Tensor linear(const Linear& l, const torch::Tensor& x) {
  const int64_t M = x.size(0);
  if (l.kind >= 0) {
    torch::Tensor y = torch::empty({M, l.n}, x.options());
    woq_fn(y, x, l.w, l.kind, l.col_scale, l.gs, l.gb, l.group, l.aux, l.bias);
    return y;
  }
  torch::Tensor y;
  if (l.tiles.numel() && M <= l.group) {
    y = torch::empty({M, l.n}, x.options());
    if (l.tiles.scalar_type() == torch::kFloat)
      panel_fn(y.data_ptr<float>(), l.n, x.data_ptr<float>(), x.stride(0), M, x.size(1), l.tiles.data_ptr<float>(),
               l.n);
    else
      (l.tiles.dim() == 4 ? panel_bf16_fn : amx_fn)(y.data_ptr<float>(), l.n, x.data_ptr<float>(), false,
                                                    x.stride(0), M, x.size(1), l.tiles.data_ptr<at::BFloat16>(), l.n);
  } else if (l.packed.numel() && (M > 4 || !l.w.numel())) {
    if (l.packed.scalar_type() == torch::kFloat) return onednn_linear(x, l.packed, l.bias).contiguous();
    // A bfloat16 weight (a bfloat16 model): oneDNN takes bfloat16 rows; the bias is added below
    // in float32, as the gemv path does.
    TORCH_CHECK(l.packed.scalar_type() == torch::kBFloat16, "fused decode: packed weight dtype");
    y = onednn_linear(x.to(torch::kBFloat16), l.packed, torch::Tensor()).to(torch::kFloat).contiguous();
  } else {
    TORCH_CHECK(l.w.numel(), "fused decode: no kernel for this layer's rows");
    const int64_t N = l.w.size(0), K = l.w.size(1);
    y = torch::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const bool bf16 = l.w.scalar_type() == torch::kBFloat16;
    const void* wp = l.w.data_ptr();
    const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
    for (int64_t m0 = 0; m0 < M; m0 += 4) {  // the gemv loop serves up to four rows per pass
      const int64_t mt = std::min<int64_t>(4, M - m0);
      at::parallel_for(0, N, grain, [&](int64_t s, int64_t e) {
        if (bf16)
          gemv_k::run(xp + m0 * K, static_cast<const at::BFloat16*>(wp), yp + m0 * N, mt, K, N, s, e);
        else
          gemv_k::run(xp + m0 * K, static_cast<const float*>(wp), yp + m0 * N, mt, K, N, s, e);
      });
    }
  }
  const int64_t N = y.size(1);
  float* yp = y.data_ptr<float>();
  if (l.bias.numel()) {
    const float* bp = l.bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] += bp[n];
  }
  return y;
}

// Rows [0, M) in parallel chunks (a serial loop when there are few).
template <class F>
void for_rows(int64_t M, const F& f) {
  at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) f(m);
  });
}

// {rms_norm(x (+ residual)) * w, x (+ residual)}: the elementwise kernel's own norm ops.
std::vector<torch::Tensor> add_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& w,
                                    double eps) {
  if (!residual.numel()) return {fused::rms_norm(x, w, eps), x};
  TORCH_CHECK(residual.sizes() == x.sizes(), "fused decode: residual rows");
  return fused::add_rms_norm(x, residual, w, eps);
}

// Rotate-half rotary of one head in place; c/s: cos and sin of the position (half values each).
inline void rope_head(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i] + a * s[i];
  }
}

void check_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1,
              "fused decode: contiguous float32 rows expected");
}

// Round contiguous float32 values to the nearest bfloat16 (ties to even, as a conversion does), in place.
void round_bf16(torch::Tensor& t) {
  float* p = t.data_ptr<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(at::BFloat16(p[i]));
}

// A bfloat16 model's rows, widened for the float32 arithmetic of the blocks (float32 rows as they are).
torch::Tensor widened(const torch::Tensor& x) {
  return x.scalar_type() == torch::kBFloat16 ? x.to(torch::kFloat).contiguous() : x.contiguous();
}

}  // namespace

void set_woq(int64_t address) { woq_fn = reinterpret_cast<WoqFn>(address); }
void set_amx(int64_t address) { amx_fn = reinterpret_cast<AmxFn>(address); }
void set_panel(int64_t address, int64_t bf16_address) {
  panel_fn = reinterpret_cast<PanelFn>(address);
  panel_bf16_fn = reinterpret_cast<AmxFn>(bf16_address);
}

// One layer's attention block, as registered: input norm weight, q-norm and k-norm weights (or
// empty), cos|sin table [max_pos, rot], K and V caches (float32 or bfloat16 [blocks, block_size,
// Hkv, D], unit stride on D), the q/k/v and output projections, head counts and size, sliding
// window (0: none), norm eps and attention scale.
struct AttnArgs {
  torch::Tensor norm_w, qn, kn, cs, kc, vc;
  Linear qkv, o;
  int64_t H, Hkv, D, window;
  double eps, scale;
};

// One dense MLP block, as registered: its norm weight, gate/up and down projections, norm eps.
struct MlpArgs {
  torch::Tensor norm_w;
  Linear gu, down;
  double eps;
};

// The attention block for M decode rows (row m = the next token of sequence m).
// Returns {attention block output [M, Hd] float32, the residual stream x (+ residual)}.
static std::vector<torch::Tensor> attn_impl(const AttnArgs& a, torch::Tensor x, torch::Tensor residual,
                                            const torch::Tensor& positions, const torch::Tensor& slots,
                                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens) {
  x = widened(x);
  if (residual.numel()) residual = widened(residual);
  check_rows(x);
  const int64_t M = x.size(0), Hd = x.size(1);
  const int64_t H = a.H, Hkv = a.Hkv, D = a.D;
  const int64_t QS = H * D, KS = Hkv * D, NQKV = QS + 2 * KS;
  const float eps = static_cast<float>(a.eps);
  const torch::Tensor &qn = a.qn, &kn = a.kn, &cs = a.cs, &kc = a.kc, &vc = a.vc;
  TORCH_CHECK(positions.numel() == M && slots.numel() == M && block_tables.size(0) == M && seq_lens.numel() == M,
              "fused decode: one position, slot, block table and length per row");
  const bool bf16_cache = kc.scalar_type() == torch::kBFloat16;
  auto opts = x.options();
  const std::vector<torch::Tensor> hr = add_norm(x, residual, a.norm_w, a.eps);
  const torch::Tensor &h = hr[0], &r = hr[1];

  torch::Tensor qkv = linear(a.qkv, h);
  TORCH_CHECK(qkv.size(1) == NQKV, "fused decode: q/k/v projection width");
  float* qkvp = qkv.data_ptr<float>();

  torch::Tensor q = torch::empty({M, H, D}, opts);
  float* qp = q.data_ptr<float>();
  char* kcp = static_cast<char*>(kc.data_ptr());
  char* vcp = static_cast<char*>(vc.data_ptr());
  const int64_t esz = kc.element_size();
  const int64_t bs = kc.size(1), sb = kc.stride(0), ss = kc.stride(1), sh = kc.stride(2);
  const int64_t nslots = kc.size(0) * bs, rot = cs.size(1), half = rot / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sm = slots.data_ptr<int64_t>();
  const float* csp = cs.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {  // checked first: no exception inside a parallel region
    TORCH_CHECK(pos[m] >= 0 && pos[m] < cs.size(0), "position ", pos[m], " outside the rotary table");
    TORCH_CHECK(sm[m] < nslots, "fused decode: slot ", sm[m], " outside the cache");
  }
  for_rows(M, [&](int64_t m) {
    float* row = qkvp + m * NQKV;
    if (qn.numel())
      for (int64_t hh = 0; hh < H; ++hh) fused::norm_row(row + hh * D, qn.data_ptr<float>(), row + hh * D, D, eps);
    if (kn.numel())
      for (int64_t hh = 0; hh < Hkv; ++hh)
        fused::norm_row(row + QS + hh * D, kn.data_ptr<float>(), row + QS + hh * D, D, eps);
    const float *c = csp + pos[m] * rot, *s = c + half;
    for (int64_t hh = 0; hh < H; ++hh) rope_head(row + hh * D, c, s, half);
    for (int64_t hh = 0; hh < Hkv; ++hh) rope_head(row + QS + hh * D, c, s, half);
    std::memcpy(qp + m * QS, row, QS * sizeof(float));
    if (sm[m] < 0) return;  // slot -1: a padding row (static decode batches), not written
    const int64_t block = sm[m] / bs, off = sm[m] % bs;
    for (int64_t hh = 0; hh < Hkv; ++hh) {
      const int64_t pos_b = (block * sb + off * ss + hh * sh) * esz;
      const float *kr = row + QS + hh * D, *vr = row + QS + KS + hh * D;
      if (bf16_cache) {  // rounded to nearest even, as the module path's copy into the cache
        at::BFloat16* kd = reinterpret_cast<at::BFloat16*>(kcp + pos_b);
        at::BFloat16* vd = reinterpret_cast<at::BFloat16*>(vcp + pos_b);
        for (int64_t d = 0; d < D; ++d) { kd[d] = at::BFloat16(kr[d]); vd[d] = at::BFloat16(vr[d]); }
      } else {
        std::memcpy(kcp + pos_b, kr, D * sizeof(float));
        std::memcpy(vcp + pos_b, vr, D * sizeof(float));
      }
    }
  });

  torch::Tensor att = torch::empty({M, QS}, opts);
  attn::Cache c{kcp, vcp, nullptr, nullptr, sb, ss, sh, 0, 0, 0};
  torch::Tensor bt = block_tables.contiguous(), sl = seq_lens.contiguous();
  const float scale = static_cast<float>(a.scale);
  if (bf16_cache)
    attn::run<attn::BF16, false>(att.data_ptr<float>(), qp, c, bt.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), M, H,
                                 D, Hkv, bs, bt.size(1), scale, a.window);
  else
    attn::run<attn::F32, false>(att.data_ptr<float>(), qp, c, bt.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), M, H,
                                D, Hkv, bs, bt.size(1), scale, a.window);
  torch::Tensor o = linear(a.o, att);
  TORCH_CHECK(o.size(1) == Hd, "fused decode: output projection width");
  return {o, r};
}

// The dense MLP block: r = x + residual, out = down(silu(gate(h)) * up(h)) with
// h = rms_norm(r) * w. Returns {out, r}, in bfloat16 when ``bf16_out``.
static std::vector<torch::Tensor> mlp_impl(const MlpArgs& a, const torch::Tensor& x, const torch::Tensor& residual,
                                           bool bf16_out) {
  check_rows(x);
  const int64_t Hd = x.size(1);
  TORCH_CHECK(residual.numel(), "fused decode: the MLP block needs the residual");
  const std::vector<torch::Tensor> hr = add_norm(x, residual, a.norm_w, a.eps);
  torch::Tensor out = linear(a.down, fused::silu_and_mul(linear(a.gu, hr[0])));
  TORCH_CHECK(out.size(1) == Hd, "fused decode: down projection width");
  if (bf16_out) return {out.to(torch::kBFloat16), hr[1].to(torch::kBFloat16)};  // a bfloat16 model's rows
  return {out, hr[1]};
}

// A layer's block arguments are handed over once, when the KV cache is attached, checked, and
// kept here under a handle: a step's call then converts seven tensors from Python instead of
// about forty (the conversion was several microseconds per call, more inside a cold step).
// ``release`` drops them (and the references they hold) when the layer's blocks are collected.
static std::unordered_map<int64_t, AttnArgs> attn_args;
static std::unordered_map<int64_t, MlpArgs> mlp_args;
static int64_t last_handle = 0;

// t: input norm weight, q-norm and k-norm weights (or empty), cos|sin table, K cache, V cache.
// qkv_t, o_t: the projections' tensors (see Linear). iv: H, Hkv, D, window, then kind and group of
// qkv and of o. fv: eps, scale.
int64_t register_attn(std::vector<torch::Tensor> t, std::vector<torch::Tensor> qkv_t, std::vector<torch::Tensor> o_t,
                      std::vector<int64_t> iv, std::vector<double> fv) {
  TORCH_CHECK(t.size() == 6 && iv.size() == 8 && fv.size() == 2, "fused decode: attention block arguments");
  const torch::Tensor &kc = t[4], &vc = t[5];
  TORCH_CHECK((kc.scalar_type() == torch::kFloat || kc.scalar_type() == torch::kBFloat16) &&
                  kc.scalar_type() == vc.scalar_type() && kc.dim() == 4 && kc.stride(3) == 1 &&
                  kc.strides() == vc.strides(),
              "fused decode: float32 or bfloat16 K/V caches with the same strides");
  TORCH_CHECK(t[3].scalar_type() == torch::kFloat && t[3].is_contiguous(), "fused decode: float32 rotary table");
  attn_args[++last_handle] = AttnArgs{t[0], t[1], t[2], t[3], kc, vc, make_linear(qkv_t, iv[4], iv[5]),
                                      make_linear(o_t, iv[6], iv[7]), iv[0], iv[1], iv[2], iv[3], fv[0], fv[1]};
  return last_handle;
}

// gu_t, down_t: the projections' tensors; iv: kind and group of gate_up and of down.
int64_t register_mlp(torch::Tensor norm_w, std::vector<torch::Tensor> gu_t, std::vector<torch::Tensor> down_t,
                     std::vector<int64_t> iv, double eps) {
  TORCH_CHECK(iv.size() == 4, "fused decode: MLP block arguments");
  mlp_args[++last_handle] = MlpArgs{norm_w, make_linear(gu_t, iv[0], iv[1]), make_linear(down_t, iv[2], iv[3]), eps};
  return last_handle;
}

void release(int64_t handle) {
  attn_args.erase(handle);
  mlp_args.erase(handle);
}

// One attention block for M decode rows (row m = the next token of sequence m), with the
// arguments registered under ``handle``. Returns {attention block output [M, Hd] float32, the
// residual stream x (+ residual)}.
std::vector<torch::Tensor> attn_block(int64_t handle, torch::Tensor x, torch::Tensor residual, torch::Tensor positions,
                                      torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_lens) {
  const auto it = attn_args.find(handle);
  TORCH_CHECK(it != attn_args.end(), "fused decode: unknown attention block ", handle);
  return attn_impl(it->second, x, residual, positions, slots, block_tables, seq_lens);
}

// One MLP block with the arguments registered under ``handle``; ``bf16_out``: hand bfloat16 rows back.
std::vector<torch::Tensor> mlp_block(int64_t handle, torch::Tensor x, torch::Tensor residual, bool bf16_out) {
  const auto it = mlp_args.find(handle);
  TORCH_CHECK(it != mlp_args.end(), "fused decode: unknown MLP block ", handle);
  return mlp_impl(it->second, x, residual, bf16_out);
}

// Consecutive layers, each its attention block then its MLP block (handles in layer order), in one
// call: crossing from Python costs each block call tens of microseconds in a real step, where the
// weights just streamed through every cache level. Every layer hands the rows on as the layer-by-
// layer calls do (in bfloat16 when ``bf16_out``), so the results are the same. With a final norm
// weight (the last pipeline stage's): its RMSNorm of x + residual too, the sum rounded to
// bfloat16 first in a bfloat16 model as the module's residual add does. Returns {x, residual}
// (after a final norm: {its output, the sum, float32}).
std::vector<torch::Tensor> layers(std::vector<int64_t> attn_handles, std::vector<int64_t> mlp_handles, torch::Tensor x,
                                  torch::Tensor residual, torch::Tensor positions, torch::Tensor slots,
                                  torch::Tensor block_tables, torch::Tensor seq_lens, bool bf16_out,
                                  torch::Tensor final_w, double final_eps) {
  TORCH_CHECK(!attn_handles.empty() && attn_handles.size() == mlp_handles.size(),
              "fused decode: one attention and one MLP block per layer");
  std::vector<const AttnArgs*> attn;
  std::vector<const MlpArgs*> mlp;
  for (size_t i = 0; i < attn_handles.size(); ++i) {  // every handle checked before any layer runs
    const auto a = attn_args.find(attn_handles[i]);
    const auto m = mlp_args.find(mlp_handles[i]);
    TORCH_CHECK(a != attn_args.end() && m != mlp_args.end(), "fused decode: unknown block of layer ", i);
    attn.push_back(&a->second);
    mlp.push_back(&m->second);
  }
  std::vector<torch::Tensor> xr{x, residual};
  const size_t L = attn.size();
  for (size_t i = 0; i < L; ++i) {
    const std::vector<torch::Tensor> ar = attn_impl(*attn[i], xr[0], xr[1], positions, slots, block_tables, seq_lens);
    const bool hand_back = i + 1 == L && !final_w.numel();  // the rows leave the call here
    xr = mlp_impl(*mlp[i], ar[0], ar[1], bf16_out && hand_back);
    // Between layers a bfloat16 model's rows stay float32, rounded to bfloat16 values in place:
    // the numbers narrowing and widening again give, without four conversions per layer.
    if (bf16_out && !hand_back) {
      round_bf16(xr[0]);
      round_bf16(xr[1]);
    }
  }
  if (!final_w.numel()) return xr;
  if (!bf16_out) return fused::add_rms_norm(xr[0], xr[1], final_w, final_eps);
  torch::Tensor sum = xr[0] + xr[1];  // float32 sums of bfloat16 values, rounded as a bfloat16 add
  round_bf16(sum);
  return {fused::rms_norm(sum, final_w, final_eps).to(torch::kBFloat16), sum};
}
"""

_SOURCE = "\n".join([
    "#include <torch/extension.h>", "#include <ATen/Parallel.h>", "#include <algorithm>", "#include <cfloat>", "#include <cmath>",
    "#include <cstdint>", "#include <cstring>", "#include <unordered_map>", "#include <utility>", "#include <vector>",
    "#if defined(__AVX512F__)", "#include <immintrin.h>", "#endif",
    # The attention kernel is built with -ffast-math on its own; so it is here.
    "#pragma GCC push_options", '#pragma GCC optimize("fast-math")',
    "namespace attn {", _body(cpu_kernel._SOURCE), "}  // namespace attn", "#pragma GCC pop_options",
    "namespace gemv_k {", _body(cpu_gemv._SOURCE), "}  // namespace gemv_k",
    "namespace fused {", _body(cpu_fused._SOURCE), "}  // namespace fused",
    _OWN,
])

_KERNEL = InlineKernel("pagoda_cpu_decode_", _SOURCE,
                       ["set_woq", "set_amx", "set_panel", "register_attn", "register_mlp", "release", "attn_block", "mlp_block", "layers"],
                       ["-O3", "-march=native", "-fopenmp"], "CPU fused decode-layer kernel",
                       "decode layers run op by op")

_EMPTY = torch.empty(0)
_EMPTY_I32 = torch.empty(0, dtype=torch.int32)


def load() -> object | None:
    """The compiled module, or None when it cannot be built here (or is switched off)."""
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no"):
        return None
    return _KERNEL.load()


def _link_woq(woq_module: object) -> None:
    """Hand the blocks the quantized kernel's address (once; only models with such layers load
    that kernel at all)."""
    global _WOQ_LINKED
    module = load()
    if module is not None and not _WOQ_LINKED:
        module.set_woq(woq_module.woq_linear_address())  # type: ignore[attr-defined]
        _WOQ_LINKED = True


def _link_tiles(kernel: object) -> None:
    """Hand the blocks the addresses of a tile kernel (``cpu_amx``, or ``cpu_panel``'s float32 and
    bfloat16 entry points; once each)."""
    module = load()
    if module is None or kernel in _TILES_LINKED:
        return
    if kernel is cpu_amx:
        module.set_amx(cpu_amx.load().linear_address())  # type: ignore[attr-defined,union-attr]
    else:
        compiled = cpu_panel.load()
        module.set_panel(compiled.linear_address(), compiled.linear_bf16_address())  # type: ignore[attr-defined,union-attr]
    _TILES_LINKED.add(kernel)


_WOQ_LINKED = False
_TILES_LINKED: set[object] = set()  # the tile kernels (modules) whose addresses the blocks hold
DENSE = -1  # the kind of a dense float weight (cpu_woq's kinds are >= 0)
# The model dtypes the blocks serve: float32, and bfloat16 (bfloat16 weights and KV cache; the
# blocks compute in float32 and hand bfloat16 rows back to the module path).
_DTYPES = (torch.float32, torch.bfloat16)


def _linear_spec(linear: nn.Module) -> tuple[list[torch.Tensor], int, int] | None:
    """How the C++ blocks multiply by ``linear``: (its eight tensors, kind, group size; for a dense
    weight with tiles (``cpu_amx``'s or ``cpu_panel``'s), its output size + the tiles' row limit
    << 32 in place of the group size), or None where they cannot. Qualify: a plain (unquantized, unwrapped) float32
    weight, dense for the gemv kernel and/or packed for oneDNN, and a weight quantized for
    ``cpu_woq`` (no input permutation); not a LoRA wrapper, another quantized kernel or a
    tensor-parallel shard."""
    from pagoda.layers.linear import LinearBase
    from pagoda.layers.quantization.base import UnquantizedLinearMethod

    if not isinstance(linear, LinearBase) or getattr(linear, "tp_size", 1) != 1:
        return None
    bias = _vector(linear.bias)
    if type(linear.quant_method) is UnquantizedLinearMethod:
        weight, packed = linear.weight, getattr(linear, "packed", None)
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        # The dense copy stays where the gemv kernel serves few rows; oneDNN's packed one serves
        # the rest (both, one or the other; a layer with neither cannot be fused).
        dense = weight.data if weight.numel() > 0 and weight.dim() == 2 and weight.is_contiguous() else _EMPTY
        tiles = getattr(packed, "pagoda_tiles", None)
        out = packed.pagoda_out + (packed.pagoda_tiles_rows << 32) if tiles is not None else 0
        if tiles is not None:
            _link_tiles(packed.pagoda_tiles_kernel)
        packed = packed if packed is not None else _EMPTY
        if not dense.numel() and not packed.numel():
            return None
        return [dense, _EMPTY, _EMPTY, _EMPTY, _EMPTY_I32, bias, packed, _EMPTY if tiles is None else tiles], DENSE, out
    q = getattr(linear, "qlinear", None)
    if type(q) is cpu_woq.WoqCPU and q.perm is None and q.module is not None:
        _link_woq(q.module)
        return [q.packed, q.col_scale, q.group_scale, q.group_bias, q.aux, bias, _EMPTY, _EMPTY], q.kind, q.group_size
    return None


def _vector(t: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if t is None else t.data.float().contiguous()


class FusedDecodeLayer:
    """One decoder layer's fused blocks: their arguments registered with the compiled module
    (``attn`` / ``mlp`` are the handles; ``mlp`` None: the layer's MLP is not a dense one, or
    its weights do not qualify, and it runs as a module), released when this object goes."""

    def __init__(self, layer: nn.Module, attn: tuple, mlp: tuple | None) -> None:
        self.layer = layer
        self.backend = layer.self_attn.backend  # the blocks stand in for this backend only
        self.module = load()
        self.attn = self.module.register_attn(*attn)  # type: ignore[union-attr]
        self.mlp = None if mlp is None else self.module.register_mlp(*mlp)  # type: ignore[union-attr]
        for handle in (self.attn, self.mlp):
            if handle is not None:
                weakref.finalize(self, self.module.release, handle)  # type: ignore[union-attr]

    def serves(self, layer: nn.Module) -> bool:
        """Whether the blocks still stand for ``layer`` (a test or tool may swap its attention
        backend for another, which must then run). Read through ``_modules``: a step checks
        every layer, and ``nn.Module.__getattr__`` costs microseconds a call when cold."""
        attn = layer._modules.get("self_attn")
        return attn is not None and attn.backend is self.backend

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta):
        # The blocks take (contiguous copies of) the views a previous layer's module path may hand
        # over, and a bfloat16 model's rows, computing in float32; the MLP block hands the model's
        # dtype back.
        dtype = x.dtype
        out, residual = self.module.attn_block(  # type: ignore[union-attr]
            self.attn, x, _EMPTY if residual is None else residual, positions, meta.slot_mapping,
            meta.block_tables, meta.seq_lens)
        if self.mlp is None:
            x, residual = self.layer.post_attention_layernorm(out.to(dtype), residual.to(dtype))
            return self.layer.mlp(x), residual
        return self.module.mlp_block(self.mlp, out, residual, dtype == torch.bfloat16)  # type: ignore[union-attr]


class FusedDecodeStack:
    """A pipeline stage's decoder layers when every one has both fused blocks: a decode step
    runs them all in one C++ call (``layers``) instead of two per layer, and the last stage's
    final RMSNorm with them (``final_norm``; a bfloat16 model's norm as torch ops was about ten
    cold calls per step)."""

    def __init__(self, layers: list[FusedDecodeLayer], final_norm: nn.Module | None = None) -> None:
        self.blocks = layers
        self.module = layers[0].module
        self.attn = [b.attn for b in layers]
        self.mlp = [b.mlp for b in layers]
        self.final_norm = final_norm is not None
        self.final_w = _vector(final_norm.weight) if final_norm is not None else _EMPTY
        self.final_eps = float(final_norm.eps) if final_norm is not None else 0.0

    def serves(self) -> bool:
        """Whether every layer's blocks still stand for it (see ``FusedDecodeLayer.serves``)."""
        return all(b.layer.cpu_decode is b and b.serves(b.layer) for b in self.blocks)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta):
        return self.module.layers(  # type: ignore[union-attr]
            self.attn, self.mlp, x, _EMPTY if residual is None else residual, positions, meta.slot_mapping,
            meta.block_tables, meta.seq_lens, x.dtype == torch.bfloat16, self.final_w, self.final_eps)


def build(layer: nn.Module) -> FusedDecodeLayer | None:
    """The fused blocks of a ``DecoderLayer`` whose attention qualifies (see the module
    docstring; its MLP joins when it qualifies too), else None."""
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend
    from pagoda.layers.norm_rope_act import RMSNorm, RotaryEmbedding
    from pagoda.models.decoder import MLP, SelfAttention

    attn = getattr(layer, "self_attn", None)
    if type(attn) is not SelfAttention or type(attn.backend) is not TorchAttentionBackend or load() is None:
        return None
    qkv, o = _linear_spec(attn.qkv_proj), _linear_spec(attn.o_proj)
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
    rotary, k_cache, v_cache = attn.rotary, attn.k_cache, attn.v_cache
    eps = layer.input_layernorm.eps
    if (qkv is None or o is None or any(n is not None and (type(n) is not RMSNorm or n.eps != eps) for n in norms)
            or type(rotary) is not RotaryEmbedding or rotary.cos_sin_cache.dtype not in _DTYPES
            or rotary.cos_sin_cache.shape[1] > attn.head_dim or attn.k_scale is not None
            or k_cache.dtype not in _DTYPES or k_cache.dim() != 4 or k_cache.stride(-1) != 1
            or k_cache.stride() != v_cache.stride()):
        return None
    tensors = [_vector(layer.input_layernorm.weight), _vector(attn.q_norm.weight if attn.q_norm else None),
               _vector(attn.k_norm.weight if attn.k_norm else None), rotary.cos_sin_cache.float().contiguous(),
               k_cache, v_cache]
    ints = [attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.sliding_window or 0, qkv[1], qkv[2], o[1], o[2]]
    attn_args = (tensors, qkv[0], o[0], ints, [float(eps), float(attn.scale)])
    mlp_args = None
    mlp = layer.mlp
    if type(mlp) is MLP:
        gate_up, down = _linear_spec(mlp.gate_up_proj), _linear_spec(mlp.down_proj)
        if gate_up is not None and down is not None:
            mlp_args = (_vector(layer.post_attention_layernorm.weight), gate_up[0], down[0],
                        [gate_up[1], gate_up[2], down[1], down[2]], float(eps))
    return FusedDecodeLayer(layer, attn_args, mlp_args)


def attach(model: nn.Module) -> int:
    """Give every qualifying decoder layer of ``model`` its fused blocks (after the KV cache is
    allocated: the blocks hold the layer's cache tensors). Returns how many layers qualified."""
    from pagoda.layers.norm_rope_act import RMSNorm
    from pagoda.models.decoder import DecoderLayer, DecoderModel

    count = 0
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            module.cpu_decode = build(module)
            count += module.cpu_decode is not None
    for module in model.modules():  # a stage whose layers all fused both blocks runs as one call
        if isinstance(module, DecoderModel) and module.stage_layers:
            blocks = [layer.cpu_decode for layer in module.stage_layers]
            full = all(b is not None and b.mlp is not None for b in blocks)
            norm = module.norm if module.is_last and type(module.norm) is RMSNorm else None
            module.cpu_decode_stack = FusedDecodeStack(blocks, norm) if full else None
    if count:
        logger.info("fused CPU decode blocks for %d layers", count)
    return count


def applies(meta, x: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether this step runs the fused blocks: all decodes (one token per sequence), at most
    ``MAX_ROWS`` of them, float32 or bfloat16 rows, and the Triton kernels not forced onto CPU tensors
    (``PAGODA_FORCE_TRITON=1``, the tests of those kernels). Decided once per step (the layers
    share ``meta``)."""
    ok = getattr(meta, "_cpu_decode_ok", None)
    if ok is None:
        n = len(meta.query_lens_cpu)
        ok = (0 < n <= MAX_ROWS and meta.max_query_len == 1 and int(meta.slot_mapping.shape[0]) == n
              and os.environ.get("PAGODA_FORCE_TRITON") != "1"
              and positions.dim() == 1 and positions.dtype == torch.int64 and x.dtype in _DTYPES
              and x.dim() == 2)
        meta._cpu_decode_ok = ok
    return ok
