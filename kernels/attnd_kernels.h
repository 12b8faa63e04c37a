/* attnd_kernels.h: the one C ABI between the daemon and its attention math.
 *
 * Both backends (kernels/cpu, kernels/cuda) compute the same function, defined
 * by docs/numerics.md, over the same data layout defined here. The
 * daemon builds one attnd_kbatch_t per (layer, step) and runs two phases:
 *
 *   1. write:  RoPE on q (in place) and on the new k; k and v rounded to the
 *              activation dtype, quantized to the cache type and stored at
 *              their positions through each item's block table;
 *   2. attend: for every item with q, every q row attends over keys
 *              0 .. start+n-1 of its session (as the cache holds them,
 *              dequantized, the new tokens included) under the item's mask.
 *
 * Phase 2 must not start before phase 1 has finished for the whole batch.
 * Neither phase allocates; neither phase reads anything not named here.
 *
 * Block layout (canonical, used by both backends, so a block is a plain byte
 * range that copy-on-write can memcpy). A layer's cache is `num_blocks`
 * consecutive blocks of attnd_kv_block_bytes() bytes. Inside one block:
 *
 *   K data   [kv_heads][block_size][head_dim]   elements of the storage type
 *   V data   [kv_heads][block_size][head_dim]
 *   K scales [kv_heads][block_size] fp32        (dynamic types only)
 *   V scales [kv_heads][block_size] fp32        (dynamic types only)
 *
 * Storage types: bf16/fp16 2 bytes; int8 and fp8 (e4m3) 1 byte; int4 two
 * values per byte, channel 2c in the low nibble and channel 2c+1 in the high
 * nibble, stored unsigned (u in 0..15, value = (u - z) * s).
 */
#ifndef ATTND_KERNELS_H
#define ATTND_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Activation / tensor element types. Values match attnd.v1.DType. */
typedef enum {
  ATTND_DT_BF16 = 1,
  ATTND_DT_FP16 = 2,
  ATTND_DT_FP32 = 3,
  ATTND_DT_INT32 = 4,
} attnd_dtype_t;

typedef enum {
  ATTND_KV_BF16 = 0,
  ATTND_KV_FP16 = 1,
  ATTND_KV_INT8 = 2,         /* static scale, per head or per channel */
  ATTND_KV_FP8 = 3,          /* e4m3, static scale, per head or per channel */
  ATTND_KV_INT8_DYNAMIC = 4, /* per (token, kv head) fp32 scale in the block */
  ATTND_KV_FP8_DYNAMIC = 5,  /* per (token, kv head) fp32 scale in the block */
  ATTND_KV_INT4 = 6,         /* static per (kv head, channel) scale and zero point */
  ATTND_KV_COUNT_ = 7,
} attnd_kv_type_t;

typedef enum {
  ATTND_ROPE_NONE = 0,
  ATTND_ROPE_NEOX = 1,        /* pairs (i, i + rotary_dim/2) */
  ATTND_ROPE_INTERLEAVED = 2, /* pairs (2i, 2i+1) */
} attnd_rope_t;

/* Masks as the kernels see them. The daemon expands DOCUMENT into INTERVALS. */
typedef enum {
  ATTND_MASK_CAUSAL = 0,    /* j <= p */
  ATTND_MASK_FULL = 1,      /* every key 0 .. kv_len-1 */
  ATTND_MASK_SLIDING = 2,   /* max(0, p-w+1) <= j <= p, w = mask_param >= 1 */
  ATTND_MASK_PREFIX_LM = 3, /* j < n (n = mask_param) or j <= p */
  ATTND_MASK_INTERVALS = 4, /* FlashMask column intervals, see attnd_kitem_t */
} attnd_mask_kind_t;

