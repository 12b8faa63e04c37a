/* main.c: attnd's entry point: the options read (config.h), the engine
 * started (engine.h), the RPC server and the HTTP endpoint (/metrics and the
 * probes, net.h) listening, and the loop run until a drain (SIGTERM, SIGINT,
 * or a lost device) ends it. SIGHUP reloads (the log file, the token file)
 * and never ends the daemon (docs/operations.md section 4).
 *
 * Exit codes: 0 after --help, --version, a good --check-config or a clean
 * drain; 2 for a bad configuration or command line; 1 when the daemon cannot
 * start; 3 after its device became unusable (drained first; the supervisor
 * restarts it). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <uv.h>

#include "backend.h"
#include "base.h"
#include "config.h"
#include "engine.h"
#include "net.h"

typedef struct {
  uv_loop_t loop;
  attnd_config_t cfg;
  attnd_engine_t *engine;
  attnd_server_t *server;
  attnd_metrics_t *metrics;
  uv_signal_t sigterm, sigint, sighup;
  uv_timer_t watchdog;
  uv_timer_t log_flush; /* reports the counts of rate-limited log lines */
  int watchdog_on;
  int stopping;
  int exit_code;
} daemon_t;

static void close_rest(daemon_t *d) {
  uv_close((uv_handle_t *)&d->sigterm, NULL);
  uv_close((uv_handle_t *)&d->sigint, NULL);
  uv_close((uv_handle_t *)&d->sighup, NULL);
  uv_close((uv_handle_t *)&d->log_flush, NULL);
  if (d->watchdog_on)
    uv_close((uv_handle_t *)&d->watchdog, NULL);
  if (d->metrics) {
    attnd_metrics_close(d->metrics, NULL, NULL);
    d->metrics = NULL;
  }
}

static void engine_closed_cb(void *arg) {
  daemon_t *d = arg;
  d->engine = NULL;
  ATTND_LOGI("engine_closed", "%s", "");
  attnd_log_limited_flush(1);
  close_rest(d);
}

static void server_drained_cb(void *arg) {
  daemon_t *d = arg;
  d->server = NULL; /* freed by now */
  ATTND_LOGI("drained", "%s", "");
  /* The metrics endpoint reads engine stats: close it before the engine. */
  if (d->metrics) {
    attnd_metrics_close(d->metrics, NULL, NULL);
    d->metrics = NULL;
  }
  attnd_engine_close(d->engine, engine_closed_cb, d);
}

/* A drain begins: /readyz answers 503 from now on, systemd hears STOPPING. */
static void begin_drain(daemon_t *d, const char *status) {
  d->stopping = 1;
  if (d->metrics)
    attnd_metrics_set_ready(d->metrics, 0);
  sd_notifyf(0, "STOPPING=1\nSTATUS=%s", status);
  attnd_server_drain(d->server, server_drained_cb, d);
}

static void signal_cb(uv_signal_t *h, int signum) {
  daemon_t *d = h->data;
  if (d->stopping) {
    ATTND_LOGW("signal_ignored", "signal=%s reason=already_draining", strsignal(signum));
    return;
  }
  ATTND_LOGI("stopping", "signal=%s", strsignal(signum));
  begin_drain(d, "draining");
}

/* The token file, reread on SIGHUP by the RPC layer (a bad file keeps the old
 * set). 1: no token file configured, 0: reloaded, < 0: failed (kept). */
static int reload_tokens(daemon_t *d, char *err, size_t errlen) {
  if (!d->cfg.token_file[0])
    return 1;
  return attnd_auth_reload(attnd_server_rpc(d->server), err, errlen);
}

/* SIGHUP (systemctl reload): reopen the log file (logrotate moved it) and
 * reread the token file. Whatever fails is logged and the old state kept:
 * a reload never stops the daemon. */
static void reload_cb(uv_signal_t *h, int signum) {
  daemon_t *d = h->data;
  char err[512] = "";
  const char *logs = attnd_log_file()[0] ? "reopened" : "stderr";
  if (attnd_log_reopen(err, sizeof(err)) != 0) {
    ATTND_LOGE("reload_failed", "what=log_file reason=\"%s\"", err);
    logs = "failed";
  }
  const char *tokens = "none";
  if (d->cfg.token_file[0] && d->server) {
    err[0] = 0;
    int rc = reload_tokens(d, err, sizeof(err));
    if (rc < 0)
      ATTND_LOGE("reload_failed", "what=token_file reason=\"%s\"", err);
    tokens = rc < 0 ? "failed" : rc == 0 ? "reloaded" : "kept";
  }
  ATTND_LOGI("reloaded", "signal=%s log=%s tokens=%s", strsignal(signum), logs, tokens);
}

