/* auth.c: who a connection is and what it may do (internal.h,
 * docs/protocol.md §1): the tokens of --token-file, compared in constant time
 * and never logged; Hello, which an off-loopback TCP connection (or every TCP
 * one with --require-token) must send first; operators, the identities that
 * may change daemon-wide state; and the token file's reload.
 *
 * Token file: one token per line, '#' starts a comment line, surrounding
 * blanks are ignored; a line `operator:TOKEN` accepts TOKEN and makes whoever
 * presents it an operator. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "internal.h"

#define TOKEN_MAX 256
#define OPERATOR_PREFIX "operator:"

struct attnd_rpc_tokens_s {
  size_t n;
  char **tok;      /* zero-padded to TOKEN_MAX, so comparisons touch every byte */
  uint8_t *op;     /* 1: an operator's token */
  uint64_t *ident; /* the identity each token gives (not secret: a hash) */
};

static uint64_t token_identity(const char *token, size_t n) {
  return XXH3_64bits(token, n) | ATTND_IDENTITY_TOKEN_BIT;
}

static void tokens_free(attnd_rpc_tokens_t *t) {
  if (!t)
    return;
  for (size_t i = 0; i < t->n; i++) {
    memset(t->tok[i], 0, TOKEN_MAX);
    free(t->tok[i]);
  }
  free(t->tok);
  free(t->op);
  free(t->ident);
  free(t);
}

static char *trim(char *s) {
  size_t n = strlen(s);
  while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t'))
    s[--n] = 0;
  while (*s == ' ' || *s == '\t')
    s++;
  return s;
}

/* Reads a whole token file into a new set; NULL with err set on failure
 * (then nothing of it remains in memory). */
static attnd_rpc_tokens_t *tokens_read(const char *path, char *err, size_t errlen) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(err, errlen, "--token-file '%s': %s", path, strerror(errno));
    return NULL;
  }
  attnd_rpc_tokens_t *t = attnd_xcalloc(1, sizeof(*t));
  char line[1024];
  int lineno = 0;
  while (fgets(line, sizeof(line), f)) {
    lineno++;
    char *s = trim(line);
    int op = 0;
    if (s[0] == 0 || s[0] == '#')
      continue;
    if (strncmp(s, OPERATOR_PREFIX, strlen(OPERATOR_PREFIX)) == 0) {
      op = 1;
      s = trim(s + strlen(OPERATOR_PREFIX));
      if (s[0] == 0) {
        snprintf(err, errlen, "--token-file %s:%d: '" OPERATOR_PREFIX "' without a token", path,
                 lineno);
        goto fail;
      }
    }
    size_t n = strlen(s);
    if (n >= TOKEN_MAX) {
      /* The line number only: the token itself is never printed. */
      snprintf(err, errlen, "--token-file %s:%d: token longer than %d bytes", path, lineno,
               TOKEN_MAX - 1);
      goto fail;
    }
    t->tok = attnd_xrealloc(t->tok, (t->n + 1) * sizeof(char *));
    t->op = attnd_xrealloc(t->op, t->n + 1);
    t->ident = attnd_xrealloc(t->ident, (t->n + 1) * sizeof(uint64_t));
    t->tok[t->n] = attnd_xcalloc(1, TOKEN_MAX);
    memcpy(t->tok[t->n], s, n);
    t->op[t->n] = (uint8_t)op;
    t->ident[t->n] = token_identity(s, n);
    t->n++;
  }
  if (ferror(f)) {
    snprintf(err, errlen, "--token-file '%s': read error", path);
    goto fail;
  }
  memset(line, 0, sizeof(line));
  fclose(f);
  return t;
fail:
  memset(line, 0, sizeof(line));
  fclose(f);
  tokens_free(t);
  return NULL;
}

int attnd_rpc_load_tokens(attnd_rpc_t *r, const char *path, char *err, size_t errlen) {
  attnd_rpc_tokens_t *t = tokens_read(path, err, errlen);
  if (!t)
    return ATTND_EINVAL;
  tokens_free(r->tokens);
  r->tokens = t;
  return 0;
}

