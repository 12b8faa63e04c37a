// Explicit instantiation of the Hopper prefill kernel for the fp8_dynamic cache (one
// file per cache type so that a two-core build compiles them in parallel).
#include "prefill_sm90_launch.cuh"

namespace attnd {
ATTND_SM90_INST(ATTND_KV_FP8_DYNAMIC)
} // namespace attnd
