/* attnctl.h: what the files of attnctl, attnd's command-line client, share.
 *
 * attnctl.c parses the command line (getopt_long) and runs a command, once or
 * watching; attnctl_out.c writes JSON and human units; attnctl_cmds.c holds
 * health, config, stats and sessions; attnctl_bench.c the load generator.
 *
 * Exit codes are part of the interface (docs/operations.md), so scripts can
 * tell a daemon that said no from one that is not there: 0 ok, 1 the daemon
 * answered an error (or the connection broke after it was made), 2 usage,
 * 3 cannot connect. */
#ifndef ATTND_ATTNCTL_H
#define ATTND_ATTNCTL_H

#include <stddef.h>
#include <stdint.h>

#include "attnclient.h"

enum { ATTNCTL_OK = 0, ATTNCTL_DAEMON = 1, ATTNCTL_USAGE = 2, ATTNCTL_CONNECT = 3 };

typedef struct {
  const char *addr;  /* --socket PATH or --tcp HOST:PORT; NULL: the default socket */
  const char *token; /* first line of --token-file, sent in Hello; NULL: none */
  int json;          /* --json: one JSON object per line */
  double watch;      /* --watch SECONDS: repeat every SECONDS; 0 = once */
  int watch_count;   /* --count N: stop after N samples; 0 = until interrupted */
  /* bench */
  int sessions;
  int prompt;
  int steps;
  int depth;
  int repeat;           /* --repeat: prefills */
  int prefill_sessions; /* --prefill-sessions: sessions per prefill step, 0 all */
  int spin;             /* --spin US: attnd_client_set_spin */
  int use_plan;
  int want_lse;
  unsigned seed;
  /* set-sinks */
  int layer;
  const char *sinks; /* comma-separated logits */
} attnctl_opts_t;

/* ---- attnctl_out.c ---- */

/* Session ids and epochs are printed the same way everywhere (attnctl, the
 * daemon's status messages, the Python client's attnd.SessionId): 16
 * lowercase hex digits. buf must hold 17 bytes. */
const char *attnctl_hex64(uint64_t v, char *buf);

/* JSON objects are written member by member; *first tracks the comma. */
void attnctl_json_str(const char *s);
void attnctl_json_kstr(const char *k, const char *v, int *first);
void attnctl_json_ku(const char *k, uint64_t v, int *first);
void attnctl_json_kf(const char *k, double v, int *first); /* non-finite: null */

const char *attnctl_bytes(uint64_t b, char *buf, size_t len);    /* "1.5 GiB" */
const char *attnctl_duration(uint64_t s, char *buf, size_t len); /* "2h03m04s" */
double attnctl_now(void);                                        /* monotonic seconds */
void attnctl_sleep(double s);

/* Prints a failed call's error; returns the exit code it maps to. */
int attnctl_report(attnd_client_t *c, int rc, const char *what);

/* ---- commands: each returns an exit code ---- */

int attnctl_cmd_health(attnd_client_t *c, const attnctl_opts_t *o);
int attnctl_cmd_config(attnd_client_t *c, const attnctl_opts_t *o);
int attnctl_cmd_stats(attnd_client_t *c, const attnctl_opts_t *o);
int attnctl_cmd_sessions(attnd_client_t *c, const attnctl_opts_t *o);
int attnctl_cmd_bench(attnd_client_t *c, const attnctl_opts_t *o);
int attnctl_cmd_set_sinks(attnd_client_t *c, const attnctl_opts_t *o);

/* --watch for health and stats: samples every o->watch seconds until
 * interrupted or o->watch_count samples. *cp is the connection (NULL when the
 * first connect failed); the loop reconnects when the daemon goes away and
 * says when it restarted (new epoch), and leaves its last connection in *cp.
 * Returns the exit code of the last sample. */
int attnctl_watch_health(attnd_client_t **cp, const char *addr, const attnctl_opts_t *o);
int attnctl_watch_stats(attnd_client_t **cp, const char *addr, const attnctl_opts_t *o);

#endif
