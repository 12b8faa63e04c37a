/* frame.c: the frame reader (net.h). */

#include <stdlib.h>
#include <string.h>

#include "internal.h"

void attnd_frame_reader_init(attnd_frame_reader_t *r, uint64_t max_frame) {
  memset(r, 0, sizeof(*r));
  r->max_frame = max_frame;
}

void attnd_frame_reader_hooks(attnd_frame_reader_t *r, attnd_frame_admit_cb admit,
                              attnd_frame_release_cb release, void *arg) {
  r->admit = admit;
  r->release = release;
  r->hook_arg = arg;
}

void attnd_frame_reader_body_hooks(attnd_frame_reader_t *r,
                                   void *(*body_alloc)(void *arg, size_t len, int *tag),
                                   void (*body_free)(void *arg, void *p, int tag)) {
  r->body_alloc = body_alloc;
  r->body_free = body_free;
}

static void drop_body(attnd_frame_reader_t *r) {
  if (!r->body)
    return;
  if (r->body_free)
    r->body_free(r->hook_arg, r->body, r->body_tag);
  else
    free(r->body);
  r->body = NULL;
  if (r->release)
    r->release(r->hook_arg, r->body_len);
  r->body_len = r->body_got = 0;
}

void attnd_frame_reader_free(attnd_frame_reader_t *r) {
  drop_body(r);
  free(r->scratch);
  free(r->pend);
  r->scratch = NULL;
  r->pend = NULL;
  r->pend_len = r->pend_off = 0;
}

void attnd_frame_reader_abort(attnd_frame_reader_t *r) {
  drop_body(r);
  free(r->pend);
  r->pend = NULL;
  r->pend_len = r->pend_off = 0;
  r->hdr_got = 0;
  if (!r->err)
    r->err = ATTND_ECANCELED;
}

int attnd_frame_reader_partial(const attnd_frame_reader_t *r) {
  return r->hdr_got > 0 || r->body != NULL;
}

int attnd_frame_reader_buf(attnd_frame_reader_t *r, uint8_t **base, size_t *len) {
  if (r->body) {
    *base = r->body + r->body_got;
    *len = r->body_len - r->body_got;
    return 0;
  }
  if (!r->scratch && !(r->scratch = malloc(ATTND_FRAME_SCRATCH)))
    return ATTND_ENOMEM;
  *base = r->scratch;
  *len = ATTND_FRAME_SCRATCH;
  return 0;
}

/* Hands the finished body to the callback and resets for the next header. */
static int finish(attnd_frame_reader_t *r, attnd_frame_cb cb, void *arg) {
  uint8_t *f = r->body;
  size_t n = r->body_len;
  r->body = NULL;
  r->body_len = r->body_got = 0;
  r->hdr_got = 0;
  r->last_tag = r->body_tag;
  r->body_tag = 0;
  if (r->release)
    r->release(r->hook_arg, n);
  return cb(arg, f, n);
}

/* The header says `want` bytes: allocate them once the budget admits them. */
static int start_body(attnd_frame_reader_t *r) {
  int rc = r->admit ? r->admit(r->hook_arg, r->want) : 0;
  if (rc < 0) {
    r->bad_len = r->want;
    return r->err = rc;
  }
  if (rc)
    return ATTND_FRAME_PAUSE;
  r->body_tag = 0;
  r->body = r->body_alloc ? r->body_alloc(r->hook_arg, r->want, &r->body_tag) : malloc(r->want);
  if (!r->body) {
    if (r->release)
      r->release(r->hook_arg, r->want);
    return r->err = ATTND_ENOMEM;
  }
  r->body_len = r->want;
  r->body_got = 0;
  return 0;
}

int attnd_frame_reader_paused(const attnd_frame_reader_t *r) {
  return r->pend != NULL || (r->hdr_got == 4 && !r->body && !r->err);
}

/* Keeps the unparsed rest after a pause. Bytes from a read (scratch, which
 * the next read overwrites) are copied; bytes of the kept buffer itself (a
 * pause while resuming) only move its offset, so many short pauses over one
 * read's frames copy nothing. */
static int keep(attnd_frame_reader_t *r, const uint8_t *data, size_t n) {
  if (r->pend && data >= r->pend && data <= r->pend + r->pend_len) {
    r->pend_off = (size_t)(data - r->pend);
    if (r->pend_off == r->pend_len) {
      free(r->pend);
      r->pend = NULL;
      r->pend_len = r->pend_off = 0;
    }
    return ATTND_FRAME_PAUSE;
  }
  if (n == 0)
    return ATTND_FRAME_PAUSE;
  uint8_t *p = malloc(n);
  if (!p)
    return r->err = ATTND_ENOMEM;
  memcpy(p, data, n);
  r->pend = p;
  r->pend_len = n;
  r->pend_off = 0;
  return ATTND_FRAME_PAUSE;
}

int attnd_frame_reader_resume(attnd_frame_reader_t *r, attnd_frame_cb cb, void *arg) {
  uint8_t *p = r->pend;
  if (!p)
    return attnd_frame_reader_feed(r, NULL, 0, cb, arg);
  int rc = attnd_frame_reader_feed(r, p + r->pend_off, r->pend_len - r->pend_off, cb, arg);
  /* Everything kept was parsed (or the reader failed): the buffer goes. */
  if (rc != ATTND_FRAME_PAUSE && r->pend == p) {
    free(p);
    r->pend = NULL;
    r->pend_len = r->pend_off = 0;
  }
  return rc;
}

int attnd_frame_reader_feed(attnd_frame_reader_t *r, const uint8_t *data, size_t n,
                            attnd_frame_cb cb, void *arg) {
  if (r->err)
    return r->err;
  for (;;) {
    if (r->body) {
      if (n == 0)
        break;
      size_t want = r->body_len - r->body_got;
      size_t take = n < want ? n : want;
      /* Bytes read straight into the body need no copy. */
      if (data != r->body + r->body_got)
        memcpy(r->body + r->body_got, data, take);
      r->body_got += take;
      data += take;
      n -= take;
      if (r->body_got == r->body_len) {
        int rc = finish(r, cb, arg);
        if (rc < 0)
          return rc;
        if (rc == ATTND_FRAME_PAUSE)
          return keep(r, data, n);
      }
      continue;
    }
    if (r->hdr_got == 4) {
      /* A header parsed earlier whose body waits for admission. */
      int rc = start_body(r);
      if (rc == ATTND_FRAME_PAUSE)
        return keep(r, data, n);
      if (rc < 0)
        return rc;
      continue;
    }
    if (n == 0)
      break;
    if (r->hdr_got == 0) {
      r->nstarted++;
      r->t0_ns = uv_hrtime();
    }
    size_t take = 4 - r->hdr_got;
    if (take > n)
      take = n;
    memcpy(r->hdr + r->hdr_got, data, take);
    r->hdr_got += take;
    data += take;
    n -= take;
    if (r->hdr_got < 4)
      break;
    uint64_t len = ((uint64_t)r->hdr[0] << 24) | ((uint64_t)r->hdr[1] << 16) |
                   ((uint64_t)r->hdr[2] << 8) | (uint64_t)r->hdr[3];
    if (len == 0) {
      r->bad_len = 0;
      return r->err = ATTND_EINVAL;
    }
    if (len > r->max_frame) {
      r->bad_len = len;
      return r->err = ATTND_ENOSPC;
    }
    r->want = (size_t)len;
  }
  return 0;
}
