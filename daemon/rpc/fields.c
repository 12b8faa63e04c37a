/* fields.c: the field budget of a call (internal.h, docs/protocol.md §7).
 *
 * nanopb walks every field of a message, unknown ones included (it skips
 * their bytes, but one field at a time), so a frame of hundreds of MiB of
 * tiny unknown fields would hold the loop thread for seconds. Before a call is
 * decoded, its message and the submessages nanopb will decode (a Plan's or
 * Step's items, an item's mask, tensors) are walked here, skipping every
 * field's bytes at once, and the call is refused as soon as it holds more
 * fields than any valid call can: so this walk, and then nanopb's, cost at
 * most the budget, whatever the frame's size. Malformed structure is left to
 * nanopb, whose error messages are the ones clients see. */
#include <stdio.h>

#include "internal.h"

/* What a message is, for the fields that are submessages nanopb decodes. */
enum { K_OTHER, K_PLAN, K_STEP, K_SCALES, K_SINKS, K_ITEM, K_MASK, K_TENSOR };

/* The kind of field `tag` (length-delimited) of a message of kind k, or -1
 * when its bytes are not decoded as a message (skipped at once, or a packed
 * list whose callback bounds it). */
static int sub_kind(int k, uint32_t tag) {
  switch (k) {
  case K_PLAN:
    return tag == attnd_v1_PlanRequest_items_tag ? K_ITEM : -1;
  case K_STEP:
    if (tag == attnd_v1_StepRequest_items_tag)
      return K_ITEM;
    return tag >= attnd_v1_StepRequest_q_tag && tag <= attnd_v1_StepRequest_v_tag ? K_TENSOR : -1;
  case K_SCALES:
    return tag >= attnd_v1_SetScalesRequest_k_scale_tag &&
                   tag <= attnd_v1_SetScalesRequest_v_zero_tag
               ? K_TENSOR
               : -1;
  case K_SINKS:
    return tag == attnd_v1_SetSinksRequest_sinks_tag ? K_TENSOR : -1;
  case K_ITEM:
    return tag == attnd_v1_Item_mask_tag ? K_MASK : -1;
  case K_MASK:
    return tag == attnd_v1_Mask_doc_lengths_tag || tag == attnd_v1_Mask_intervals_tag ? K_TENSOR
                                                                                      : -1;
  default:
    return -1;
  }
}

/* 1 when the budget ran out, 0 otherwise (malformed input included). */
static int walk(pb_istream_t *s, int k, uint64_t *left) {
  while (s->bytes_left) {
    if (*left == 0)
      return 1;
    --*left;
    pb_wire_type_t wt;
    uint32_t tag;
    bool eof;
    if (!pb_decode_tag(s, &wt, &tag, &eof))
      return 0;
    int sk = wt == PB_WT_STRING ? sub_kind(k, tag) : -1;
    if (sk < 0) {
      if (!pb_skip_field(s, wt))
        return 0;
      continue;
    }
    pb_istream_t sub;
    if (!pb_make_string_substream(s, &sub))
      return 0;
    int over = walk(&sub, sk, left);
    if (!pb_close_string_substream(s, &sub) || over)
      return over;
  }
  return 0;
}

uint64_t attnd_rpc_field_budget(attnd_rpc_t *r, uint32_t call_tag) {
  const attnd_config_t *cfg = r->cfg;
  /* Headroom for fields a newer client may add; unpacked token ids are a
   * field each (a prompt's at most max_context, all items' at most the
   * pool's tokens); an item with its mask and tensors takes at most 16. */
  uint64_t b = 1024;
  if (call_tag == attnd_v1_Request_open_session_tag)
    b += (uint64_t)cfg->max_context;
  if (call_tag == attnd_v1_Request_plan_tag || call_tag == attnd_v1_Request_step_tag)
    b += (uint64_t)attnd_rpc_info(r)->kv_blocks * (uint64_t)cfg->shape.block_size +
         16 * (uint64_t)cfg->max_sessions;
  return b;
}

int attnd_rpc_fields_check(attnd_rpc_req_t *q, uint32_t call_tag, const uint8_t *p, size_t n) {
  int k = call_tag == attnd_v1_Request_plan_tag         ? K_PLAN
          : call_tag == attnd_v1_Request_step_tag       ? K_STEP
          : call_tag == attnd_v1_Request_set_scales_tag ? K_SCALES
          : call_tag == attnd_v1_Request_set_sinks_tag  ? K_SINKS
                                                        : K_OTHER;
  uint64_t budget = attnd_rpc_field_budget(q->conn->rpc, call_tag), left = budget;
  pb_istream_t s = pb_istream_from_buffer(p, n);
  if (!walk(&s, k, &left))
    return 0;
  snprintf(q->msg, sizeof(q->msg), "%s: more than %llu protobuf fields (no valid call has as many)",
           attnd_rpc_method_name(q->method), (unsigned long long)budget);
  return ATTND_EINVAL;
}
