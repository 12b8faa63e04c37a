/* attnclient_internal.h: what the files of libattnclient share (not installed).
 *
 *   attnclient.c      connecting, encoding helpers, the synchronous wrappers
 *   attnclient_io.c   framing: requests written as pieces (tensor bytes straight
 *                     from the caller's memory), responses read, the phase times
 *   attnclient_ipc.c  RegisterBuffer, ReleaseBuffer
 *   attnclient_shard.c  head-sharded groups */
#ifndef ATTND_CLIENT_INTERNAL_H
#define ATTND_CLIENT_INTERNAL_H

#include <stdint.h>
#include <sys/uio.h>

#include "attnclient.h"

/* The daemon never sends frames of 2^31 bytes or more (docs/operations.md). */
#define ATTND_CLIENT_MAX_FRAME ((uint32_t)1 << 31)

/* One piece of a request frame: n bytes at p, or at sbuf + off when p is NULL
 * (sbuf may move while the frame is encoded). */
typedef struct attnd_client_piece_s {
  const uint8_t *p;
  size_t off, n;
} attnd_client_piece_t;

typedef struct pending_s {
  struct pending_s *next;
  attnd_client_resp_t resp;
} pending_t;

struct attnd_client_s {
  int fd;
  int timeout_ms;
  int status;
  uint64_t epoch;
  uint64_t next_id;
  pending_t *pending; /* responses received while waiting for another id */
  /* The request being written (attnclient_io.c): its small fields in sbuf,
   * piece[] the frame in order (spans of sbuf, or the caller's tensor bytes). */
  uint8_t *sbuf;
  size_t slen, scap;
  struct attnd_client_piece_s *piece;
  size_t npiece, piececap;
  size_t open_off; /* sbuf offset where the small bytes not yet in piece[] start */
  /* Bytes read ahead of the frame being read (attnclient_io.c): a small
   * response's header and body come in one recv. */
  uint8_t *rbuf;
  size_t rpos, rlen;
  int spin_us; /* attnd_client_set_spin */
  attnd_client_phases_t ph;
  char addr[256];
  char errmsg[640];
};

/* Sets errmsg from fmt and returns err. */
int attnd_client_fail(attnd_client_t *c, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Frees what attnclient_io.c keeps in c (the request buffers). */
void attnd_client_io_free(attnd_client_t *c);
/* Makes a connected socket's kernel buffers large enough for big frames. */
void attnd_client_io_tune(attnd_client_t *c);

#endif /* ATTND_CLIENT_INTERNAL_H */
