/* attnctl: command-line client of attnd (docs/operations.md).
 *
 *   attnctl [--socket P | --tcp H:P] [--token-file F] [--json] COMMAND [options]
 *
 * One getopt_long parser for every option of every command: `--flag value` and
 * `--flag=value` both work, options may come before or after the command, and
 * an option the command does not take is a usage error (exit 2), as is any
 * other mistake on the command line. attnctl.h lists the exit codes. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnctl.h"

static const char *const usage_main =
    "usage: attnctl [--socket PATH | --tcp HOST:PORT] [--token-file FILE] [--json] COMMAND "
    "[options]\n"
    "       attnctl --help | --version\n"
    "\n"
    "Talks to a running attnd. Without --socket or --tcp it looks for the socket in\n"
    "$RUNTIME_DIRECTORY, /run/attnd (root), $XDG_RUNTIME_DIR, /tmp/attnd-$UID, then /run/attnd.\n"
    "\n"
    "commands:\n"
    "  health     daemon status, version, backend, epoch (--watch: until interrupted)\n"
    "  stats      counters: connections, sessions, blocks, prefix cache, methods\n"
    "  sessions   this identity's sessions (ListSessions)\n"
    "  config     the model shape and limits the daemon serves\n"
    "  bench      closed-loop load: prefill, then decode steps with random bf16 data\n"
    "  set-sinks  set one layer's attention sink logits (operator token; SetSinks)\n"
    "\n"
    "options:\n"
    "  --socket PATH      Unix socket of the daemon\n"
    "  --tcp HOST:PORT    TCP address of the daemon\n"
    "  --token-file FILE  send the first line of FILE in Hello (needed off loopback)\n"
    "  --json             machine-readable output (one JSON object per line)\n"
    "  -h, --help         this text; `attnctl COMMAND --help` for a command\n"
    "  -V, --version      attnctl's version\n"
    "\n"
    "Options take their value as `--flag value` or `--flag=value`, before or after\n"
    "the command. Session ids and epochs print as 16 lowercase hex digits.\n"
    "\n"
    "exit codes: 0 ok, 1 the daemon answered an error, 2 usage, 3 cannot connect\n";

static const char *const usage_health =
    "usage: attnctl [global options] health [--watch SECONDS] [--count N]\n"
    "Prints the daemon's status (serving|draining), version, backend and device, epoch,\n"
    "uptime, bound TCP port and KV memory. Exit 0 when it answers.\n"
    "  --watch SECONDS  ask again every SECONDS until interrupted; while the daemon\n"
    "                   does not answer each sample says \"unreachable\" (JSON: status\n"
    "                   \"unreachable\"), and a restart (new epoch) is reported\n"
    "  --count N        stop after N samples; the exit code is the last sample's\n";
static const char *const usage_stats =
    "usage: attnctl [global options] stats [--watch SECONDS] [--count N]\n"
    "Prints the daemon's counters as tables (or JSON with --json).\n"
    "  --watch SECONDS  print them every SECONDS with per-second rates since the\n"
    "                   previous sample, until interrupted; when the daemon goes away\n"
    "                   reconnect every SECONDS and report a restart (new epoch)\n"
    "  --count N        stop after N samples\n";
static const char *const usage_sessions =
    "usage: attnctl [global options] sessions\n"
    "Lists the sessions of the calling identity: id, length (layer 0), blocks, idle time.\n";
static const char *const usage_config =
    "usage: attnctl [global options] config\n"
    "Prints the model shape (layers, heads, head_dim, block size, dtypes, RoPE) and the\n"
    "limits (max context, KV memory, blocks, token capacity) reported by Health.\n";
static const char *const usage_bench =
    "usage: attnctl [global options] bench [--sessions N] [--prompt N] [--steps N]\n"
    "                                      [--depth N] [--inline] [--lse] [--seed N]\n"
    "                                      [--repeat N] [--prefill-sessions N]\n"
    "Closed-loop load generator: opens sessions, prefills their prompts through every\n"
    "layer, then runs decode steps, each a Plan for all sessions and one Step per\n"
    "layer with random bf16 q, k, v. Prints progress, then p50/p99/max latency per\n"
    "layer step and per token, and steps/s.\n"
    "  --sessions N  sessions (default 4)\n"
    "  --prompt N    prompt tokens per session (default 64)\n"
    "  --steps N     decode steps (default 32)\n"
    "  --depth N     layer steps in flight (default 1)\n"
    "  --inline      send the items with every Step instead of a Plan\n"
    "  --lse         ask for the log-sum-exp output too\n"
    "  --seed N      prompts and data (default 1); the same seed hits the prefix cache\n"
    "  --repeat N    prefill N times (the sessions truncated to 0 in between), for\n"
    "                percentiles of large steps (default 1)\n"
    "  --prefill-sessions N  sessions per prefill step (default: all in one)\n"
    "  --spin US     wait for each answer busy-polling up to US microseconds before\n"
    "                sleeping (default 0: sleep at once)\n"
    "Layer steps also get the client's phases (encode, send, wait for the answer,\n"
    "read, parse) and the daemon's total and computing time of each.\n";

static const char *const usage_set_sinks =
    "usage: attnctl [global options] set-sinks --layer N --sinks X1,X2,...\n"
    "Sets layer N's attention sink logits, one finite number per q head (daemons started\n"
    "with attention-sinks; an operator token). Prints the new version.\n"
    "  --layer N        the layer (0-based)\n"
    "  --sinks LIST     q_heads comma-separated logits, in the units of the scaled scores\n";

/* Long-only options get ids from 256; each also names a bit of opt_mask(). */
enum {
  OPT_SOCKET = 256,
  OPT_TCP,
  OPT_TOKEN_FILE,
  OPT_JSON,
  OPT_WATCH,
  OPT_COUNT,
  OPT_SESSIONS,
  OPT_PROMPT,
  OPT_STEPS,
  OPT_DEPTH,
  OPT_INLINE,
  OPT_LSE,
  OPT_SEED,
  OPT_LAYER,
  OPT_SINKS,
  OPT_REPEAT,
  OPT_PREFILL_SESSIONS,
  OPT_SPIN,
};
#define OPT_BIT(id) (1u << ((id)-OPT_SOCKET))
#define OPTS_GLOBAL                                                                                \
  (OPT_BIT(OPT_SOCKET) | OPT_BIT(OPT_TCP) | OPT_BIT(OPT_TOKEN_FILE) | OPT_BIT(OPT_JSON))
