/* attnd_cuda_ipc.h: the device check of tensors in client memory and the
 * done signal (ipc.cu; same-host zero-copy, docs/protocol.md §5a; the
 * check's rule is docs/numerics.md §6, as engine/scan.c applies it on the
 * host). */
#ifndef ATTND_CUDA_IPC_H
#define ATTND_CUDA_IPC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One stream's check state (DEVICE, 8-byte aligned): the first bad row of
 * each tensor as the blocks find it, and the count of finished blocks. A
 * check leaves it as it found it, so the checks of one stream share one. */
enum { ATTND_CUDA_CHECK_STATE_BYTES = 64 };

/* Sets n consecutive states to their resting value (enqueued on stream). */
int attnd_cuda_check_init(void *state, int n, void *stream);

/* The finiteness and magnitude check of three tensors (p[i] NULL or rows[i]
 * 0: none) of rows[i] x row_elems[i] 16-bit values (bf16 or fp16, DEVICE
 * memory, 2-byte aligned) in one kernel on stream: host[i] (pinned HOST
 * memory, 3 x 8 bytes, written by the kernel itself, so no copy follows)
 * becomes UINT64_MAX when no row's largest magnitude pattern (sign cleared)
 * exceeds bound_bits[i], else (row << 32) | bits of the first row that
 * does, bits being that row's largest pattern. state: the stream's
 * (attnd_cuda_check_init'ed once); checks sharing a state must be ordered
 * (one stream). */
int attnd_cuda_check_rows(const void *const p[3], const int64_t rows[3], const int32_t row_elems[3],
                          const uint32_t bound_bits[3], void *state, uint64_t *host, void *stream);

/* The done signal of a step over client memory (docs/protocol.md): raises
 * the 8-byte aligned DEVICE word to value (word = max(word, value), one
 * atomic, made visible to the whole system) once everything enqueued on
 * stream before it has run. */
int attnd_cuda_signal(void *word, uint64_t value, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* ATTND_CUDA_IPC_H */
