/* frame.h: the wire framing (DESIGN.md section 7), a pure codec without libuv.
 *
 * A frame is a 4-byte big-endian length N (0 < N <= max frame) followed by N
 * bytes. The reader is incremental: bytes may arrive split anywhere and several
 * frames may arrive in one read.
 *
 * Zero copy for large frames: before each read, ask attnd_frame_reader_buf()
 * where to read to. While a frame body is in progress it returns the rest of
 * that frame's own buffer, so the bulk of a large frame (tensor bytes) lands in
 * its final place; otherwise it returns a small scratch buffer from which
 * headers (and small frames) are parsed. Each complete frame is handed to the
 * callback in a malloc'ed buffer that the callback then owns (free()). */
#ifndef ATTND_FRAME_H
#define ATTND_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define ATTND_FRAME_SCRATCH (64 * 1024)

/* Takes ownership of frame (malloc'ed, len bytes). Return 0 to continue,
 * ATTND_FRAME_PAUSE to stop after this frame while keeping the bytes not yet
 * parsed (backpressure: attnd_frame_reader_resume() parses them later), or a
 * negative value to stop for good (the rest of the bytes is dropped). */
#define ATTND_FRAME_PAUSE 1
typedef int (*attnd_frame_cb)(void *arg, uint8_t *frame, size_t len);

typedef struct {
  uint64_t max_frame;
  uint8_t hdr[4];
  size_t hdr_got;
  uint8_t *body; /* frame in progress, NULL between frames */
  size_t body_len;
  size_t body_got;
  uint8_t *scratch; /* ATTND_FRAME_SCRATCH bytes, allocated lazily */
  int err;          /* sticky: ATTND_EINVAL (N == 0), ATTND_ENOSPC (N > max) */
  uint64_t bad_len; /* the rejected length, for the log */
  uint8_t *pend;    /* bytes received but not parsed because of a pause */
  size_t pend_len;
} attnd_frame_reader_t;

void attnd_frame_reader_init(attnd_frame_reader_t *r, uint64_t max_frame);
void attnd_frame_reader_free(attnd_frame_reader_t *r);

/* Where the next read should go: the rest of the frame in progress, or scratch.
 * Returns ATTND_ENOMEM if a buffer cannot be allocated. */
int attnd_frame_reader_buf(attnd_frame_reader_t *r, uint8_t **base, size_t *len);

/* Consumes n bytes at data. data may be the buffer returned by
 * attnd_frame_reader_buf (no copy for a frame body) or any other memory.
 * Returns 0, ATTND_FRAME_PAUSE when a callback paused (the unparsed rest is
 * kept), the first negative value a callback returned, or the reader's error:
 * ATTND_EINVAL for a zero-length frame, ATTND_ENOSPC for one over the limit,
 * ATTND_ENOMEM when a frame buffer cannot be allocated. After an error the
 * reader accepts nothing more. Must not be called while paused bytes are kept. */
int attnd_frame_reader_feed(attnd_frame_reader_t *r, const uint8_t *data, size_t n,
                            attnd_frame_cb cb, void *arg);

/* Parses the bytes kept by a pause; returns as attnd_frame_reader_feed. */
int attnd_frame_reader_resume(attnd_frame_reader_t *r, attnd_frame_cb cb, void *arg);
/* 1 while bytes kept by a pause wait for attnd_frame_reader_resume(). */
int attnd_frame_reader_paused(const attnd_frame_reader_t *r);

/* 1 while a frame is partly received (a header byte or more). */
int attnd_frame_reader_partial(const attnd_frame_reader_t *r);

#endif /* ATTND_FRAME_H */
