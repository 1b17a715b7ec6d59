// bitmask.cpp: applying grammar bitmasks to float32 logits in one pass over the batch.
//
// Design notes
// - A bitmask row is ceil(vocab / 32) int32 words, bit t % 32 of word t / 32 set when token t is
//   allowed. The words are walked once: an all-ones word is skipped, an all-zeros word (the common
//   case for a JSON grammar, which allows few tokens) writes 32 -inf at once, and only mixed words
//   are read bit by bit. At batch 32 x 32000 this took 0.28 ms of CPU against 1.3 for an
//   unpack-and-fill in torch, which matters on a two-core machine where nothing hides that work.
// - Plain scalar code: the loop is bound by the stores of -inf, which the compiler vectorises.
#include "pagoda.h"
#include "bitmask.h"

namespace pagoda::bitmask {

void apply_bitmask(at::Tensor logits, at::Tensor bitmask) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "apply_bitmask: float32 logits rows with unit inner stride");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "apply_bitmask: an int32 [rows, ceil(vocab / 32)] bitmask");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0), W = bitmask.size(1);
  float* base_row = logits.data_ptr<float>();
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -INFINITY;
  const int64_t words = (V + 31) / 32;
  for (int64_t r = 0; r < R; ++r) {
    float* row = base_row + r * ld;
    const uint32_t* m = mask + r * W;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xffffffffu) continue;
      const int64_t base = w * 32;
      const int64_t n = V - base < 32 ? V - base : 32;
      float* out = row + base;
      if (bits == 0) {
        for (int64_t j = 0; j < n; ++j) out[j] = ninf;
      } else {
        for (int64_t j = 0; j < n; ++j)
          if (!((bits >> j) & 1u)) out[j] = ninf;
      }
    }
  }
}

}  // namespace pagoda::bitmask