/* Fixed at daemon start. */
typedef struct {
  int32_t q_heads;          /* q_heads % kv_heads == 0 */
  int32_t kv_heads;
  int32_t head_dim;         /* 64, 128 or 256 */
  int32_t block_size;       /* 16, 32, 64 or 128 */
  attnd_dtype_t dtype;      /* activations: ATTND_DT_BF16 or ATTND_DT_FP16 */
  attnd_kv_type_t kv;
  attnd_rope_t rope;
  double rope_theta;
  int32_t rotary_dim;       /* even, <= head_dim; 0 means head_dim */
  float softmax_scale;      /* > 0; the daemon defaults it to 1/sqrt(head_dim) */
  float softcap;            /* logit soft-capping: scores become
                             * softcap * tanh(softmax_scale * q.k / softcap) before
                             * masking and the softmax; 0: none (docs/numerics.md) */
  /* Head sharding (docs/scale-out.md): q_heads and kv_heads above are the heads
   * this daemon holds, kv heads [kv_head_begin, kv_head_begin + kv_heads) of
   * the model's model_kv_heads. Nothing computes with them but work planning
   * that must cut a shard's heads as the whole model's would be cut (CUDA
   * split-KV), so that a shard's outputs are the whole model's bits.
   * model_kv_heads 0: the whole model (= kv_heads). */
  int32_t model_kv_heads;
  int32_t kv_head_begin;
} attnd_kshape_t;

/* The model's kv heads over all shards (model_kv_heads, or kv_heads when 0). */
static inline int32_t attnd_kshape_model_kv_heads(const attnd_kshape_t *s) {
  return s->model_kv_heads > 0 ? s->model_kv_heads : s->kv_heads;
}

/* One session's part of a batch. All offsets are in rows or int32 elements. */
typedef struct {
  int32_t start;        /* absolute position of the first new token */
  int32_t n;            /* new tokens, >= 1; kv_len = start + n */
  int32_t q_row;        /* first row of this item in q/out/lse; -1: no q (write only) */
  int32_t kv_row;       /* first row of this item in k/v */
  int32_t mask_kind;    /* attnd_mask_kind_t */
  int32_t mask_param;   /* SLIDING: window w; PREFIX_LM: prefix length n */
  int32_t causal;       /* INTERVALS: 1 = intervals apply on top of causal */
  int32_t intervals;    /* INTERVALS: offset in meta of int32 [4][kv_len]:
                         * lts, lte, uts, ute. Row p is masked from key j when
                         * lts[j] <= p < lte[j] or uts[j] <= p < ute[j]. */
  int32_t block_table;  /* offset in meta of int32 [ceil(kv_len/block_size)]:
                         * logical block -> physical block in this layer's pool */
  int32_t flags;        /* ATTND_ITEM_* bits */
  int32_t pos_base;     /* RoPE only: row t of the item is rotated at position
                         * pos_base + start + t. The daemon keeps positions
                         * relative to a split-context session's base and passes
                         * the base here (docs/scale-out.md); masks and block
                         * tables see start + t. 0: absolute positions. */
} attnd_kitem_t;

/* attnd_kitem_t.flags */
enum {
  /* The layer's sink logits (attnd_kbatch_t.sinks) join this item's softmax
   * denominators. Set for sessions whose first position is 0; a split-context
   * part that starts later leaves it clear, so that merging the parts by lse
   * counts each sink once (docs/numerics.md). */
  ATTND_ITEM_SINK = 1,
};

/* One (layer, step). For the CPU backend every pointer is host memory; for the
 * CUDA backend every pointer (items and meta included) is device memory. */
