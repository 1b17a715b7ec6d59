// decode.cpp: whole decoder-layer blocks in one call each, for the decode steps on CPU.
//
// Design notes
// - A batch-1 decode step of a small model is a few milliseconds of weight streaming, and around
//   it every layer made about thirty small calls from Python (norms, the projections' split and
//   reshapes, rotary, the cache write and its checks, paged attention, SiLU-and-mul), each a few
//   microseconds on its own and more inside a step whose weights have cooled every cache level.
// - attn_block: residual add + RMSNorm, the fused q/k/v projection (+ bias), q/k RMSNorm (Qwen3),
//   rotary, the K/V written into the paged cache, paged decode attention (sliding window
//   included) and the output projection. mlp_block: residual add + RMSNorm, gate/up, SiLU-and-mul,
//   down. `layers` runs a stack of them.
// - The pieces are the other kernels' own code (gemv.h's loops, attention.h's attention,
//   fused.h's norms and SiLU), included as headers, and the products go to the kernel the layer
//   itself would use: amx.h's or panel.h's tile kernel, the gemv loop for up to four rows,
//   oneDNN over the weight the layer packed (through the dispatcher), or woq.h's kernel, all
//   linked into this library. What qualifies a layer is decided in Python
//   (pagoda/models/cpu_decode.py), once, when the KV cache is attached.
#include "pagoda.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <unordered_map>

#include "amx.h"
#include "decode.h"
#include "fused.h"
#include "gemv.h"
#include "panel.h"
#include "woq.h"
// The attention loops are built with fast-math (attention.h's notes), here as in attention.cpp.
#pragma GCC push_options
#pragma GCC optimize("fast-math")
#include "attention.h"
#pragma GCC pop_options

namespace pagoda::decode {

namespace {

// The products the blocks call: this library's own kernels, linked directly (a variant without
// one has its stub, which reports itself unavailable; make_linear refuses such layers).
constexpr auto woq_fn = &woq::woq_linear;
constexpr auto amx_fn = &amx::amx_linear;
constexpr auto panel_fn = &panel::panel_linear;
constexpr auto panel_bf16_fn = &panel::panel_linear_bf16;

// One linear layer. kind -1: a float32 or bfloat16 [N, K] weight, dense `w` (kept where the gemv
// kernel serves few rows; else empty) and/or `packed` in oneDNN's layout (or empty), and/or `tiles`
// for up to `group` rows (or empty: cpu_panel's float32 panels [P, K, 16], cpu_panel's bfloat16
// panels [P, K/2, 16, 2], or cpu_amx's flat bfloat16 layout), plus `bias`.
// Kinds >= 0: cpu_woq's packed weight and its tensors, `n` output features (a GGUF Q8_0 matrix is
// kind 3, int8 in groups).
struct Linear {
  at::Tensor w, col_scale, gs, gb, aux, bias, packed, tiles;
  int64_t kind, group, n;
};

Linear make_linear(const std::vector<at::Tensor>& t, int64_t kind, int64_t group) {
  TORCH_CHECK(t.size() == 8, "fused decode: eight tensors per linear layer");
  TORCH_CHECK(kind < 0 || woq::has_kind(kind), "fused decode: quantized layer without the quantized kernel");
  const bool tiles = kind < 0 && t[7].numel();
  // A dense layer with tiles: `group` = N + (the most rows the tiles serve) << 32.
  const int64_t n = tiles ? (group & 0xFFFFFFFFLL) : kind >= 0 ? t[0].size(0) * 16 : -1, rows = tiles ? group >> 32 : 0;
  const bool linked = t[7].scalar_type() == at::kFloat ? panel::available()
                      : t[7].scalar_type() != at::kBFloat16 ? false
                      : t[7].dim() == 4 ? panel::available_bf16() : amx::available();
  TORCH_CHECK(!tiles || (linked && n > 0 && rows > 0),
              "fused decode: tiles without their kernel, the output size or the row limit");
  return Linear{t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], kind, tiles ? rows : group, n};
}

// oneDNN's linear over a weight packed by cpu_gemm (the op the module path calls), through the
// dispatcher.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias.defined() && bias.numel() ? c10::IValue(bias) : c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [M, K] @ W^T (+ bias) as a new contiguous float32 [M, N] tensor. Dense weights: the tile
// kernel (AMX or panel) for as many rows as the layer chose it for, the gemv loop for up to four
// rows where the layer kept its dense weight, else oneDNN.
at::Tensor linear(const Linear& l, const at::Tensor& x) {
  const int64_t M = x.size(0);
  if (l.kind >= 0) {
    at::Tensor y = at::empty({M, l.n}, x.options());
    woq_fn(y, x, l.w, l.kind, l.col_scale, l.gs, l.gb, l.group, l.aux, l.bias);
    return y;
  }
  at::Tensor y;
  if (l.tiles.numel() && M <= l.group) {
    y = at::empty({M, l.n}, x.options());
    if (l.tiles.scalar_type() == at::kFloat)
      panel_fn(y.data_ptr<float>(), l.n, x.data_ptr<float>(), x.stride(0), M, x.size(1), l.tiles.data_ptr<float>(),
               l.n);
    else
      (l.tiles.dim() == 4 ? panel_bf16_fn : amx_fn)(y.data_ptr<float>(), l.n, x.data_ptr<float>(), false,
                                                    x.stride(0), M, x.size(1), l.tiles.data_ptr<at::BFloat16>(), l.n);
  } else if (l.packed.numel() && (M > 4 || !l.w.numel())) {
    if (l.packed.scalar_type() == at::kFloat) return onednn_linear(x, l.packed, l.bias).contiguous();
    // A bfloat16 weight (a bfloat16 model): oneDNN takes bfloat16 rows; the bias is added below
    // in float32, as the gemv path does.
    TORCH_CHECK(l.packed.scalar_type() == at::kBFloat16, "fused decode: packed weight dtype");
    y = onednn_linear(x.to(at::kBFloat16), l.packed, at::Tensor()).to(at::kFloat).contiguous();
  } else {
    TORCH_CHECK(l.w.numel(), "fused decode: no kernel for this layer's rows");
    const int64_t N = l.w.size(0), K = l.w.size(1);
    y = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const bool bf16 = l.w.scalar_type() == at::kBFloat16;
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
std::vector<at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
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

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1,
              "fused decode: contiguous float32 rows expected");
}

// Round contiguous float32 values to the nearest bfloat16 (ties to even, as a conversion does), in place.
// Chunk by chunk through the elementwise kernel's vector conversions (the same rounding).
void round_bf16(at::Tensor& t) {
  float* p = t.data_ptr<float>();
  const int64_t n = t.numel();
  at::BFloat16 tmp[256];
  for (int64_t i = 0; i < n; i += 256) {
    const int64_t c = std::min<int64_t>(256, n - i);
    fused::narrow_row(p + i, tmp, c);
    fused::widen_row(tmp, p + i, c);
  }
}

// A bfloat16 model's rows, widened for the float32 arithmetic of the blocks (float32 rows as they are).
at::Tensor widened(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 ? x.to(at::kFloat).contiguous() : x.contiguous();
}

}  // namespace