#define OPTS_WATCH (OPT_BIT(OPT_WATCH) | OPT_BIT(OPT_COUNT))
#define OPTS_BENCH                                                                                 \
  (OPT_BIT(OPT_SESSIONS) | OPT_BIT(OPT_PROMPT) | OPT_BIT(OPT_STEPS) | OPT_BIT(OPT_DEPTH) |         \
   OPT_BIT(OPT_INLINE) | OPT_BIT(OPT_LSE) | OPT_BIT(OPT_SEED) | OPT_BIT(OPT_REPEAT) |              \
   OPT_BIT(OPT_PREFILL_SESSIONS) | OPT_BIT(OPT_SPIN))
#define OPTS_SINKS (OPT_BIT(OPT_LAYER) | OPT_BIT(OPT_SINKS))

static const struct option long_options[] = {
    {"socket", required_argument, NULL, OPT_SOCKET},
    {"tcp", required_argument, NULL, OPT_TCP},
    {"token-file", required_argument, NULL, OPT_TOKEN_FILE},
    {"json", no_argument, NULL, OPT_JSON},
    {"watch", required_argument, NULL, OPT_WATCH},
    {"count", required_argument, NULL, OPT_COUNT},
    {"sessions", required_argument, NULL, OPT_SESSIONS},
    {"prompt", required_argument, NULL, OPT_PROMPT},
    {"steps", required_argument, NULL, OPT_STEPS},
    {"depth", required_argument, NULL, OPT_DEPTH},
    {"inline", no_argument, NULL, OPT_INLINE},
    {"lse", no_argument, NULL, OPT_LSE},
    {"seed", required_argument, NULL, OPT_SEED},
    {"layer", required_argument, NULL, OPT_LAYER},
    {"sinks", required_argument, NULL, OPT_SINKS},
    {"repeat", required_argument, NULL, OPT_REPEAT},
    {"prefill-sessions", required_argument, NULL, OPT_PREFILL_SESSIONS},
    {"spin", required_argument, NULL, OPT_SPIN},
    {"help", no_argument, NULL, 'h'},
    {"version", no_argument, NULL, 'V'},
    {NULL, 0, NULL, 0},
};

typedef struct {
  const char *name;
  int (*fn)(attnd_client_t *, const attnctl_opts_t *);
  /* --watch for this command, or NULL when it has none */
  int (*watch)(attnd_client_t **, const char *, const attnctl_opts_t *);
  const char *usage;
  unsigned opts; /* options it takes besides the global ones */
} command_t;

static const command_t commands[] = {
    {"health", attnctl_cmd_health, attnctl_watch_health, usage_health, OPTS_WATCH},
    {"stats", attnctl_cmd_stats, attnctl_watch_stats, usage_stats, OPTS_WATCH},
    {"sessions", attnctl_cmd_sessions, NULL, usage_sessions, 0},
    {"config", attnctl_cmd_config, NULL, usage_config, 0},
    {"bench", attnctl_cmd_bench, NULL, usage_bench, OPTS_BENCH},
    {"set-sinks", attnctl_cmd_set_sinks, NULL, usage_set_sinks, OPTS_SINKS},
};

