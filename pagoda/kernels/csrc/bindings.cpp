// bindings.cpp: the op table of one kernel variant (_C_scalar, _C_avx2, _C_avx512, or a developer's
// JIT build): every kernel registered with the torch dispatcher (TORCH_LIBRARY) under a schema,
// and the minimal Python module whose import loads the library. The only translation unit that
// includes torch/library.h and Python.h; the kernels themselves include only ATen (pagoda.h).
//
// Design notes
// - One namespace per variant (`pagoda_avx2::gemv`, `pagoda_avx512::gemv` ...), named by the
//   PAGODA_OPS_NAMESPACE compile definition (build.py: `pagoda_<variant>`, `pagoda_<variant>_jit`
//   for a JIT build), so several variants (and a JIT build beside an installed one) load in one
//   process: the tests compare them. Python reaches them as `torch.ops.<namespace>.<op>` through
//   pagoda/kernels/build.py alone (the module's `ops_namespace` names it); no other code spells it.
// - Every kernel is linked into the same library, so kernels that use one another (the fused
//   decode blocks call the gemv, attention, norm, tile and quantized kernels) call each other
//   directly as C++; nothing is handed across as an address.
// - Each op is a catch-all kernel (CompositeImplicitAutograd): the cheapest dispatch, and the ops
//   are inference kernels (no autograd formulas). Calls through torch.ops run without the GIL
//   (the dispatcher releases it around every op and class method), which --async-scheduling
//   needs: the engine's scheduler prepares the next step while the kernels stream weights.
// - `Tensor?` where a kernel takes "no tensor": None arrives as one shared empty tensor, which is
//   what the kernels test for (`numel() == 0`). `Tensor(a!)`: an output written in place.
// - State that lives across calls takes two forms:
//   * the multi-step greedy round (fused.h's GreedyRound) is a torch custom class
//     (`torch.classes.<namespace>.GreedyRound`, made by the `greedy_round` op): one object per
//     round, freed when Python drops it, with methods (`step`, `tokens`, `embed_inputs`) and one
//     property (`x`);
//   * the fused decode blocks' registrations (decode.cpp) stay plain ops on integer handles
//     (`decode_register_attn` -> int, `decode_release(int)`): decode.cpp owns the registry, and a
//     step passes a stage's handles as one `int[]` to `decode_layers`, which a list of class
//     objects would make costlier to convert on every step. The registered tensors (the layer's
//     KV cache among them) are written by later `decode_attn_block` / `decode_layers` calls,
//     which their schemas cannot say: these ops are for eager calls, not for tracing.
#include <Python.h>  // first, as Python asks

#include <torch/custom_class.h>
#include <torch/library.h>

#include "pagoda.h"

#include "amx.h"
#include "attention.h"
#include "bitmask.h"
#include "decode.h"
#include "fused.h"
#include "gemv.h"
#include "moe.h"
#include "panel.h"
#include "woq.h"

#define PAGODA_CAT_(a, b) a##b
#define PAGODA_CAT(a, b) PAGODA_CAT_(a, b)
#ifndef PAGODA_OPS_NAMESPACE
#define PAGODA_OPS_NAMESPACE PAGODA_CAT(pagoda_, PAGODA_VARIANT_NAME)
#endif
#define PAGODA_OPS_NS PAGODA_STRINGIFY(PAGODA_OPS_NAMESPACE)
// TORCH_LIBRARY pastes its namespace argument: one level more so that the macro is expanded first.
#define PAGODA_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

using namespace pagoda;

namespace {

// The kernels' "no tensor": one empty float32 tensor, never freed (a function-local static would be
// destroyed at exit, after torch's allocator may be).
const at::Tensor& none_tensor() {
  static const at::Tensor* empty = new at::Tensor(at::empty({0}));
  return *empty;
}

const at::Tensor& or_none(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? *t : none_tensor();
}

void paged_decode(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                  at::Tensor seq_lens, double scale, int64_t window, std::optional<at::Tensor> k_scale,
                  std::optional<at::Tensor> v_scale, double softcap) {
  attn::paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, scale, window, or_none(k_scale),
                     or_none(v_scale), softcap);
}

