// Explicit instantiation of the attention kernel for the fp8 cache
// (one file per cache type so that a two-core build compiles them in parallel).
#include "flash_impl.cuh"

namespace attnd {
ATTND_FLASH_INST(ATTND_KV_FP8)
} // namespace attnd
