/* scales_file.c: the static scales table as one file, <state_dir>/scales.bin
 * (internal.h): serialized with a checksum, written atomically and durably,
 * and read back at start. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "internal.h"

/* Version 2 adds the held kv head range and the model's kv heads after the
 * cache type; version 1 (no range) is read as the whole model's. */
static const char MAGIC[8] = {'A', 'T', 'T', 'N', 'D', 'S', 'C', '2'};
static const char MAGIC_V1[8] = {'A', 'T', 'T', 'N', 'D', 'S', 'C', '1'};

static size_t nscales(const attnd_scales_t *s, int per_channel) {
  return (size_t)s->kv_heads * (per_channel ? (size_t)s->head_dim : 1);
}

/* A growable byte buffer for serialization. */
typedef struct {
  uint8_t *p;
  size_t len, cap;
  int oom;
} wbuf_t;

static void put(wbuf_t *w, const void *d, size_t n) {
  if (w->oom)
    return;
  if (w->len + n > w->cap) {
    size_t cap = w->cap ? w->cap * 2 : 256;
    while (cap < w->len + n)
      cap *= 2;
    uint8_t *p = realloc(w->p, cap);
    if (!p) {
      w->oom = 1;
      return;
    }
    w->p = p;
    w->cap = cap;
  }
  memcpy(w->p + w->len, d, n);
  w->len += n;
}

static void put_u32(wbuf_t *w, uint32_t x) {
  put(w, &x, sizeof(x));
}
static void put_u64(wbuf_t *w, uint64_t x) {
  put(w, &x, sizeof(x));
}

int attnd_scales_serialize(const attnd_scales_t *s, uint8_t **buf, size_t *len) {
  wbuf_t w = {0};
  put(&w, MAGIC, sizeof(MAGIC));
  put_u32(&w, (uint32_t)s->layers);
  put_u32(&w, (uint32_t)s->kv_heads);
  put_u32(&w, (uint32_t)s->head_dim);
  put_u32(&w, (uint32_t)s->kv);
  put_u32(&w, (uint32_t)s->kv_head_begin);
  put_u32(&w, (uint32_t)s->model_kv_heads);
  put_u64(&w, s->last_version);
  for (int i = 0; i < s->layers; i++) {
    const attnd_layer_scales_t *l = &s->l[i];
    put_u32(&w, (uint32_t)l->present);
    put_u32(&w, (uint32_t)l->per_channel);
    put_u64(&w, l->version);
    if (!l->present)
      continue;
    size_t n = nscales(s, l->per_channel);
    put(&w, l->k_scale, n * sizeof(float));
    put(&w, l->v_scale, n * sizeof(float));
    if (s->kv == ATTND_KV_INT4) {
      put(&w, l->k_zero, n * sizeof(float));
      put(&w, l->v_zero, n * sizeof(float));
    }
  }
  put_u64(&w, XXH64(w.p, w.len, 0));
  if (w.oom) {
    free(w.p);
    return ATTND_ENOMEM;
  }
  *buf = w.p;
  *len = w.len;
  return 0;
}

/* mkdir -p for the state directory. */
static int mkdirs(const char *dir) {
  char tmp[512];
  snprintf(tmp, sizeof(tmp), "%s", dir);
  for (char *p = tmp + 1; *p; p++) {
    if (*p != '/')
      continue;
    *p = 0;
    if (mkdir(tmp, 0700) != 0 && errno != EEXIST)
      return -1;
    *p = '/';
  }
  if (mkdir(tmp, 0700) != 0 && errno != EEXIST)
    return -1;
  return 0;
}

