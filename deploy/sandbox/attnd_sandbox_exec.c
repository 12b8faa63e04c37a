/* attnd-sandbox-exec: runs a command under the system call sandbox of
 * attnd.service, for hosts and containers where systemd cannot start the unit
 * (a Kubernetes pod, a CI container, a GPU box without systemd as PID 1).
 *
 *   attnd-sandbox-exec --allow system-service.list --deny privileged.list
 *                      [--families AF_UNIX,AF_INET,AF_INET6,AF_NETLINK]
 *                      [--errno EPERM] -- attnd --backend cuda ...
 *
 * What it reproduces, as systemd 252 applies them (systemd.exec(5)):
 *  - SystemCallFilter= as an allow list (the --allow lists) minus a deny list
 *    (the --deny lists), every other call failing with SystemCallErrorNumber=
 *    (--errno, default EPERM); SystemCallArchitectures=native (a call from
 *    another ABI kills the process, libseccomp's default for a foreign arch);
 *  - NoNewPrivileges=yes (libseccomp sets it before loading the filter);
 *  - RestrictAddressFamilies= (socket() of another family: EAFNOSUPPORT);
 *  - LockPersonality=yes (personality() only queries or keeps PER_LINUX);
 *  - RestrictNamespaces=yes (clone/unshare with a CLONE_NEW* flag and setns
 *    fail; clone3 answers ENOSYS so that the C library falls back to clone,
 *    whose flags a filter can see: what systemd does).
 * The file system and device settings (ProtectSystem=, DevicePolicy=, ...)
 * are not system calls: deploy/sandbox-check.sh --no-systemd checks what it
 * can of them around this tool. The lists are plain system call names, one
 * per line, '#' comments; deploy/sandbox/expand_filter.py makes them from
 * systemd's groups. Names this architecture does not have are skipped, as
 * systemd skips them. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <sched.h>
#include <seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/personality.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_CALLS 1024

struct names {
  char *v[MAX_CALLS];
  int n;
};

static int names_has(const struct names *s, const char *name) {
  for (int i = 0; i < s->n; i++)
    if (strcmp(s->v[i], name) == 0)
      return 1;
  return 0;
}

static int names_load(struct names *s, const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "attnd-sandbox-exec: %s: %s\n", path, strerror(errno));
    return -1;
  }
  char line[256];
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, " \t\r\n#")] = '\0';
    if (!line[0] || names_has(s, line))
      continue;
    if (s->n == MAX_CALLS) {
      fprintf(stderr, "attnd-sandbox-exec: %s: more than %d names\n", path, MAX_CALLS);
      fclose(f);
      return -1;
    }
    s->v[s->n] = strdup(line);
    if (!s->v[s->n]) {
      fclose(f);
      return -1;
    }
    s->n++;
  }
  fclose(f);
  return 0;
}

static const struct {
  const char *name;
  int value;
} families[] = {
    {"AF_UNIX", AF_UNIX},       {"AF_INET", AF_INET},     {"AF_INET6", AF_INET6},
    {"AF_NETLINK", AF_NETLINK}, {"AF_PACKET", AF_PACKET}, {"AF_VSOCK", AF_VSOCK},
};

static int family_value(const char *name) {
  for (size_t i = 0; i < sizeof families / sizeof families[0]; i++)
    if (strcmp(families[i].name, name) == 0)
      return families[i].value;
  return -1;
}

static int usage(void) {
  fprintf(stderr, "usage: attnd-sandbox-exec --allow LIST [--allow LIST] [--deny LIST] "
                  "[--families AF_UNIX,...] [--errno EPERM|EACCES|ENOSYS] -- COMMAND [ARG...]\n");
  return 2;
}

/* Calls the filter treats by their arguments, never allowed outright. */
static int special(const char *name) {
  static const char *const s[] = {"socket", "personality", "clone", "clone3", "unshare", "setns"};
  for (size_t i = 0; i < sizeof s / sizeof s[0]; i++)
    if (strcmp(s[i], name) == 0)
      return 1;
  return 0;
}