// One layer's attention block, as registered: input norm weight, q-norm and k-norm weights (or
// empty), cos|sin table [max_pos, rot], K and V caches (float32 or bfloat16 [blocks, block_size,
// Hkv, D], unit stride on D), the q/k/v and output projections, head counts and size, sliding
// window (0: none), norm eps and attention scale.
struct AttnArgs {
  at::Tensor norm_w, qn, kn, cs, kc, vc;
  Linear qkv, o;
  int64_t H, Hkv, D, window;
  double eps, scale;
};

// One dense MLP block, as registered: its norm weight, gate/up and down projections, norm eps.
struct MlpArgs {
  at::Tensor norm_w;
  Linear gu, down;
  double eps;
};

// The attention block for M decode rows (row m = the next token of sequence m).
// Returns {attention block output [M, Hd] float32, the residual stream x (+ residual)}.
static std::vector<at::Tensor> attn_impl(const AttnArgs& a, at::Tensor x, at::Tensor residual,
                                            const at::Tensor& positions, const at::Tensor& slots,
                                            const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  x = widened(x);
  if (residual.numel()) residual = widened(residual);
  check_rows(x);
  const int64_t M = x.size(0), Hd = x.size(1);
  const int64_t H = a.H, Hkv = a.Hkv, D = a.D;
  const int64_t QS = H * D, KS = Hkv * D, NQKV = QS + 2 * KS;
  const float eps = static_cast<float>(a.eps);
  const at::Tensor &qn = a.qn, &kn = a.kn, &cs = a.cs, &kc = a.kc, &vc = a.vc;
  TORCH_CHECK(positions.numel() == M && slots.numel() == M && block_tables.size(0) == M && seq_lens.numel() == M,
              "fused decode: one position, slot, block table and length per row");
  const bool bf16_cache = kc.scalar_type() == at::kBFloat16;
  auto opts = x.options();
  const std::vector<at::Tensor> hr = add_norm(x, residual, a.norm_w, a.eps);
  const at::Tensor &h = hr[0], &r = hr[1];

  at::Tensor qkv = linear(a.qkv, h);
  TORCH_CHECK(qkv.size(1) == NQKV, "fused decode: q/k/v projection width");
  float* qkvp = qkv.data_ptr<float>();

  at::Tensor q = at::empty({M, H, D}, opts);
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
        fused::narrow_row(kr, kd, D);
        fused::narrow_row(vr, vd, D);
      } else {
        std::memcpy(kcp + pos_b, kr, D * sizeof(float));
        std::memcpy(vcp + pos_b, vr, D * sizeof(float));
      }
    }
  });

  at::Tensor att = at::empty({M, QS}, opts);
  attn::Cache c{kcp, vcp, nullptr, nullptr, sb, ss, sh, 0, 0, 0};
  at::Tensor bt = block_tables.contiguous(), sl = seq_lens.contiguous();
  const float scale = static_cast<float>(a.scale);
  if (bf16_cache)
    attn::run<attn::BF16, false>(att.data_ptr<float>(), qp, c, bt.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), M, H,
                                 D, Hkv, bs, bt.size(1), scale, a.window);
  else
    attn::run<attn::F32, false>(att.data_ptr<float>(), qp, c, bt.data_ptr<int32_t>(), sl.data_ptr<int32_t>(), M, H,
                                D, Hkv, bs, bt.size(1), scale, a.window);
  at::Tensor o = linear(a.o, att);
  TORCH_CHECK(o.size(1) == Hd, "fused decode: output projection width");
  return {o, r};
}

