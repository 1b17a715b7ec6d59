// The header every kernel source that takes at::Tensor includes first: core.h (the standard and
// intrinsics headers, the element types, parallel_for) plus the few ATen headers the ops use
// (the tensor type, its factory functions; not torch/extension.h, whose autograd, nn and
// pybind11 headers cost each translation unit many seconds to parse, and every kernel is
// compiled once per instruction-set variant). Only bindings.cpp adds torch/library.h (the op table) and Python.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "core.h"
