/* internal.h: base's private declarations, seen only by base/'s own files. */
#ifndef ATTND_BASE_INTERNAL_H
#define ATTND_BASE_INTERNAL_H

#include "base.h"

/* One entry of an id map's bucket chain. */
struct attnd_idnode_s {
  uint64_t key;
  void *val;
  attnd_idnode_t *next;
};

#endif /* ATTND_BASE_INTERNAL_H */
