/* scales.h: static quantization scales per layer (DESIGN.md section 4, issue
 * "quantized formats"): validation, versions and atomic persistence.
 *
 * int8/fp8 take fp32 scales per kv head [kv_heads] or per channel
 * [kv_heads, head_dim]; int4 takes per-channel scales and zero points in
 * [0, 15]. Scales must be finite and > 0. Types without static scales (bf16,
 * fp16, the dynamic types) accept no SetScales at all, and zero points are
 * refused for every type but int4, so no code path ever holds a scale or zero
 * point its type does not have.
 *
 * Every accepted SetScales gets a version, larger than every version before it
 * (across restarts too). The whole table is persisted as one file,
 * <state_dir>/scales.bin, written atomically: temp file, fsync, rename, fsync
 * of the directory. A file whose shape does not match the model is ignored. */
#ifndef ATTND_SCALES_H
#define ATTND_SCALES_H

#include <stddef.h>
#include <stdint.h>

#include "attnd_kernels.h"
#include "engine.h"

typedef struct {
  int present;
  int per_channel;
  uint64_t version;
  float *k_scale, *v_scale; /* [kv_heads] or [kv_heads][head_dim] */
  float *k_zero, *v_zero;   /* int4 only, else NULL */
} attnd_layer_scales_t;

typedef struct {
  int layers, kv_heads, head_dim;
  attnd_kv_type_t kv;
  attnd_layer_scales_t *l; /* [layers] */
  uint64_t last_version;
  char path[512]; /* empty: no persistence */
} attnd_scales_t;

/* state_dir NULL or "" disables persistence. */
int attnd_scales_init(attnd_scales_t *s, const attnd_kshape_t *shape, int layers,
                      const char *state_dir);
void attnd_scales_free(attnd_scales_t *s);

/* Checks a SetScales request; on error returns ATTND_EINVAL with a reason. */
int attnd_scales_validate(const attnd_scales_t *s, const attnd_scales_req_t *req, char *msg,
                          size_t msglen);
/* Installs a validated request and returns its new version. */
uint64_t attnd_scales_apply(attnd_scales_t *s, const attnd_scales_req_t *req);
/* Versions of all layers (0 where none) into v[layers]. */
void attnd_scales_versions(const attnd_scales_t *s, uint64_t *v);

/* Serializes the whole table (malloc'ed buffer). */
int attnd_scales_serialize(const attnd_scales_t *s, uint8_t **buf, size_t *len);
/* Writes buf to path atomically and durably. Blocking: call off the loop. */
int attnd_scales_write_file(const char *path, const uint8_t *buf, size_t len);
/* Restores from s->path: 0 (restored or no file), 1 (file ignored: other shape
 * or corrupt, reason in err), or a negative ATTND_E*. */
int attnd_scales_load(attnd_scales_t *s, char *err, size_t errlen);

#endif /* ATTND_SCALES_H */
