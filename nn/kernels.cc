// The one definition of each op: shape and dtype rules, checked before any device runs it.
#include "nn/kernels.h"

#include "base/check.h"

namespace porter::nn {

// Validation bodies are written with the cpu kernels (see the kernels issue); this file
// must stay device-agnostic.

}  // namespace porter::nn