void woq_linear(at::Tensor out, at::Tensor x, at::Tensor w, int64_t kind, std::optional<at::Tensor> col_scale,
                std::optional<at::Tensor> group_scale, std::optional<at::Tensor> group_bias, int64_t group_size,
                std::optional<at::Tensor> aux, std::optional<at::Tensor> bias) {
  woq::woq_linear(out, x, w, kind, or_none(col_scale), or_none(group_scale), or_none(group_bias), group_size,
                  or_none(aux), or_none(bias));
}

std::vector<at::Tensor> attn_block(int64_t handle, at::Tensor x, std::optional<at::Tensor> residual,
                                   at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                                   at::Tensor seq_lens) {
  return decode::attn_block(handle, x, or_none(residual), positions, slots, block_tables, seq_lens);
}

std::vector<at::Tensor> layers(std::vector<int64_t> attn_handles, std::vector<int64_t> mlp_handles, at::Tensor x,
                               std::optional<at::Tensor> residual, at::Tensor positions, at::Tensor slots,
                               at::Tensor block_tables, at::Tensor seq_lens, bool bf16_out,
                               std::optional<at::Tensor> final_w, double final_eps) {
  return decode::layers(std::move(attn_handles), std::move(mlp_handles), x, or_none(residual), positions, slots,
                        block_tables, seq_lens, bf16_out, or_none(final_w), final_eps);
}

// The greedy round as a custom class: fused::GreedyRound held by reference count.
struct GreedyRound : torch::CustomClassHolder {
  fused::GreedyRound round;

  GreedyRound(at::Tensor ids, at::Tensor positions, at::Tensor context_lens, at::Tensor seq_lens, at::Tensor slots,
              at::Tensor tables, int64_t block_size, const at::Tensor& embed, std::vector<std::vector<int64_t>> ends,
              int64_t steps)
      : round(ids, positions, context_lens, seq_lens, slots, tables, block_size, embed, std::move(ends), steps) {}
};

c10::intrusive_ptr<GreedyRound> greedy_round(at::Tensor ids, at::Tensor positions, at::Tensor context_lens,
                                             at::Tensor seq_lens, at::Tensor slots, at::Tensor tables,
                                             int64_t block_size, std::optional<at::Tensor> embed,
                                             std::vector<std::vector<int64_t>> ends, int64_t steps) {
  return c10::make_intrusive<GreedyRound>(ids, positions, context_lens, seq_lens, slots, tables, block_size,
                                          or_none(embed), std::move(ends), steps);
}

}  // namespace

