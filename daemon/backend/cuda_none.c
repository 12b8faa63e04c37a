/* cuda_none.c: the CUDA backend's entry points in a build without CUDA
 * (backend.h): no device is ever available. */
#include <stdio.h>

#include "internal.h"

int attnd_backend_cuda_available(void) {
  return 0;
}

int attnd_backend_cuda_create(attnd_backend_t **out, uv_loop_t *loop, const attnd_kshape_t *s,
                              int layers, const attnd_backend_opts_t *o, char *err, size_t errlen) {
  snprintf(err, errlen, "this attnd was built without CUDA");
  return ATTND_EUNAVAIL;
}
