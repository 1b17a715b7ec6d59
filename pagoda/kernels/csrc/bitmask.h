// bitmask.h: the entry point of bitmask.cpp (design notes there).
#pragma once

#include "pagoda.h"

namespace pagoda::bitmask {

// logits[r, t] = -inf (in place) where bit t % 32 of bitmask[r, t / 32] is clear.
void apply_bitmask(at::Tensor logits, at::Tensor bitmask);

}  // namespace pagoda::bitmask
