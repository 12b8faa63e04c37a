"""attnd: Python client of the attnd attention server (standard protobuf runtime).

    import attnd
    with attnd.Client("/run/attnd/attnd.sock") as c:
        print(c.health().model)
        sid, cached = c.open_session(tokens)
        plan = c.plan([attnd.Item(sid, start=0, n=len(tokens), tokens=tokens)])
        for layer in range(c.model.layers):
            out = c.step(layer, q, k, v, plan=plan).out
"""
from .client import (BFLOAT16, DTYPE_BF16, DTYPE_FP16, DTYPE_FP32, DTYPE_INT32, Client, Item,
                     Mask, Session, StepResult, bf16_to_f32, default_socket, f32_to_bf16, round_bf16)
from .errors import (Aborted, AlreadyExists, AttndConnectionError, AttndError, Cancelled, DataLoss,
                     DeadlineExceeded, EpochChanged, FailedPrecondition, Internal, InvalidArgument,
                     NotFound, OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented, Unknown, error_for)

__all__ = [n for n in dir() if not n.startswith("_")]