// The dense MLP block: r = x + residual, out = down(silu(gate(h)) * up(h)) with
// h = rms_norm(r) * w. Returns {out, r}, in bfloat16 when ``bf16_out``.
static std::vector<at::Tensor> mlp_impl(const MlpArgs& a, const at::Tensor& x, const at::Tensor& residual,
                                           bool bf16_out) {
  check_rows(x);
  const int64_t Hd = x.size(1);
  TORCH_CHECK(residual.numel(), "fused decode: the MLP block needs the residual");
  const std::vector<at::Tensor> hr = add_norm(x, residual, a.norm_w, a.eps);
  at::Tensor out = linear(a.down, fused::silu_and_mul(linear(a.gu, hr[0])));
  TORCH_CHECK(out.size(1) == Hd, "fused decode: down projection width");
  if (bf16_out) return {out.to(at::kBFloat16), hr[1].to(at::kBFloat16)};  // a bfloat16 model's rows
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
int64_t register_attn(std::vector<at::Tensor> t, std::vector<at::Tensor> qkv_t, std::vector<at::Tensor> o_t,
                      std::vector<int64_t> iv, std::vector<double> fv) {
  TORCH_CHECK(t.size() == 6 && iv.size() == 8 && fv.size() == 2, "fused decode: attention block arguments");
  const at::Tensor &kc = t[4], &vc = t[5];
  TORCH_CHECK((kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16) &&
                  kc.scalar_type() == vc.scalar_type() && kc.dim() == 4 && kc.stride(3) == 1 &&
                  kc.strides() == vc.strides(),
              "fused decode: float32 or bfloat16 K/V caches with the same strides");
  TORCH_CHECK(t[3].scalar_type() == at::kFloat && t[3].is_contiguous(), "fused decode: float32 rotary table");
  attn_args[++last_handle] = AttnArgs{t[0], t[1], t[2], t[3], kc, vc, make_linear(qkv_t, iv[4], iv[5]),
                                      make_linear(o_t, iv[6], iv[7]), iv[0], iv[1], iv[2], iv[3], fv[0], fv[1]};
  return last_handle;
}

// gu_t, down_t: the projections' tensors; iv: kind and group of gate_up and of down.
int64_t register_mlp(at::Tensor norm_w, std::vector<at::Tensor> gu_t, std::vector<at::Tensor> down_t,
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
std::vector<at::Tensor> attn_block(int64_t handle, at::Tensor x, at::Tensor residual, at::Tensor positions,
                                      at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens) {
  const auto it = attn_args.find(handle);
  TORCH_CHECK(it != attn_args.end(), "fused decode: unknown attention block ", handle);
  return attn_impl(it->second, x, residual, positions, slots, block_tables, seq_lens);
}

// One MLP block with the arguments registered under ``handle``; ``bf16_out``: hand bfloat16 rows back.
std::vector<at::Tensor> mlp_block(int64_t handle, at::Tensor x, at::Tensor residual, bool bf16_out) {
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
std::vector<at::Tensor> layers(std::vector<int64_t> attn_handles, std::vector<int64_t> mlp_handles, at::Tensor x,
                                  at::Tensor residual, at::Tensor positions, at::Tensor slots,
                                  at::Tensor block_tables, at::Tensor seq_lens, bool bf16_out,
                                  at::Tensor final_w, double final_eps) {
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
  std::vector<at::Tensor> xr{x, residual};
  const size_t L = attn.size();
  for (size_t i = 0; i < L; ++i) {
    const std::vector<at::Tensor> ar = attn_impl(*attn[i], xr[0], xr[1], positions, slots, block_tables, seq_lens);
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
  at::Tensor sum = xr[0] + xr[1];  // float32 sums of bfloat16 values, rounded as a bfloat16 add
  round_bf16(sum);
  return {fused::rms_norm(sum, final_w, final_eps).to(at::kBFloat16), sum};
}

}  // namespace pagoda::decode