static int usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "attnctl: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\nTry 'attnctl --help'.\n");
  return ATTNCTL_USAGE;
}

static int parse_int(const char *s, int min, int *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || end == s || v < min || v > 1000000000)
    return -1;
  *out = (int)v;
  return 0;
}

static const char *option_name(int id) {
  for (const struct option *p = long_options; p->name; p++)
    if (p->val == id)
      return p->name;
  return "?";
}

static int read_token(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "attnctl: cannot read token file %s: %s\n", path, strerror(errno));
    return -1;
  }
  if (!fgets(buf, (int)len, f))
    buf[0] = 0;
  fclose(f);
  buf[strcspn(buf, "\r\n")] = 0;
  return 0;
}

/* The one operand: the command. Returns -1, or the exit code of a usage error. */
static int set_command(const command_t **cmd, const char *arg) {
  if (*cmd)
    return usage_error("unexpected argument '%s'", arg);
  for (size_t k = 0; k < sizeof(commands) / sizeof(commands[0]); k++)
    if (strcmp(arg, commands[k].name) == 0)
      *cmd = &commands[k];
  if (!*cmd)
    return usage_error("unknown command '%s'", arg);
  return -1;
}

/* Parses argv into *o and the command; returns -1 to go on, else an exit code
 * (after --help, --version or a usage error). */
static int parse_args(int argc, char **argv, attnctl_opts_t *o, const command_t **cmdp,
                      const char **token_file) {
  const char *socket_path = NULL, *tcp = NULL;
  const command_t *cmd = NULL;
  unsigned given = 0;
  int help = 0, version = 0, ch, code;
  /* '-': operands come back in order as 1, whatever POSIXLY_CORRECT says;
   * ':': a missing value is reported as ':' and worded here. */
  opterr = 0;
  while ((ch = getopt_long(argc, argv, "-:hV", long_options, NULL)) != -1) {
    const char *a = argv[optind - 1];
    if (ch >= OPT_SOCKET)
      given |= OPT_BIT(ch);
    switch (ch) {
    case 1:
      if ((code = set_command(&cmd, optarg)) >= 0)
        return code;
      break;
    case 'h':
      help = 1;
      break;
    case 'V':
      version = 1;
      break;
    case OPT_SOCKET:
      socket_path = optarg;
      break;
    case OPT_TCP:
      tcp = optarg;
      break;
    case OPT_TOKEN_FILE:
      *token_file = optarg;
      break;
    case OPT_JSON:
      o->json = 1;
      break;
    case OPT_WATCH: {
      char *end;
      o->watch = strtod(optarg, &end);
      if (*end || end == optarg || !(o->watch > 0) || o->watch > 1e6)
        return usage_error("--watch wants a number of seconds > 0, not '%s'", optarg);
      break;
    }
    case OPT_INLINE:
      o->use_plan = 0;
      break;
    case OPT_LSE:
      o->want_lse = 1;
      break;
    case OPT_LAYER:
      if (parse_int(optarg, 0, &o->layer))
        return usage_error("--layer wants an integer >= 0, not '%s'", optarg);
      break;
    case OPT_SINKS:
      o->sinks = optarg;
      break;
    case OPT_SEED: {
      int s;
      if (parse_int(optarg, 0, &s))
        return usage_error("--seed wants an integer >= 0, not '%s'", optarg);
      o->seed = (unsigned)s;
      break;
    }
    case OPT_COUNT:
    case OPT_SESSIONS:
    case OPT_PROMPT:
    case OPT_STEPS:
    case OPT_REPEAT:
    case OPT_PREFILL_SESSIONS:
    case OPT_SPIN:
    case OPT_DEPTH: {
      int *field = ch == OPT_COUNT              ? &o->watch_count
                   : ch == OPT_SESSIONS         ? &o->sessions
                   : ch == OPT_PROMPT           ? &o->prompt
                   : ch == OPT_STEPS            ? &o->steps
                   : ch == OPT_REPEAT           ? &o->repeat
                   : ch == OPT_PREFILL_SESSIONS ? &o->prefill_sessions
                   : ch == OPT_SPIN             ? &o->spin
                                                : &o->depth;
      int min = ch == OPT_PROMPT || ch == OPT_STEPS || ch == OPT_SPIN ? 0 : 1;
      if (parse_int(optarg, min, field)) {
        fprintf(stderr, "attnctl: --%s wants an integer >= %d, not '%s'\nTry 'attnctl --help'.\n",
                option_name(ch), min, optarg);
        return ATTNCTL_USAGE;
      }
      break;
    }
    case ':':
      return usage_error("option '%s' needs a value", a);
    default:
      if (strncmp(a, "--", 2) == 0 && strchr(a, '=')) {
        /* "--json=1": a switch given a value (getopt_long says only '?'). */
        size_t n = (size_t)(strchr(a, '=') - a - 2);
        for (const struct option *p = long_options; p->name; p++)
          if (p->has_arg == no_argument && strlen(p->name) == n && strncmp(a + 2, p->name, n) == 0)
            return usage_error("option '--%s' takes no value", p->name);
      }
      /* getopt_long leaves an unknown long option's text in argv[optind - 1]. */
      if (optopt && optopt < OPT_SOCKET && strncmp(a, "--", 2) != 0) {
        char s[3] = {'-', (char)optopt, 0};
        return usage_error("unknown option '%s'", s);
      }
      return usage_error("unknown option '%s'", a);
    }
  }
  for (; optind < argc; optind++) /* operands after "--" */
    if ((code = set_command(&cmd, argv[optind])) >= 0)
      return code;
  if (version) {
    printf("attnctl %s\n", ATTND_VERSION);
    return ATTNCTL_OK;
  }
  if (help) {
    fputs(cmd ? cmd->usage : usage_main, stdout);
    return ATTNCTL_OK;
  }
  if (!cmd) {
    fputs(usage_main, stderr);
    return ATTNCTL_USAGE;
  }
  unsigned stray = given & ~(OPTS_GLOBAL | cmd->opts);
  for (int id = OPT_SOCKET; stray; id++)
    if (stray & OPT_BIT(id)) {
      fprintf(stderr, "attnctl: '%s' takes no --%s\nTry 'attnctl %s --help'.\n", cmd->name,
              option_name(id), cmd->name);
      return ATTNCTL_USAGE;
    }
  if (cmd->opts == OPTS_SINKS && (given & OPTS_SINKS) != OPTS_SINKS)
    return usage_error("%s", "set-sinks needs --layer and --sinks");
  if ((given & OPT_BIT(OPT_COUNT)) && !(given & OPT_BIT(OPT_WATCH)))
    return usage_error("%s", "--count needs --watch");
  if (socket_path && tcp)
    return usage_error("%s", "--socket and --tcp exclude each other");
  o->addr = tcp ? tcp : socket_path;
  *cmdp = cmd;
  return -1;
}