/* A sticky device error (engine.h, attnd_engine_on_fatal): drain as on
 * SIGTERM, then exit 3 so that the supervisor restarts the daemon. */
static void device_lost_cb(void *arg) {
  daemon_t *d = arg;
  d->exit_code = 3;
  ATTND_LOGE("device_lost", "reason=\"%s\"", "sticky device error: draining, then exit 3");
  if (d->stopping)
    return;
  begin_drain(d, "device unusable, draining");
}

static void watchdog_cb(uv_timer_t *t) {
  sd_notify(0, "WATCHDOG=1");
}

static void log_flush_cb(uv_timer_t *t) {
  attnd_log_limited_flush(0);
}

/* Options: 0 to start, else the exit code (after --help, --version,
 * --check-config, or a bad configuration: 2, as for every usage error). */
static int configure(daemon_t *d, int argc, char **argv) {
  char err[512] = "";
  attnd_config_pool_t pool;
  attnd_config_defaults(&d->cfg);
  if (attnd_config_parse(&d->cfg, argc, argv, err, sizeof(err)) != 0) {
    attnd_log_plain(ATTND_LOG_ERROR, "attnd: %s\n%s", err,
                    d->cfg.usage_error ? "Try 'attnd --help'.\n" : "");
    return 2;
  }
  if (d->cfg.show_help) {
    fputs(attnd_config_usage(), stdout);
    return -1;
  }
  if (d->cfg.show_version) {
    printf("attnd %s\n", ATTND_VERSION);
    return -1;
  }
  if (attnd_config_validate(&d->cfg, err, sizeof(err)) != 0) {
    attnd_log_plain(ATTND_LOG_ERROR, "attnd: %s\n", err);
    return 2;
  }
  /* The checks the start would make before touching a device: "auto" is
   * resolved the way the engine will resolve it. */
  int cpu = d->cfg.backend == ATTND_BACKEND_CPU ||
            (d->cfg.backend == ATTND_BACKEND_AUTO && !attnd_backend_cuda_available());
  if (attnd_config_check_resources(&d->cfg, cpu, &pool, err, sizeof(err)) != 0) {
    attnd_log_plain(ATTND_LOG_ERROR, "attnd: %s\n", err);
    return 2;
  }
  if (d->cfg.check_config) {
    printf("attnd: configuration ok\n");
    attnd_config_print(&d->cfg, &pool, stdout);
    return -1;
  }
  return 0;
}

/* The engine, the RPC listeners and /metrics; 0 or 1 (logged). */
static int start(daemon_t *d) {
  char err[512] = "";
  int rc;
  if ((rc = uv_loop_init(&d->loop)) != 0) {
    ATTND_LOGE("start_failed", "reason=\"uv_loop_init: %s\"", uv_strerror(rc));
    return 1;
  }
  if ((rc = attnd_engine_init(&d->engine, &d->loop, &d->cfg, err, sizeof(err))) != 0) {
    ATTND_LOGE("start_failed", "stage=engine err=\"%s\" reason=\"%s\"", attnd_strerror(rc), err);
    return 1;
  }
  if (attnd_server_start(&d->server, &d->loop, &d->cfg, d->engine, err, sizeof(err)) != 0) {
    ATTND_LOGE("start_failed", "stage=listen reason=\"%s\"", err);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    return 1;
  }
  attnd_rpc_t *rpc = attnd_server_rpc(d->server);
  if (d->cfg.metrics[0] &&
      attnd_metrics_start(&d->metrics, &d->loop, d->cfg.metrics, &rpc->counters, d->engine,
                          rpc->start_ns, err, sizeof(err)) != 0) {
    ATTND_LOGE("start_failed", "stage=metrics reason=\"%s\"", err);
    return 1;
  }
  return 0;
}

