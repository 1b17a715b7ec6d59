// bindings.cpp: the Python module of one kernel variant (_C_scalar, _C_avx2, _C_avx512, or a
// developer's JIT build), one submodule per kernel. The only translation unit that includes
// pybind11 (with torch's tensor casters; not torch/extension.h, whose C++ frontend headers took
// twice as long to parse); the kernels themselves include only ATen (pagoda.h).
//
// Every kernel is linked into the same library, so kernels that use one another (the fused decode
// blocks call the gemv, attention, norm, tile and quantized kernels) call each other directly.
// Classes are module-local so that two variants can be loaded in one process (the tests compare
// them).
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

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

namespace py = pybind11;
using namespace pagoda;

// The kernels that stream weights or the KV cache run without the GIL: they touch no Python
// object, and another Python thread (the engine's scheduler under --async-scheduling, which
// prepares the next step while this one runs) can then work meanwhile.
static const auto nogil = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("variant") = PAGODA_VARIANT;

  auto g = m.def_submodule("gemv", "one-to-four-row float32/bfloat16 matrix-vector products");
  g.def("gemv", &gemv_k::gemv, nogil);

  auto a = m.def_submodule("attention", "paged decode attention");
  a.def("paged_decode", &attn::paged_decode, nogil);

  auto f = m.def_submodule("fused", "elementwise decoder-layer ops and the greedy argmax");
  f.def("rms_norm", &fused::rms_norm);
  f.def("add_rms_norm", &fused::add_rms_norm);
  f.def("silu_and_mul", &fused::silu_and_mul);
  f.def("rotate", &fused::rotate);
  f.def("greedy_tokens", &fused::greedy_tokens);
  py::class_<fused::GreedyRound>(f, "GreedyRound", py::module_local())
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, at::Tensor,
                    std::vector<std::vector<int64_t>>, int64_t>())
      .def("step", &fused::GreedyRound::step)
      .def("tokens", &fused::GreedyRound::tokens)
      .def("embed_inputs", &fused::GreedyRound::embed_inputs)
      .def_readonly("x", &fused::GreedyRound::x);

  auto e = m.def_submodule("moe", "mixture-of-experts experts in one call");
  e.def("moe_experts", &moe::moe_experts, nogil);

  auto q = m.def_submodule("woq", "weight-only quantized matmuls (int8, int4, fp8)");
  q.def("available", &woq::available);
  q.def("has_kind", &woq::has_kind);
  q.def("set_vnni", &woq::set_vnni);
  q.def("vnni", &woq::vnni);
  q.def("woq_linear", &woq::woq_linear, nogil);

  auto x = m.def_submodule("amx", "AMX bfloat16 tile matmul");
  x.def("compiled", &amx::compiled);
  x.def("available", &amx::available);
  x.def("pack", &amx::pack);
  x.def("linear", &amx::linear, nogil);

  auto p = m.def_submodule("panel", "float32/bfloat16 panel matmul");
  p.def("available", &panel::available);
  p.def("available_bf16", &panel::available_bf16);
  p.def("pack", &panel::pack);
  p.def("pack_bf16", &panel::pack_bf16);
  p.def("linear", &panel::linear, nogil);

  auto b = m.def_submodule("bitmask", "grammar bitmasks applied to logits");
  b.def("apply_bitmask", &bitmask::apply_bitmask);

  auto d = m.def_submodule("decode", "fused decoder-layer blocks");
  d.def("register_attn", &decode::register_attn);
  d.def("register_mlp", &decode::register_mlp);
  d.def("release", &decode::release);
  d.def("attn_block", &decode::attn_block, nogil);
  d.def("mlp_block", &decode::mlp_block, nogil);
  d.def("layers", &decode::layers, nogil);
}
