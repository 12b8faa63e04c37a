/* auth.c: who a connection is (internal.h, docs/protocol.md): the tokens
 * of --token-file, compared in constant time and never logged, and Hello,
 * which an off-loopback TCP connection (or every TCP one with
 * --require-token) must send first. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "internal.h"

#define TOKEN_MAX 256

int attnd_rpc_load_tokens(attnd_rpc_t *r, const char *path, char *err, size_t errlen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, errlen, "--token-file '%s': %s", path, strerror(errno));
    return ATTND_EIO;
  }
  char line[1024];
  int lineno = 0;
  while (fgets(line, sizeof(line), f)) {
    lineno++;
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ' ||
                 line[n - 1] == '\t'))
      line[--n] = 0;
    char *s = line;
    while (*s == ' ' || *s == '\t')
      s++;
    n = strlen(s);
    if (n == 0 || s[0] == '#')
      continue;
    if (n >= TOKEN_MAX) {
      /* The line number only: the token itself is never printed. */
      snprintf(err, errlen, "--token-file %s:%d: token longer than %d bytes", path, lineno,
               TOKEN_MAX - 1);
      fclose(f);
      return ATTND_EINVAL;
    }
    r->tokens = attnd_xrealloc(r->tokens, (r->ntokens + 1) * sizeof(char *));
    /* Zero-padded to TOKEN_MAX so comparisons always touch every byte. */
    char *t = attnd_xcalloc(1, TOKEN_MAX);
    memcpy(t, s, n);
    r->tokens[r->ntokens++] = t;
  }
  fclose(f);
  return 0;
}

int attnd_rpc_token_ok(const attnd_rpc_t *r, const char *token) {
  char pad[TOKEN_MAX];
  size_t tl = strnlen(token, TOKEN_MAX);
  if (tl == 0 || tl >= TOKEN_MAX)
    return 0;
  memset(pad, 0, sizeof(pad));
  memcpy(pad, token, tl);
  /* Constant time in the token's content: every byte of every accepted token
   * is compared, with no early exit. */
  unsigned ok = 0;
  for (size_t k = 0; k < r->ntokens; k++) {
    volatile unsigned char diff = 0;
    for (size_t i = 0; i < TOKEN_MAX; i++)
      diff |= (unsigned char)(pad[i] ^ r->tokens[k][i]);
    ok |= (unsigned)(diff == 0);
  }
  return ok != 0;
}

int attnd_rpc_decode_hello(attnd_rpc_req_t *q, pb_istream_t *s) {
  return attnd_rpc_pb_decode(q, s, attnd_v1_HelloRequest_fields, &q->m.hello);
}

/* A valid token makes the connection usable (and, on TCP, names its
 * identity); a wrong one, or none where one is needed, is answered
 * UNAUTHENTICATED and the connection closes. The token is wiped either way. */
void attnd_rpc_call_hello(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  const char *token = q->m.hello.token;
  attnd_result_t res;
  memset(&res, 0, sizeof(res));
  if (token[0] && attnd_rpc_token_ok(c->rpc, token)) {
    /* On the Unix socket the peer uid stays the identity; on TCP the token is. */
    if (c->identity >> 32)
      c->identity = (XXH3_64bits(token, strlen(token)) | ATTND_IDENTITY_TOKEN_BIT);
    c->need_hello = 0;
  } else if (token[0] || c->need_hello) {
    ATTND_LOGW("auth_failed", "conn=%llu", (unsigned long long)c->id);
    res.status = ATTND_EUNAUTH;
    snprintf(res.message, sizeof(res.message), "token not accepted");
    q->close_after = 1;
  }
  memset(&q->m.hello, 0, sizeof(q->m.hello));
  attnd_rpc_done(q, &res);
}

void attnd_rpc_free_tokens(attnd_rpc_t *r) {
  for (size_t i = 0; i < r->ntokens; i++) {
    memset(r->tokens[i], 0, TOKEN_MAX);
    free(r->tokens[i]);
  }
  free(r->tokens);
  r->tokens = NULL;
  r->ntokens = 0;
}
