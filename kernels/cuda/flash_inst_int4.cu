// Explicit instantiation of the attention kernel for the int4 cache
// (one file per cache type so that a two-core build compiles them in parallel).
#include "flash_impl.cuh"

namespace attnd {
ATTND_FLASH_INST(ATTND_KV_INT4)
} // namespace attnd
