// The one header every kernel source includes first: the few ATen headers the kernels use (the
// tensor type, its factory functions and at::parallel_for; not torch/extension.h, whose autograd,
// nn and pybind11 headers cost each translation unit many seconds to parse, and every kernel is
// compiled once per instruction-set variant), the standard headers, and the x86 intrinsics where
// the variant's flags allow them. Only bindings.cpp includes pybind11.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>
#endif

// The variant this translation unit is compiled for, as a string: the build passes its name
// unquoted (-DPAGODA_VARIANT_NAME=avx2; quotes do not survive every build tool's shell).
#ifndef PAGODA_VARIANT_NAME
#define PAGODA_VARIANT_NAME native
#endif
#define PAGODA_STRINGIFY_(x) #x
#define PAGODA_STRINGIFY(x) PAGODA_STRINGIFY_(x)
#define PAGODA_VARIANT PAGODA_STRINGIFY(PAGODA_VARIANT_NAME)
