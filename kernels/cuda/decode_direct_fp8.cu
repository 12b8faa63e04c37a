// Explicit instantiation of the direct 8-bit decode kernel (decode_direct.cuh)
// for the static and dynamic fp8 caches; one file per family so that a
// two-core build compiles them in parallel.
#include "decode_direct.cuh"

namespace attnd {
ATTND_DIRECT_INST(ATTND_KV_FP8)
ATTND_DIRECT_INST(ATTND_KV_FP8_DYNAMIC)
} // namespace attnd
