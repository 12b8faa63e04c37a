// Explicit instantiation of the Hopper prefill kernel for the int8 cache (one
// file per cache type so that a two-core build compiles them in parallel).
#include "prefill_sm90_launch.cuh"

namespace attnd {
ATTND_SM90_INST(ATTND_KV_INT8)
} // namespace attnd
