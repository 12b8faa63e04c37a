/* internal.h: config's private helpers, shared by config.c and options.c. */
#ifndef ATTND_CONFIG_INTERNAL_H
#define ATTND_CONFIG_INTERNAL_H

#include <stdint.h>

#include "config.h"

/* Integer in [lo, hi]: 0, or -1 when v is not one. */
int attnd_config_parse_int(const char *v, long lo, long hi, long *out);
/* Bytes with an optional binary suffix: 512M, 1G, 64k, 1GiB, 100 (bytes). */
int attnd_config_parse_size(const char *v, uint64_t *out);

#endif /* ATTND_CONFIG_INTERNAL_H */