/* Signals, the device-lost callback, systemd's watchdog, the log's timer. */
static void watch(daemon_t *d) {
  uv_signal_init(&d->loop, &d->sigterm);
  uv_signal_init(&d->loop, &d->sigint);
  uv_signal_init(&d->loop, &d->sighup);
  d->sigterm.data = d->sigint.data = d->sighup.data = d;
  uv_signal_start(&d->sigterm, signal_cb, SIGTERM);
  uv_signal_start(&d->sigint, signal_cb, SIGINT);
  uv_signal_start(&d->sighup, reload_cb, SIGHUP);
  attnd_engine_on_fatal(d->engine, device_lost_cb, d);
  uint64_t wd_usec = 0;
  if (sd_watchdog_enabled(0, &wd_usec) > 0 && wd_usec > 0) {
    /* Half the interval, as sd_watchdog_enabled(3) recommends. */
    uint64_t ms = wd_usec / 2000;
    if (ms == 0)
      ms = 1;
    uv_timer_init(&d->loop, &d->watchdog);
    d->watchdog.data = d;
    uv_timer_start(&d->watchdog, watchdog_cb, ms, ms);
    d->watchdog_on = 1;
  }
  uv_timer_init(&d->loop, &d->log_flush);
  uv_timer_start(&d->log_flush, log_flush_cb, ATTND_LOG_RL_WINDOW_MS, ATTND_LOG_RL_WINDOW_MS);
  uv_unref((uv_handle_t *)&d->log_flush);
}

static void notify_ready(daemon_t *d) {
  attnd_engine_info_t info;
  memset(&info, 0, sizeof(info));
  attnd_engine_info(d->engine, &info);
  attnd_rpc_t *rpc = attnd_server_rpc(d->server);
  const char *backend = info.backend ? info.backend : "?";
  if (d->metrics) {
    attnd_metrics_set_build_info(d->metrics, backend, info.device,
                                 attnd_kv_type_name(d->cfg.shape.kv));
    attnd_metrics_set_ready(d->metrics, 1);
  }
  ATTND_LOGI("ready", "version=%s backend=%s device=\"%s\" epoch=%016llx tcp_port=%d socket=%s",
             ATTND_VERSION, backend, info.device, (unsigned long long)rpc->epoch,
             attnd_server_tcp_port(d->server), d->cfg.socket_path[0] ? d->cfg.socket_path : "-");
  sd_notifyf(0, "READY=1\nSTATUS=serving backend=%s tcp_port=%d", backend,
             attnd_server_tcp_port(d->server));
}

int main(int argc, char **argv) {
  static daemon_t d;
  char err[512] = "";
  /* SIGHUP before its handler is installed (while the KV pool is allocated)
   * is ignored rather than fatal: a reload never ends the daemon. */
  signal(SIGHUP, SIG_IGN);
  attnd_log_open(NULL, err, sizeof(err)); /* stderr; priorities if it is the journal */
  int rc = configure(&d, argc, argv);
  if (rc)
    return rc < 0 ? 0 : rc;
  attnd_log_set_level((attnd_log_level_t)attnd_log_level_parse(d.cfg.log_level));
  if (d.cfg.log_file[0] && attnd_log_open(d.cfg.log_file, err, sizeof(err)) != 0) {
    ATTND_LOGE("start_failed", "stage=log reason=\"%s\"", err);
    return 1;
  }
  /* libuv sizes its worker pool from the environment when the pool is first
   * used, which is after this: --worker-threads decides it. */
  char workers[16];
  snprintf(workers, sizeof(workers), "%d", attnd_config_worker_threads(&d.cfg));
  setenv("UV_THREADPOOL_SIZE", workers, 1);
  /* Writes to a client that went away must fail with EPIPE, not kill us. */
  signal(SIGPIPE, SIG_IGN);
  if ((rc = start(&d)) != 0)
    return rc;
  watch(&d);
  notify_ready(&d);
  uv_run(&d.loop, UV_RUN_DEFAULT);
  if (uv_loop_close(&d.loop) != 0) {
    ATTND_LOGE("exit", "reason=\"loop still has open handles\"");
    return 1;
  }
  if (d.exit_code) {
    ATTND_LOGE("exit", "code=%d", d.exit_code);
    return d.exit_code;
  }
  ATTND_LOGI("exit", "code=0");
  return 0;
}