int main(int argc, char **argv) {
  attnctl_opts_t o;
  memset(&o, 0, sizeof(o));
  o.sessions = 4;
  o.prompt = 64;
  o.steps = 32;
  o.depth = 1;
  o.repeat = 1;
  o.use_plan = 1;
  o.seed = 1;
  const command_t *cmd = NULL;
  const char *token_file = NULL;
  int code = parse_args(argc, argv, &o, &cmd, &token_file);
  if (code >= 0)
    return code;

  char token[512] = "";
  if (token_file && read_token(token_file, token, sizeof(token)))
    return ATTNCTL_USAGE;
  if (token_file)
    o.token = token;

  attnd_client_t *c = NULL;
  int rc = attnd_client_connect(&c, o.addr);
  if (rc && !c) {
    fprintf(stderr, "attnctl: out of memory\n");
    return ATTNCTL_DAEMON;
  }
  if (o.watch > 0) {
    /* A watch starts even while the daemon is down: it waits for it. */
    char addr[300];
    snprintf(addr, sizeof(addr), "%s", attnd_client_addr(c));
    if (rc) {
      attnd_client_free(c);
      c = NULL;
    } else {
      attnd_client_set_timeout(c, 30000);
      if (o.token && (rc = attnd_client_hello(c, o.token)) != 0) {
        code = attnctl_report(c, rc, "hello");
        attnd_client_free(c);
        return code;
      }
    }
    code = cmd->watch(&c, addr, &o);
    attnd_client_free(c);
    return code;
  }
  if (rc) {
    fprintf(stderr, "attnctl: %s\n", attnd_client_errmsg(c));
    attnd_client_free(c);
    return ATTNCTL_CONNECT;
  }
  /* Interactive commands should not hang on a wedged daemon; bench waits as long
   * as its steps take. */
  if (cmd->fn != attnctl_cmd_bench)
    attnd_client_set_timeout(c, 30000);
  if (o.token && (rc = attnd_client_hello(c, o.token)) != 0)
    code = attnctl_report(c, rc, "hello");
  else
    code = cmd->fn(c, &o);
  attnd_client_free(c);
  return code;
}