#define RULE(ctx, act, call, ...)                                                                  \
  do {                                                                                             \
    int r_ = seccomp_rule_add(ctx, act, SCMP_SYS(call), __VA_ARGS__);                              \
    if (r_ < 0 && r_ != -EDOM) {                                                                   \
      fprintf(stderr, "attnd-sandbox-exec: rule for %s: %s\n", #call, strerror(-r_));              \
      goto fail;                                                                                   \
    }                                                                                              \
  } while (0)

int main(int argc, char **argv) {
  struct names allow = {0}, deny = {0};
  int fam_ok[64] = {0}, have_families = 0, err = EPERM, i;
  for (i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--") == 0) {
      i++;
      break;
    }
    if (i + 1 >= argc)
      return usage();
    if (strcmp(argv[i], "--allow") == 0) {
      if (names_load(&allow, argv[++i]) < 0)
        return 1;
    } else if (strcmp(argv[i], "--deny") == 0) {
      if (names_load(&deny, argv[++i]) < 0)
        return 1;
    } else if (strcmp(argv[i], "--families") == 0) {
      char *list = strdup(argv[++i]), *save = NULL;
      for (char *t = strtok_r(list, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
        int v = family_value(t);
        if (v < 0 || v >= 64) {
          fprintf(stderr, "attnd-sandbox-exec: unknown address family %s\n", t);
          return 2;
        }
        fam_ok[v] = 1;
      }
      free(list);
      have_families = 1;
    } else if (strcmp(argv[i], "--errno") == 0) {
      const char *e = argv[++i];
      err = strcmp(e, "EPERM") == 0    ? EPERM
            : strcmp(e, "EACCES") == 0 ? EACCES
            : strcmp(e, "ENOSYS") == 0 ? ENOSYS
                                       : -1;
      if (err < 0)
        return usage();
    } else {
      return usage();
    }
  }
  if (i >= argc || allow.n == 0)
    return usage();

  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ERRNO((unsigned)err));
  if (!ctx) {
    fprintf(stderr, "attnd-sandbox-exec: seccomp_init failed\n");
    return 1;
  }
  int skipped = 0;
  for (int k = 0; k < allow.n; k++) {
    const char *name = allow.v[k];
    if (names_has(&deny, name) || special(name))
      continue;
    int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR || nr < 0) {
      skipped++;
      continue;
    }
    int r = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0);
    if (r < 0 && r != -EDOM) {
      fprintf(stderr, "attnd-sandbox-exec: rule for %s: %s\n", name, strerror(-r));
      goto fail;
    }
  }
  const scmp_datum_t ns = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID |
                          CLONE_NEWNET | CLONE_NEWCGROUP | 0x00000080 /* CLONE_NEWTIME */;
  if (names_has(&allow, "clone") && !names_has(&deny, "clone"))
    RULE(ctx, SCMP_ACT_ALLOW, clone, 1, SCMP_A0(SCMP_CMP_MASKED_EQ, ns, 0));
  if (names_has(&allow, "clone3") && !names_has(&deny, "clone3"))
    RULE(ctx, SCMP_ACT_ERRNO(ENOSYS), clone3, 0);
  if (names_has(&allow, "unshare") && !names_has(&deny, "unshare"))
    RULE(ctx, SCMP_ACT_ALLOW, unshare, 1, SCMP_A0(SCMP_CMP_MASKED_EQ, ns, 0));
  if (names_has(&allow, "personality") && !names_has(&deny, "personality")) {
    RULE(ctx, SCMP_ACT_ALLOW, personality, 1, SCMP_A0(SCMP_CMP_EQ, PER_LINUX));
    RULE(ctx, SCMP_ACT_ALLOW, personality, 1, SCMP_A0(SCMP_CMP_EQ, 0xffffffffu));
  }
  if (names_has(&allow, "socket") && !names_has(&deny, "socket")) {
    for (int f = 0; f < 64; f++) {
      if (have_families && !fam_ok[f])
        RULE(ctx, SCMP_ACT_ERRNO(EAFNOSUPPORT), socket, 1, SCMP_A0(SCMP_CMP_EQ, (scmp_datum_t)f));
      else
        RULE(ctx, SCMP_ACT_ALLOW, socket, 1, SCMP_A0(SCMP_CMP_EQ, (scmp_datum_t)f));
    }
    RULE(ctx, SCMP_ACT_ERRNO(EAFNOSUPPORT), socket, 1, SCMP_A0(SCMP_CMP_GE, 64));
  }
  fprintf(stderr,
          "attnd-sandbox-exec: %d calls allowed, %d denied by name, %d not on this architecture, "
          "errno %d, families %s\n",
          allow.n, deny.n, skipped, err, have_families ? "restricted" : "any");
  int lr = seccomp_load(ctx);
  if (lr < 0) {
    /* 125: this host or container does not let a process install a filter
     * (a test skips then, as it cannot check anything). */
    fprintf(stderr, "attnd-sandbox-exec: seccomp_load: %s\n", strerror(-lr));
    seccomp_release(ctx);
    return 125;
  }
  seccomp_release(ctx);
  execvp(argv[i], argv + i);
  fprintf(stderr, "attnd-sandbox-exec: %s: %s\n", argv[i], strerror(errno));
  return 127;
fail:
  seccomp_release(ctx);
  return 1;
}
