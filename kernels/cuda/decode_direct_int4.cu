// Explicit instantiation of the direct decode kernel (decode_direct.cuh) for
// the int4 cache (transposed form only: items of at most 8 query vectors).
#include "decode_direct.cuh"

namespace attnd {
ATTND_DIRECT_INST(ATTND_KV_INT4)
} // namespace attnd
