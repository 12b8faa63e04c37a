/* clang_compat.h: force-included into kernels/cpu/attend.c in the clang
 * builds only (fuzz), because that file uses GCC's __builtin_shuffle, which
 * clang lacks (clang has __builtin_shufflevector with constant indices). This
 * lane-by-lane stand-in is slow but exact; the fuzz build does not measure
 * kernel speed. */
#ifndef ATTND_CLANG_COMPAT_H
#define ATTND_CLANG_COMPAT_H
#if defined(__clang__)
#define __builtin_shuffle(a, b, m)                                                 \
  __extension__({                                                                  \
    __typeof__(a) r_ = (a);                                                        \
    const int n_ = (int)(sizeof(r_) / sizeof(r_[0]));                              \
    for (int i_ = 0; i_ < n_; i_++) {                                              \
      int j_ = (int)(m)[i_];                                                       \
      r_[i_] = j_ < n_ ? (a)[j_] : (b)[j_ - n_];                                   \
    }                                                                              \
    r_;                                                                            \
  })
#endif
#endif
