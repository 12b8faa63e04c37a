"""Typed exceptions for attnd's Status codes (numbered as gRPC's, docs/protocol.md).

Every non-OK response raises the subclass of AttndError named after its code,
so an orchestrator can write ``except attnd.NotFound`` instead of comparing
numbers. Transport problems raise AttndConnectionError (an OSError).
"""
from typing import Dict, Optional, Type


class AttndError(Exception):
    """The daemon answered a request with a non-OK Status."""

    code: int = 2  # UNKNOWN

    def __init__(self, message: str = "", code: Optional[int] = None, request_id: int = 0,
                 epoch: int = 0) -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.request_id = request_id
        self.epoch = epoch
        super().__init__(f"{CODE_NAMES.get(self.code, self.code)}: {message}")


class Cancelled(AttndError):
    code = 1


class Unknown(AttndError):
    code = 2


class InvalidArgument(AttndError):
    code = 3


class DeadlineExceeded(AttndError):
    code = 4


class NotFound(AttndError):
    code = 5


class AlreadyExists(AttndError):
    code = 6


class PermissionDenied(AttndError):
    code = 7


class ResourceExhausted(AttndError):
    code = 8


class FailedPrecondition(AttndError):
    code = 9


class Aborted(AttndError):
    code = 10


class OutOfRange(AttndError):
    code = 11


class Unimplemented(AttndError):
    code = 12


class Internal(AttndError):
    code = 13


class Unavailable(AttndError):
    code = 14


class DataLoss(AttndError):
    code = 15


class Unauthenticated(AttndError):
    code = 16


class EpochChanged(AttndError):
    """The daemon restarted (its epoch changed): every session opened before is gone.

    Raised once per change when the client was made with ``on_epoch_change="raise"``;
    ``old`` and ``new`` are the epochs. The client has already adopted the new epoch,
    so the caller can reopen its sessions and replay its tokens right away.
    """

    code = 14  # the old daemon is unavailable, in gRPC terms

    def __init__(self, old: int, new: int, request_id: int = 0) -> None:
        self.old = old
        self.new = new
        super().__init__(f"attnd restarted: epoch {old:016x} -> {new:016x}; sessions are gone",
                         request_id=request_id, epoch=new)


class AttndConnectionError(OSError):
    """Could not connect to the daemon, or the connection broke."""


CODE_NAMES: Dict[int, str] = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}

_BY_CODE: Dict[int, Type[AttndError]] = {cls.code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
    PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
    Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)}


def error_for(code: int, message: str = "", request_id: int = 0, epoch: int = 0) -> AttndError:
    """Returns the exception instance for a Status code."""
    cls = _BY_CODE.get(code, AttndError)
    return cls(message, code=code, request_id=request_id, epoch=epoch)
