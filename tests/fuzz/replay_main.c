/* replay_main: runs fuzz_rpc's LLVMFuzzerTestOneInput over files and
 * directories without libFuzzer, so the seed corpus and every crash the fuzzer
 * ever found (tests/fuzz/regressions/) replay under ctest with any compiler,
 * the gcc ASan+UBSan build included. Exits non-zero if no input was run. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    exit(2);
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
  if (!buf || (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
    fprintf(stderr, "%s: read failed\n", path);
    exit(2);
  }
  fclose(f);
  fprintf(stderr, "replay %s (%ld bytes)\n", path, n);
  LLVMFuzzerTestOneInput(buf, (size_t)n);
  free(buf);
  return 1;
}

static int run_path(const char *path) {
  struct stat st;
  if (stat(path, &st) != 0) {
    perror(path);
    exit(2);
  }
  if (!S_ISDIR(st.st_mode))
    return run_file(path);
  DIR *d = opendir(path);
  if (!d) {
    perror(path);
    exit(2);
  }
  int ran = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char p[4096];
    snprintf(p, sizeof(p), "%s/%s", path, e->d_name);
    ran += run_path(p);
  }
  closedir(d);
  return ran;
}

int main(int argc, char **argv) {
  int ran = 0;
  for (int i = 1; i < argc; i++)
    ran += run_path(argv[i]);
  fprintf(stderr, "replayed %d inputs\n", ran);
  return ran > 0 ? 0 : 1;
}