PAGODA_TORCH_LIBRARY(PAGODA_OPS_NAMESPACE, m) {
  // gemv.h: the one-to-four-row float32/bfloat16 matrix-vector product
  m.def("gemv(Tensor x, Tensor weight) -> Tensor", &gemv_k::gemv);

  // attention.h: paged decode attention (k_scale/v_scale: an int8/fp8 cache's scales)
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, Tensor? k_scale, Tensor? v_scale, float softcap) -> ()",
        &paged_decode);

  // fused.h: the elementwise decoder-layer ops and the greedy argmax
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &fused::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor[]", &fused::add_rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &fused::silu_and_mul);
  m.def("rotate(Tensor x, Tensor positions, Tensor cos_sin_cache) -> Tensor", &fused::rotate);
  m.def("greedy_tokens(Tensor logits, int[] rows) -> int[]", &fused::greedy_tokens);
  m.class_<GreedyRound>("GreedyRound")
      .def("step", [](const c10::intrusive_ptr<GreedyRound>& self, at::Tensor logits,
                      bool advance) { return self->round.step(logits, advance); })
      .def("tokens", [](const c10::intrusive_ptr<GreedyRound>& self) { return self->round.out; })
      .def("embed_inputs", [](const c10::intrusive_ptr<GreedyRound>& self) { return self->round.embed_inputs(); })
      .def_property("x", [](const c10::intrusive_ptr<GreedyRound>& self) { return self->round.x; });
  // The round holds the step's input tensors and moves them on in place at each `step` (which no
  // schema can say, as for the decode handles below).
  m.def("greedy_round(Tensor input_ids, Tensor positions, Tensor context_lens, Tensor seq_lens, "
        "Tensor slot_mapping, Tensor block_tables, int block_size, Tensor? embed, int[][] ends, int steps) -> "
        "__torch__.torch.classes." PAGODA_OPS_NS ".GreedyRound",
        &greedy_round);

  // moe.h: the routed experts of a mixture-of-experts layer in one call
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2, int first_expert, "
        "int intermediate) -> Tensor",
        &moe::moe_experts);

  // woq.h: weight-only quantized products (kind 0 int8, 1 fp8, 2 int4, 3 int8 in groups)
  m.def("woq_available() -> bool", &woq::available);
  m.def("woq_has_kind(int kind) -> bool", &woq::has_kind);
  m.def("woq_set_vnni(bool on) -> bool", &woq::set_vnni);
  m.def("woq_vnni() -> bool", &woq::vnni);
  m.def("woq_linear(Tensor(a!) out, Tensor x, Tensor weight, int kind, Tensor? col_scale, Tensor? group_scale, "
        "Tensor? group_bias, int group_size, Tensor? aux, Tensor? bias) -> ()",
        &woq_linear);

  // amx.h: the AMX bfloat16 tile product (compiled into the avx512 variant)
  m.def("amx_compiled() -> bool", &amx::compiled);
  m.def("amx_available() -> bool", &amx::available);
  m.def("amx_pack(Tensor weight) -> Tensor", &amx::pack);
  m.def("amx_linear(Tensor x, Tensor packed, int out_features) -> Tensor", &amx::linear);

  // panel.h: the float32/bfloat16 panel product
  m.def("panel_available() -> bool", &panel::available);
  m.def("panel_available_bf16() -> bool", &panel::available_bf16);
  m.def("panel_pack(Tensor weight) -> Tensor", &panel::pack);
  m.def("panel_pack_bf16(Tensor weight) -> Tensor", &panel::pack_bf16);
  m.def("panel_linear(Tensor x, Tensor packed, int out_features) -> Tensor", &panel::linear);

  // bitmask.h: grammar bitmasks applied to logits in place
  m.def("apply_bitmask(Tensor(a!) logits, Tensor bitmask) -> ()", &bitmask::apply_bitmask);

  // decode.h: the fused decoder-layer blocks over registered layers (integer handles)
  m.def("decode_register_attn(Tensor[] tensors, Tensor[] qkv, Tensor[] o, int[] ints, float[] floats) -> int",
        &decode::register_attn);
  m.def("decode_register_mlp(Tensor norm_weight, Tensor[] gate_up, Tensor[] down, int[] ints, float eps) -> int",
        &decode::register_mlp);
  m.def("decode_release(int handle) -> ()", &decode::release);
  m.def("decode_attn_block(int handle, Tensor x, Tensor? residual, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens) -> Tensor[]",
        &attn_block);
  m.def("decode_mlp_block(int handle, Tensor x, Tensor residual, bool bf16_out) -> Tensor[]", &decode::mlp_block);
  m.def("decode_layers(int[] attn_handles, int[] mlp_handles, Tensor x, Tensor? residual, Tensor positions, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, bool bf16_out, Tensor? final_weight, "
        "float final_eps) -> Tensor[]",
        &layers);
}

// The Python module: importing it loads the library (and so registers the ops above); it carries
// the variant's name and the op namespace.
static PyModuleDef pagoda_module = {PyModuleDef_HEAD_INIT, PAGODA_STRINGIFY(TORCH_EXTENSION_NAME),
                                    "pagoda's CPU kernels, variant " PAGODA_VARIANT ": torch.ops." PAGODA_OPS_NS,
                                    -1, nullptr};

PyMODINIT_FUNC PAGODA_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* module = PyModule_Create(&pagoda_module);
  if (module != nullptr && (PyModule_AddStringConstant(module, "variant", PAGODA_VARIANT) < 0 ||
                            PyModule_AddStringConstant(module, "ops_namespace", PAGODA_OPS_NS) < 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
