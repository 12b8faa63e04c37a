/* resources.c: the KV pool the options ask for, against what the host has
 * (config.h, attnd_config_check_resources; docs/operations.md section 1).
 *
 * These are the start-time checks that need no device, so that
 * --check-config says what the start would: the pool must hold a block of
 * every layer (the backends divide kv-memory by block bytes x layers and
 * refuse 0), and on the CPU backend it must fit in 90% of the memory the
 * daemon can have. That is MemAvailable + SwapFree from /proc/meminfo, or
 * less when the daemon's memory cgroup (v2: memory.max - memory.current; v1:
 * memory.limit_in_bytes - memory.usage_in_bytes; the tightest along its path)
 * leaves less, as in a container with a memory limit. The CPU pool is allocated with calloc, so an
 * oversized one would be "allocated" at start and fail later, page by page, with the OOM killer:
 * refusing it at start is the only clear answer. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"
#include "internal.h"

#define ERR(...)                                                                                   \
  do {                                                                                             \
    snprintf(err, errlen, __VA_ARGS__);                                                            \
    return ATTND_EINVAL;                                                                           \
  } while (0)

void attnd_config_fmt_size(char *buf, size_t cap, uint64_t bytes) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) {
    snprintf(buf, cap, "%" PRIu64 " bytes", bytes);
    return;
  }
  double v = (double)bytes;
  int u = -1;
  while (v >= 1024 && u < 3) {
    v /= 1024;
    u++;
  }
  snprintf(buf, cap, "%.*f %s", v == (double)(uint64_t)v ? 0 : 1, v, units[u]);
}

/* A "Key:   123 kB" line of /proc/meminfo, in bytes; 0 when absent. */
static uint64_t meminfo(const char *text, const char *key) {
  const char *p = strstr(text, key);
  if (!p)
    return 0;
  return strtoull(p + strlen(key), NULL, 10) * 1024;
}

static int read_small(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  size_t n = fread(buf, 1, cap - 1, f);
  fclose(f);
  buf[n] = 0;
  return 0;
}

/* The tightest (limit - usage) along a cgroup path and its ancestors, under
 * the hierarchy mounted at base; UINT64_MAX when nothing there limits it. */
static uint64_t room_along(const char *base, char *cg, const char *max_file, const char *cur_file) {
  char path[4200], v[64];
  uint64_t room = UINT64_MAX;
  for (;;) {
    const char *sub = strcmp(cg, "/") ? cg : "";
    snprintf(path, sizeof(path), "%s%s/%s", base, sub, max_file);
    if (read_small(path, v, sizeof(v)) == 0 && strncmp(v, "max", 3) != 0) {
      uint64_t max = strtoull(v, NULL, 10), cur = 0;
      snprintf(path, sizeof(path), "%s%s/%s", base, sub, cur_file);
      if (read_small(path, v, sizeof(v)) == 0)
        cur = strtoull(v, NULL, 10);
      uint64_t left = max > cur ? max - cur : 0;
      if (left < room)
        room = left;
    }
    char *slash = strrchr(cg, '/');
    if (!slash || slash == cg)
      break;
    *slash = 0;
  }
  return room;
}

/* What the daemon's memory cgroup still allows: cgroup v2 (memory.max -
 * memory.current) or v1's memory controller (memory.limit_in_bytes -
 * memory.usage_in_bytes); UINT64_MAX when nothing limits it or nothing can
 * be read. */
uint64_t attnd_config_cgroup_room(const char *cgroup_file, const char *root) {
  char text[4096], base[512], *save = NULL;
  uint64_t room = UINT64_MAX;
  if (read_small(cgroup_file, text, sizeof(text)))
    return room;
  for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    /* "ID:CONTROLLERS:PATH"; v2 is "0::PATH". */
    char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c2)
      continue;
    *c2 = 0;
    uint64_t r = UINT64_MAX;
    if (c2 == c1 + 1) {
      r = room_along(root, c2 + 1, "memory.max", "memory.current");
    } else if (strstr(c1 + 1, "memory")) {
      snprintf(base, sizeof(base), "%s/memory", root);
      r = room_along(base, c2 + 1, "memory.limit_in_bytes", "memory.usage_in_bytes");
    }
    if (r < room)
      room = r;
  }
  return room;
}

/* MemAvailable + SwapFree, at most the cgroup's room; 0 when unknown. */
static uint64_t host_available(void) {
  char text[8192];
  if (read_small("/proc/meminfo", text, sizeof(text)))
    return 0;
  uint64_t avail = meminfo(text, "MemAvailable:");
  if (avail == 0)
    return 0;
  avail += meminfo(text, "SwapFree:");
  uint64_t room = attnd_config_cgroup_room("/proc/self/cgroup", "/sys/fs/cgroup");
  return room < avail ? room : avail;
}

int attnd_config_check_resources(const attnd_config_t *c, int cpu_backend, attnd_config_pool_t *p,
                                 char *err, size_t errlen) {
  char a[32], b[32], d[32];
  memset(p, 0, sizeof(*p));
  p->cpu = cpu_backend;
  p->block_bytes = attnd_kv_block_bytes(&c->shape);
  /* The backends' defaults: 1G on the CPU; on CUDA the device decides. */
  p->kv_memory = c->kv_memory ? c->kv_memory : cpu_backend ? (1ull << 30) : 0;
  uint64_t per_block = (uint64_t)p->block_bytes * (uint64_t)c->layers;
  if (p->kv_memory) {
    p->blocks = p->kv_memory / per_block;
    attnd_config_fmt_size(a, sizeof(a), p->kv_memory);
    attnd_config_fmt_size(b, sizeof(b), per_block);
    if (p->blocks == 0)
      ERR("--kv-memory %s holds no KV block: one block of %d tokens in each of the %d layers "
          "takes %s (%zu bytes per layer)",
          a, c->shape.block_size, c->layers, b, p->block_bytes);
    if (p->blocks > INT32_MAX)
      ERR("--kv-memory %s: %" PRIu64 " blocks per layer, more than the 2^31-1 the pool indexes", a,
          p->blocks);
  }
  if (cpu_backend) {
    p->host_available = host_available();
    p->host_limit = p->host_available / 10 * 9;
    uint64_t pool = p->blocks * per_block;
    if (p->host_available && pool > p->host_limit) {
      attnd_config_fmt_size(a, sizeof(a), pool);
      attnd_config_fmt_size(b, sizeof(b), p->host_limit);
      attnd_config_fmt_size(d, sizeof(d), p->host_available);
      ERR("--kv-memory: a %s KV pool on the CPU backend is more than 90%% of the memory "
          "available to the daemon (%s of %s: MemAvailable + SwapFree, or the cgroup's "
          "memory.max); lower --kv-memory",
          a, b, d);
    }
  }
  return 0;
}