int attnd_scales_write_file(const char *path, const uint8_t *buf, size_t len) {
  char dir[512], tmp[560];
  snprintf(dir, sizeof(dir), "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash)
    *slash = 0;
  else
    snprintf(dir, sizeof(dir), ".");
  if (mkdirs(dir) != 0)
    return ATTND_EIO;
  snprintf(tmp, sizeof(tmp), "%s.tmp", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    return ATTND_EIO;
  size_t off = 0;
  while (off < len) {
    ssize_t w = write(fd, buf + off, len - off);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0) {
      close(fd);
      unlink(tmp);
      return ATTND_EIO;
    }
    off += (size_t)w;
  }
  /* The data must be durable before the rename makes it the live file, and
   * the directory entry durable before we report success. */
  if (fsync(fd) != 0) {
    close(fd);
    unlink(tmp);
    return ATTND_EIO;
  }
  close(fd);
  if (rename(tmp, path) != 0) {
    unlink(tmp);
    return ATTND_EIO;
  }
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return 0;
}

typedef struct {
  const uint8_t *p;
  size_t len, off;
  int bad;
} rbuf_t;

static void get(rbuf_t *r, void *d, size_t n) {
  if (r->bad || r->off + n > r->len) {
    r->bad = 1;
    memset(d, 0, n);
    return;
  }
  memcpy(d, r->p + r->off, n);
  r->off += n;
}
static uint32_t get_u32(rbuf_t *r) {
  uint32_t x;
  get(r, &x, sizeof(x));
  return x;
}
static uint64_t get_u64(rbuf_t *r) {
  uint64_t x;
  get(r, &x, sizeof(x));
  return x;
}

int attnd_scales_load(attnd_scales_t *s, char *err, size_t errlen) {
  if (!s->path[0])
    return 0;
  FILE *f = fopen(s->path, "rb");
  if (!f)
    return errno == ENOENT ? 0 : ATTND_EIO;
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *p = realloc(buf, cap);
      if (!p) {
        free(buf);
        fclose(f);
        return ATTND_ENOMEM;
      }
      buf = p;
    }
    size_t r = fread(buf + len, 1, cap - len, f);
    if (r == 0)
      break;
    len += r;
  }
  fclose(f);
  int rc = 1;
  char magic[8];
  rbuf_t r = {buf, len, 0, 0};
  if (len < sizeof(MAGIC) + 8) {
    snprintf(err, errlen, "%s: truncated", s->path);
    goto out;
  }
  uint64_t sum;
  memcpy(&sum, buf + len - 8, 8);
  if (XXH64(buf, len - 8, 0) != sum) {
    snprintf(err, errlen, "%s: checksum mismatch", s->path);
    goto out;
  }
  r.len = len - 8;
  get(&r, magic, sizeof(magic));
  int v1 = memcmp(magic, MAGIC_V1, sizeof(MAGIC_V1)) == 0;
  uint32_t layers = get_u32(&r), kvh = get_u32(&r), hd = get_u32(&r), kv = get_u32(&r);
  uint32_t begin = v1 ? 0 : get_u32(&r), model = v1 ? kvh : get_u32(&r);
  uint64_t last = get_u64(&r);
  if ((!v1 && memcmp(magic, MAGIC, sizeof(MAGIC)) != 0) || layers != (uint32_t)s->layers ||
      kvh != (uint32_t)s->kv_heads || hd != (uint32_t)s->head_dim || kv != (uint32_t)s->kv) {
    snprintf(err, errlen, "%s: written for another model shape or cache type; ignored", s->path);
    goto out;
  }
  if (begin != (uint32_t)s->kv_head_begin || model != (uint32_t)s->model_kv_heads) {
    snprintf(err, errlen,
             "%s: written for kv heads %u:%u of %u, this daemon holds %d:%d of %d; ignored",
             s->path, begin, begin + kvh, model, s->kv_head_begin, s->kv_head_begin + s->kv_heads,
             s->model_kv_heads);
    goto out;
  }
  /* Parse into the live table only after the whole file checked out. */
  for (int pass = 0; pass < 2; pass++) {
    r.off = sizeof(MAGIC) + 4 * (v1 ? 4 : 6) + 8;
    r.bad = 0;
    for (int i = 0; i < s->layers; i++) {
      attnd_layer_scales_t *l = &s->l[i];
      uint32_t present = get_u32(&r), pc = get_u32(&r);
      uint64_t ver = get_u64(&r);
      if (!present)
        continue;
      size_t n = nscales(s, pc != 0);
      int zeros = s->kv == ATTND_KV_INT4;
      if (pass == 0) {
        r.off += n * sizeof(float) * (zeros ? 4 : 2);
        if (r.off > r.len)
          r.bad = 1;
        continue;
      }
      get(&r, l->k_scale, n * sizeof(float));
      get(&r, l->v_scale, n * sizeof(float));
      if (zeros) {
        get(&r, l->k_zero, n * sizeof(float));
        get(&r, l->v_zero, n * sizeof(float));
      }
      l->present = 1;
      l->per_channel = pc != 0;
      l->version = ver;
    }
    if (r.bad) {
      snprintf(err, errlen, "%s: truncated layer table; ignored", s->path);
      goto out;
    }
  }
  s->last_version = last;
  rc = 0;
out:
  free(buf);
  return rc;
}
