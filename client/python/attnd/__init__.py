"""attnd: Python client of the attnd attention server (standard protobuf runtime).

    import attnd
    with attnd.Client("/run/attnd/attnd.sock") as c:
        print(c.health().model)
        sid, cached = c.open_session(tokens)
        plan = c.plan([attnd.Item(sid, start=0, n=len(tokens), tokens=tokens)])
        for layer in range(c.model.layers):
            out = c.step(layer, q, k, v, plan=plan).out
"""
try:  # wheel and Debian package: written when the package was built
    from ._version import __version__
except ImportError:  # source tree: $BUILD/python (CMake writes it next to attnd_pb2.py)
    from attnd_version import __version__  # type: ignore[import-not-found,no-redef,unused-ignore]

from .client import (BFLOAT16, DTYPE_BF16, DTYPE_FP16, DTYPE_FP32, DTYPE_INT32, Address, Client,
                     Item, Mask, Session, SessionId, SessionInfo, StepResult, bf16_to_f32,
                     default_socket, f32_to_bf16, round_bf16)
from .errors import (Aborted, AlreadyExists, AttndConnectionError, AttndError, Cancelled, DataLoss,
                     DeadlineExceeded, EpochChanged, FailedPrecondition, Internal, InvalidArgument,
                     NotFound, OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented, Unknown, error_for)
from .model_config import ModelShape, UnsupportedModel, model_shape_from_config

__all__ = [
    "__version__", "Address", "BFLOAT16", "DTYPE_BF16", "DTYPE_FP16", "DTYPE_FP32", "DTYPE_INT32",
    "Client", "Item", "Mask", "Session", "SessionId", "SessionInfo", "StepResult", "bf16_to_f32",
    "default_socket", "f32_to_bf16", "round_bf16",
    "Aborted", "AlreadyExists", "AttndConnectionError", "AttndError", "Cancelled", "DataLoss",
    "DeadlineExceeded", "EpochChanged", "FailedPrecondition", "Internal", "InvalidArgument",
    "NotFound", "OutOfRange", "PermissionDenied", "ResourceExhausted", "Unauthenticated",
    "Unavailable", "Unimplemented", "Unknown", "error_for",
    "ModelShape", "UnsupportedModel", "model_shape_from_config",
]