int attnd_auth_reload(attnd_rpc_t *r, char *err, size_t errlen) {
  const char *path = r->cfg->token_file;
  if (!path[0])
    return 0;
  attnd_rpc_tokens_t *t = tokens_read(path, err, errlen);
  if (!t) {
    ATTND_LOGW("tokens_reload_failed", "reason=\"%s\" kept=%zu", err,
               r->tokens ? r->tokens->n : (size_t)0);
    return ATTND_EINVAL;
  }
  size_t ops = 0;
  for (size_t i = 0; i < t->n; i++)
    ops += t->op[i];
  tokens_free(r->tokens);
  r->tokens = t;
  ATTND_LOGI("tokens_reloaded", "tokens=%zu operators=%zu", t->n, ops);
  return 0;
}

int attnd_rpc_token_ok(const attnd_rpc_t *r, const char *token) {
  const attnd_rpc_tokens_t *t = r->tokens;
  char pad[TOKEN_MAX];
  size_t tl = strnlen(token, TOKEN_MAX);
  if (!t || tl == 0 || tl >= TOKEN_MAX)
    return 0;
  memset(pad, 0, sizeof(pad));
  memcpy(pad, token, tl);
  /* Constant time in the token's content: every byte of every accepted token
   * is compared, with no early exit. */
  unsigned ok = 0, op = 0;
  for (size_t k = 0; k < t->n; k++) {
    volatile unsigned char diff = 0;
    for (size_t i = 0; i < TOKEN_MAX; i++)
      diff |= (unsigned char)(pad[i] ^ t->tok[k][i]);
    unsigned hit = (unsigned)(diff == 0);
    ok |= hit;
    op |= hit & t->op[k];
  }
  memset(pad, 0, sizeof(pad));
  return ok ? (op ? 2 : 1) : 0;
}

int attnd_rpc_conn_operator(const attnd_rpc_conn_t *c) {
  const attnd_rpc_t *r = c->rpc;
  if (c->is_unix && (c->identity == 0 || c->identity == r->own_uid))
    return 1;
  if (!c->op_token || !r->tokens)
    return 0;
  /* Checked against the set in force, so a reload that removed the token
   * takes the right away from connections that presented it. */
  for (size_t i = 0; i < r->tokens->n; i++)
    if (r->tokens->op[i] && r->tokens->ident[i] == c->op_token)
      return 1;
  return 0;
}

int attnd_rpc_decode_hello(attnd_rpc_req_t *q, pb_istream_t *s) {
  return attnd_rpc_pb_decode(q, s, attnd_v1_HelloRequest_fields, &q->m.hello);
}

/* A valid token makes the connection usable (on TCP it names the identity;
 * an operator's also lets it change daemon-wide state). A wrong token is
 * UNAUTHENTICATED; on TCP the connection then closes, since carrying on as
 * the shared anonymous identity would expose the client's sessions to every
 * other anonymous client; on the Unix socket it keeps its uid identity and
 * stays open. An empty token where none is needed is a no-op. The token is
 * wiped either way. */
void attnd_rpc_call_hello(attnd_rpc_req_t *q) {
  attnd_rpc_conn_t *c = q->conn;
  const char *token = q->m.hello.token;
  attnd_result_t res;
  memset(&res, 0, sizeof(res));
  int ok = token[0] ? attnd_rpc_token_ok(c->rpc, token) : 0;
  if (ok) {
    uint64_t tid = token_identity(token, strlen(token));
    if (!c->is_unix && tid != c->identity && c->identity_cb && c->identity_cb(c, tid) != 0) {
      res.status = ATTND_ENOSPC;
      snprintf(res.message, sizeof(res.message),
               "too many connections of this identity (--max-connections-per-identity)");
      q->close_after = 1;
    } else {
      if (!c->is_unix)
        c->identity = tid;
      c->op_token = ok == 2 ? tid : 0;
      c->need_hello = 0;
    }
  } else if (token[0] || c->need_hello) {
    ATTND_LOGW("auth_failed", "conn=%llu transport=%s", (unsigned long long)c->id,
               c->is_unix ? "unix" : "tcp");
    res.status = ATTND_EUNAUTH;
    snprintf(res.message, sizeof(res.message), "%s",
             token[0] ? "token not accepted" : "this connection must send Hello{token}");
    if (!c->is_unix || c->need_hello)
      q->close_after = 1;
  }
  memset(&q->m.hello, 0, sizeof(q->m.hello));
  attnd_rpc_done(q, &res);
}

void attnd_rpc_free_tokens(attnd_rpc_t *r) {
  tokens_free(r->tokens);
  r->tokens = NULL;
}