typedef struct {
  const attnd_kitem_t *items;  /* [nitems] */
  int32_t nitems;
  const int32_t *meta;         /* block tables and mask intervals of the items */
  int32_t total_q;             /* Tq: rows in q, out, lse */
  int32_t total_kv;            /* T: rows in k, v */
  int32_t q_only_rows;         /* q rows of attend-only items (docs/scale-out.md): such
                                * an item has no k/v rows and writes nothing; its
                                * kv_row is T + the q-only rows of the attend-only
                                * items before it (virtual rows after k/v's), and
                                * phase 1 only rotates its q. They follow every
                                * other item in items[]. 0: none. */
  int32_t max_kv_len;          /* max over items of start + n (planning hint) */
  int32_t max_n;               /* max over items of n (planning hint) */
  int64_t kv_sum;              /* sum over items of start + n (planning hint: how
                                * even the contexts are; 0: unknown) */
  void *q;                     /* [Tq][q_heads][head_dim] dtype; rotated in place by phase 1 */
  const void *k;               /* [T][kv_heads][head_dim] dtype */
  const void *v;               /* [T][kv_heads][head_dim] dtype */
  void *out;                   /* [Tq][q_heads][head_dim] dtype, or fp32 when out_fp32 */
  int32_t out_fp32;
  float *lse;                  /* [Tq][q_heads] fp32, natural log; NULL when not asked */
  uint8_t *cache;              /* this layer's block pool */
  size_t block_bytes;          /* attnd_kv_block_bytes(shape) */
  /* Static quantization of this layer; NULL where the type has none.
   * int8/fp8: k_scale, v_scale fp32 [kv_heads] or [kv_heads][head_dim].
   * int4: k_scale, v_scale, k_zero, v_zero fp32 [kv_heads][head_dim]. */
  const float *k_scale;
  const float *v_scale;
  const float *k_zero;
  const float *v_zero;
  int32_t scale_per_channel;   /* 1: scales are [kv_heads][head_dim] */
  /* Per-layer attention variants (docs/numerics.md). */
  int32_t window;              /* sliding layer: row p sees keys j > p - window (and
                                * what the item's mask allows); 0: full layer */
  const float *sinks;          /* [q_heads] fp32 sink logits, in the units of the
                                * scaled (and capped) scores; NULL: none. Used by
                                * items with ATTND_ITEM_SINK: the denominator gains
                                * exp(sink), lse = log(sum_j exp(s_j) + exp(sink)),
                                * a fully masked row gives out 0 and lse = sink. */
} attnd_kbatch_t;

/* Bytes of one block in one layer (K, V and, for dynamic types, their scales). */
size_t attnd_kv_block_bytes(const attnd_kshape_t *s);

/* Bytes of K and V per token per layer, scales included (for Health/Stats). */
double attnd_kv_bytes_per_token(const attnd_kshape_t *s);

/* 0 when the shape is one the kernels support, else a negative value. */
int attnd_kshape_check(const attnd_kshape_t *s);

const char *attnd_kv_type_name(attnd_kv_type_t t);
/* Returns the type for a name ("bf16", "int8_dynamic", ...), or -1. */
int attnd_kv_type_parse(const char *name);
/* 1 for the types with static scales (int8, fp8, int4). */
int attnd_kv_type_static(attnd_kv_type_t t);
/* 1 for the types with per-token scales stored in the block. */
int attnd_kv_type_dynamic(attnd_kv_type_t t);

/* ---- CPU backend (kernels/cpu) ---------------------------------------------
 * Each phase is split into nparts independent parts; part i of nparts may run
 * on any thread, concurrently with the other parts of the same phase. Return 0,
 * or a negative value for a batch the kernels cannot run (never for data). */
int attnd_cpu_write(const attnd_kshape_t *s, const attnd_kbatch_t *b, int part, int nparts);
int attnd_cpu_attend(const attnd_kshape_t *s, const attnd_kbatch_t *b, int part, int nparts);

/* The attend phase in pieces, so that a long step can be interleaved with
 * other work. Its work is a list of units: item by item (items with q), tiles
 * of tile_rows q rows counted from the item's first row, and per tile
 * tile_units units (kv heads times q-head groups), each computing its own rows
 * and heads of out and lse. attnd_cpu_attend_units() computes units [u0, u1)
 * of the batch, split into nparts parts; every unit comes out bit for bit as
 * attnd_cpu_attend() computes it, whatever the range. A unit's cost is about
 * its tile's rows times the keys they see. attnd_cpu_attend(s, b, p, n) is
 * every unit. */
int attnd_cpu_attend_geometry(const attnd_kshape_t *s, int *tile_rows, int *tile_units);
int attnd_cpu_attend_units(const attnd_kshape_t *s, const attnd_kbatch_t *b, int64_t u0,
                           int64_t u1, int part, int nparts);

/* 1 when every element of a bf16/fp16/fp32 array is finite. */
int attnd_cpu_all_finite(attnd_dtype_t dt, const void *p, size_t count);

/* The largest magnitude in a bf16/fp16/fp32 array, as its bit pattern with the
 * sign cleared (0 for count 0; integer types: 0). Magnitudes order as these
 * patterns do, infinities above every finite value and NaNs above infinities,
 * so one comparison with a bound's pattern checks finiteness and the bound
 * together. Elements need not be aligned. */
uint32_t attnd_cpu_max_abs_bits(attnd_dtype_t dt, const void *p, size_t count);

#ifdef __cplusplus
}
#endif

#endif /* ATTND_KERNELS_H */
