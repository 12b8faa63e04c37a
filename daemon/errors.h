/* errors.h: attnd's error codes. Functions return 0 or a negative ATTND_E*.
 * One X-macro list generates the enum, attnd_strerror() and the mapping to
 * wire status codes (attnd.v1.Status.Code, numbered as gRPC's). */
#ifndef ATTND_ERRORS_H
#define ATTND_ERRORS_H

/* XX(name, value, wire status code, text) */
#define ATTND_ERRNO_MAP(XX)                                                        \
  XX(EINVAL, -1, 3, "invalid argument")                                            \
  XX(ENOTFOUND, -2, 5, "not found")                                                \
  XX(EPERM, -3, 7, "permission denied")                                            \
  XX(ENOSPC, -4, 8, "resource exhausted")                                          \
  XX(EPRECOND, -5, 9, "failed precondition")                                       \
  XX(EABORTED, -6, 10, "aborted")                                                  \
  XX(ERANGE, -7, 11, "out of range")                                               \
  XX(ENOTIMPL, -8, 12, "unimplemented")                                            \
  XX(EINTERNAL, -9, 13, "internal error")                                          \
  XX(EUNAVAIL, -10, 14, "unavailable")                                             \
  XX(EUNAUTH, -11, 16, "unauthenticated")                                          \
  XX(ECANCELED, -12, 1, "cancelled")                                               \
  XX(ENOMEM, -13, 8, "out of memory")                                              \
  XX(EIO, -14, 13, "i/o error")                                                    \
  XX(ECUDA, -15, 13, "CUDA error")                                                 \
  XX(EDEVICE, -16, 14, "device unusable")

typedef enum {
  ATTND_OK = 0,
#define ATTND_XX_ENUM(name, val, code, text) ATTND_##name = (val),
  ATTND_ERRNO_MAP(ATTND_XX_ENUM)
#undef ATTND_XX_ENUM
} attnd_err_t;

/* Wire status codes (attnd.v1.Status.Code). */
enum {
  ATTND_STATUS_OK = 0,
  ATTND_STATUS_CANCELLED = 1,
  ATTND_STATUS_INVALID_ARGUMENT = 3,
  ATTND_STATUS_NOT_FOUND = 5,
  ATTND_STATUS_PERMISSION_DENIED = 7,
  ATTND_STATUS_RESOURCE_EXHAUSTED = 8,
  ATTND_STATUS_FAILED_PRECONDITION = 9,
  ATTND_STATUS_ABORTED = 10,
  ATTND_STATUS_OUT_OF_RANGE = 11,
  ATTND_STATUS_UNIMPLEMENTED = 12,
  ATTND_STATUS_INTERNAL = 13,
  ATTND_STATUS_UNAVAILABLE = 14,
  ATTND_STATUS_UNAUTHENTICATED = 16,
};

const char *attnd_strerror(int err);
/* The wire status code for an error (0 for 0, INTERNAL for unknown values). */
int attnd_err_status(int err);

#endif /* ATTND_ERRORS_H */
