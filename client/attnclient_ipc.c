/* attnclient_ipc.c: libattnclient's RegisterBuffer and ReleaseBuffer
 * (attnclient.h; docs/protocol.md §5a). A Step over registered buffers goes
 * through attnd_client_step_send with refs. */
#include <stdio.h>
#include <string.h>

#include "attnclient.h"

int attnd_client_register_buffer(attnd_client_t *c, const uint8_t handle[64], uint64_t size,
                                 const char *device_uuid, uint64_t *buffer) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_register_buffer_tag;
  attnd_v1_RegisterBufferRequest *m = &req.call.register_buffer;
  memcpy(m->cuda_ipc_handle.bytes, handle, 64);
  m->cuda_ipc_handle.size = 64;
  m->size = size;
  snprintf(m->device_uuid, sizeof(m->device_uuid), "%s", device_uuid ? device_uuid : "");
  int rc = attnd_client_call(c, &req, &r);
  if (rc == 0 && r.msg.which_result != attnd_v1_Response_register_buffer_tag)
    rc = ATTND_CLIENT_EPROTO;
  if (rc == 0)
    *buffer = r.msg.result.register_buffer.buffer;
  attnd_client_resp_free(&r);
  return rc;
}

int attnd_client_release_buffer(attnd_client_t *c, uint64_t buffer) {
  attnd_v1_Request req = attnd_v1_Request_init_zero;
  attnd_client_resp_t r;
  req.which_call = attnd_v1_Request_release_buffer_tag;
  req.call.release_buffer.buffer = buffer;
  int rc = attnd_client_call(c, &req, &r);
  attnd_client_resp_free(&r);
  return rc;
}
