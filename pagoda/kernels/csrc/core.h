// core.h: what a kernel core needs and nothing of torch's tensor library: the standard headers,
// the x86 intrinsics the variant's flags allow, c10's header-only BFloat16/Half element types,
// the variant's name, and `pagoda::parallel_for` / `pagoda::num_threads`.
//
// Design notes
// - A kernel core (the loops of attention.h, the rows of fused.h, gemv.h's products) includes
//   this header, not pagoda.h, so it builds without ATen: with -DPAGODA_CORE_ONLY it compiles
//   for any target with only torch's include folder (tests/kernels/cpp builds the cores that way
//   for every x86 variant and, with Debian's aarch64 cross-compiler, for NEON under qemu).
// - In the library (no PAGODA_CORE_ONLY) parallel_for is at::parallel_for on torch's intra-op
//   thread pool; in a core-only build it runs the whole range on the calling thread.
// - A kernel header's ATen entry points (the ops taking at::Tensor) sit in its closing
//   `#if !defined(PAGODA_CORE_ONLY)` section.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

#if !defined(PAGODA_CORE_ONLY)
#include <ATen/Parallel.h>
#endif

// The variant this translation unit is compiled for, as a string: the build passes its name
// unquoted (-DPAGODA_VARIANT_NAME=avx2; quotes do not survive every build tool's shell).
#ifndef PAGODA_VARIANT_NAME
#define PAGODA_VARIANT_NAME native
#endif
#define PAGODA_STRINGIFY_(x) #x
#define PAGODA_STRINGIFY(x) PAGODA_STRINGIFY_(x)
#define PAGODA_VARIANT PAGODA_STRINGIFY(PAGODA_VARIANT_NAME)

namespace pagoda {

#if defined(PAGODA_CORE_ONLY)
inline int64_t num_threads() { return 1; }
// fn(begin, end) over [begin, end) in one call on this thread.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t /*grain*/, const F& fn) {
  if (begin < end) fn(begin, end);
}
#else
inline int64_t num_threads() { return at::get_num_threads(); }
// fn(lo, hi) over chunks of [begin, end) on torch's intra-op threads.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  at::parallel_for(begin, end, grain, fn);
}
#endif

}  // namespace pagoda
