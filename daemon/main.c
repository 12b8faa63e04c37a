/* main.c: attnd's entry point: the options read (config.h), the engine
 * started (engine.h), the RPC server and /metrics listening (net.h), and the
 * loop run until a drain (SIGTERM, SIGINT, or a lost device) ends it.
 *
 * Exit codes: 0 after --help, --version, a good --check-config or a clean
 * drain; 2 for a bad configuration; 1 when the daemon cannot start; 3 after
 * its device became unusable (drained first; the supervisor restarts it). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <uv.h>

#include "config.h"
#include "engine.h"
#include "base.h"
#include "net.h"

typedef struct {
  uv_loop_t loop;
  attnd_config_t cfg;
  attnd_engine_t *engine;
  attnd_server_t *server;
  attnd_metrics_t *metrics;
  uv_signal_t sigterm, sigint;
  uv_timer_t watchdog;
  int watchdog_on;
  int stopping;
  int exit_code;
} daemon_t;

static void close_rest(daemon_t *d) {
  uv_close((uv_handle_t *)&d->sigterm, NULL);
  uv_close((uv_handle_t *)&d->sigint, NULL);
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

static void signal_cb(uv_signal_t *h, int signum) {
  daemon_t *d = h->data;
  if (d->stopping) {
    ATTND_LOGW("signal_ignored", "signal=%s reason=already_draining", strsignal(signum));
    return;
  }
  d->stopping = 1;
  ATTND_LOGI("stopping", "signal=%s", strsignal(signum));
  sd_notify(0, "STOPPING=1\nSTATUS=draining");
  attnd_server_drain(d->server, server_drained_cb, d);
}

/* A sticky device error (engine.h, attnd_engine_on_fatal): drain as on
 * SIGTERM, then exit 3 so that the supervisor restarts the daemon. */
static void device_lost_cb(void *arg) {
  daemon_t *d = arg;
  d->exit_code = 3;
  ATTND_LOGE("device_lost", "reason=\"%s\"", "sticky device error: draining, then exit 3");
  if (d->stopping)
    return;
  d->stopping = 1;
  sd_notify(0, "STOPPING=1\nSTATUS=device unusable, draining");
  attnd_server_drain(d->server, server_drained_cb, d);
}

static void watchdog_cb(uv_timer_t *t) {
  sd_notify(0, "WATCHDOG=1");
}

/* Options: 0 to start, else the exit code (after --help, --version,
 * --check-config, or a bad configuration: 2). */
static int configure(daemon_t *d, int argc, char **argv) {
  char err[512] = "";
  attnd_config_defaults(&d->cfg);
  if (attnd_config_parse(&d->cfg, argc, argv, err, sizeof(err)) != 0) {
    fprintf(stderr, "attnd: %s\n", err);
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
    fprintf(stderr, "attnd: %s\n", err);
    return 2;
  }
  if (d->cfg.check_config) {
    printf("attnd: configuration ok\n");
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

/* Signals, the device-lost callback and systemd's watchdog. */
static void watch(daemon_t *d) {
  uv_signal_init(&d->loop, &d->sigterm);
  uv_signal_init(&d->loop, &d->sigint);
  d->sigterm.data = d->sigint.data = d;
  uv_signal_start(&d->sigterm, signal_cb, SIGTERM);
  uv_signal_start(&d->sigint, signal_cb, SIGINT);
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
}

static void notify_ready(daemon_t *d) {
  attnd_engine_info_t info;
  memset(&info, 0, sizeof(info));
  attnd_engine_info(d->engine, &info);
  attnd_rpc_t *rpc = attnd_server_rpc(d->server);
  ATTND_LOGI("ready", "version=%s backend=%s device=\"%s\" epoch=%016llx tcp_port=%d socket=%s",
             ATTND_VERSION, info.backend ? info.backend : "?", info.device,
             (unsigned long long)rpc->epoch, attnd_server_tcp_port(d->server),
             d->cfg.socket_path[0] ? d->cfg.socket_path : "-");
  sd_notifyf(0, "READY=1\nSTATUS=serving backend=%s tcp_port=%d", info.backend ? info.backend : "?",
             attnd_server_tcp_port(d->server));
}

int main(int argc, char **argv) {
  static daemon_t d;
  int rc = configure(&d, argc, argv);
  if (rc)
    return rc < 0 ? 0 : rc;
  attnd_log_set_level((attnd_log_level_t)attnd_log_level_parse(d.cfg.log_level));
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
