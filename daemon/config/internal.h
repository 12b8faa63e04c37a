/* internal.h: config's private helpers, shared by its files:
 *
 *   options.c       flags (getopt_long over the generated table) and the INI file
 *   config.c        defaults, validation, what --check-config prints
 *   model_config.c  a Hugging Face config.json (--model-config)
 *   resources.c     the KV pool against the host (block count, host memory)
 */
#ifndef ATTND_CONFIG_INTERNAL_H
#define ATTND_CONFIG_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"

/* Integer in [lo, hi]: 0, or -1 when v is not one. */
int attnd_config_parse_int(const char *v, long lo, long hi, long *out);
/* Bytes with an optional binary suffix: 512M, 1G, 64k, 1GiB, 100 (bytes). */
int attnd_config_parse_size(const char *v, uint64_t *out);

/* The option's row in deploy/options.toml (attnd_config_t.origin's index), or -1. */
int attnd_config_option_index(const char *name);
/* Sets one option from its text form, as a flag or file key would (the same
 * checks and messages), and records from (attnd_origin_t) as its origin. */
int attnd_config_set(attnd_config_t *c, int from, const char *name, const char *value, char *err,
                     size_t errlen);

/* "1 GiB", "512 MiB", "1.5 KiB", "100 bytes". */
void attnd_config_fmt_size(char *buf, size_t cap, uint64_t bytes);

/* What a memory cgroup still allows the process whose /proc/PID/cgroup is
 * cgroup_file, with the cgroup hierarchies mounted at root (/sys/fs/cgroup):
 * the tightest limit - usage along its path, v2 or v1; UINT64_MAX when
 * nothing limits it. (A function of its files, so that a test can fake them.) */
uint64_t attnd_config_cgroup_room(const char *cgroup_file, const char *root);

/* Reads c->model_config and sets the shape options it supplies whose origin is
 * still ATTND_FROM_DEFAULT; refuses a model whose attention attnd does not
 * implement, naming the field. */
int attnd_config_model_apply(attnd_config_t *c, char *err, size_t errlen);

#endif /* ATTND_CONFIG_INTERNAL_H */
