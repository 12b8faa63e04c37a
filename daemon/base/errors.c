/* errors.c: the texts and wire codes of ATTND_ERRNO_MAP (base.h). */
#include "internal.h"

const char *attnd_strerror(int err) {
  switch (err) {
  case 0:
    return "ok";
#define ATTND_XX_STR(name, val, code, text)                                                        \
  case (val):                                                                                      \
    return text;
    ATTND_ERRNO_MAP(ATTND_XX_STR)
#undef ATTND_XX_STR
  default:
    return "unknown error";
  }
}

int attnd_err_status(int err) {
  switch (err) {
  case 0:
    return ATTND_STATUS_OK;
#define ATTND_XX_CODE(name, val, code, text)                                                       \
  case (val):                                                                                      \
    return (code);
    ATTND_ERRNO_MAP(ATTND_XX_CODE)
#undef ATTND_XX_CODE
  default:
    return ATTND_STATUS_INTERNAL;
  }
}

int attnd_err_from_kernel(int rc) {
  switch (rc) {
  case 0:
    return 0;
  case ATTND_KERNEL_EINVAL:
    return ATTND_EINVAL;
  case ATTND_KERNEL_ECUDA:
    return ATTND_ECUDA;
  case ATTND_KERNEL_EDEVICE:
    return ATTND_EDEVICE;
  default:
    return ATTND_EINTERNAL;
  }
}

attnd_log_level_t attnd_status_log_level(int code) {
  switch (code) {
  case ATTND_STATUS_OK:
    return ATTND_LOG_DEBUG;
  case ATTND_STATUS_INVALID_ARGUMENT:
  case ATTND_STATUS_NOT_FOUND:
  case ATTND_STATUS_PERMISSION_DENIED:
  case ATTND_STATUS_FAILED_PRECONDITION:
  case ATTND_STATUS_OUT_OF_RANGE:
  case ATTND_STATUS_UNIMPLEMENTED:
  case ATTND_STATUS_UNAUTHENTICATED:
    return ATTND_LOG_INFO;
  case ATTND_STATUS_CANCELLED:
  case ATTND_STATUS_RESOURCE_EXHAUSTED:
  case ATTND_STATUS_ABORTED:
  case ATTND_STATUS_UNAVAILABLE:
    return ATTND_LOG_WARN;
  default:
    return ATTND_LOG_ERROR;
  }
}
