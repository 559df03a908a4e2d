"""One exception tree for the daemon and its clients.

Every error that crosses the wire carries a stable ``code`` (docs/protocol.md lists them).
The server turns an exception into ``{"code", "message", **details}``; the client turns
that map back into the class registered for the code, falling back to
:class:`WeightcacheError` for codes it does not know. Nothing ever dispatches on message
text.
"""

from __future__ import annotations

from typing import Any, ClassVar


class WeightcacheError(Exception):
    """Base class. ``code`` is the wire code, ``details`` extra fields sent with it."""

    code: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **self.details}

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


ERRORS_BY_CODE: dict[str, type[WeightcacheError]] = {}


def _register(cls: type[WeightcacheError]) -> type[WeightcacheError]:
    ERRORS_BY_CODE[cls.code] = cls
    return cls


@_register
class BadRequest(WeightcacheError):
    """The request is malformed: not a map, missing or mistyped fields."""

    code = "BAD_REQUEST"


@_register
class UnknownOp(WeightcacheError):
    code = "UNKNOWN_OP"


@_register
class UnknownModel(WeightcacheError):
    code = "UNKNOWN_MODEL"


@_register
class NoSpace(WeightcacheError):
    """The budget cannot fit the model; ``details["holders"]`` names what holds the memory.

    ``fits_ever``: whether detaches could ever make room, so that waiting may help (False:
    the model is larger than what could ever be freed, or it is not known). Callers decide
    on this attribute; it goes on the wire as the ``fits_ever`` detail where it was given."""

    code = "NO_SPACE"

    def __init__(self, message: str, *, fits_ever: bool | None = None, **details: Any) -> None:
        super().__init__(message, **details, **({} if fits_ever is None else {"fits_ever": fits_ever}))
        self.fits_ever: bool = fits_ever is True

    @classmethod
    def over_budget(cls, *, model: str, needed: int, device: str, budget: int, free: int, held: list[str],
                    loaded: int | None = None, **details: Any) -> NoSpace:
        """The one NO_SPACE for a budget (or max_loaded_models) that cannot fit ``model``:
        ``held`` describes each model holding the device's memory. The core raises it
        knowing connection ids only; handlers rebuild it naming who holds the leases."""
        full = f"{device} holds {loaded} models, its max_loaded_models; " if loaded is not None else ""
        fields: dict[str, Any] = {"model": model, "device": device, "needed": needed, "budget": budget, "free": free,
                                  **details}
        if loaded is not None:
            fields["loaded"] = loaded
        from .units import format_size  # the daemon's message: not on the client's import path

        return cls(f"model {model!r} needs {format_size(needed)} on {device}; {full}budget {format_size(budget)}, "
                   f"free {format_size(free)}; held by: {', '.join(held) or 'nothing'}", **fields)


@_register
class Attached(WeightcacheError):
    """The operation needs a model that no engine has attached."""

    code = "ATTACHED"


@_register
class Pinned(WeightcacheError):
    """An explicit evict of a pinned model: unpin it first."""

    code = "PINNED"


@_register
class LoadFailed(WeightcacheError):
    code = "LOAD_FAILED"


@_register
class CorruptCheckpoint(WeightcacheError):
    """A checkpoint file is missing, truncated or malformed; ``details["file"]`` names it."""

    code = "CORRUPT_CHECKPOINT"


@_register
class PermissionDenied(WeightcacheError):
    code = "PERMISSION_DENIED"


@_register
class ProtocolVersionError(WeightcacheError):
    code = "PROTOCOL_VERSION"


@_register
class FrameTooLarge(WeightcacheError):
    code = "FRAME_TOO_LARGE"


@_register
class LimitExceeded(WeightcacheError):
    """Too many connections, or too many leases on one connection."""

    code = "LIMIT_EXCEEDED"


@_register
class RequestTimeout(WeightcacheError):
    """A request outlived ``request_timeout_s``, or a frame stayed half-sent too long."""

    code = "TIMEOUT"


@_register
class ShuttingDown(WeightcacheError):
    code = "SHUTTING_DOWN"


@_register
class InternalError(WeightcacheError):
    code = "INTERNAL"


class DaemonUnavailable(WeightcacheError):
    """Client side only: the daemon's socket cannot be reached or the connection broke."""

    code = "UNAVAILABLE"


class ConfigError(WeightcacheError):
    """Local only: the configuration file or environment is invalid."""

    code = "CONFIG"


def error_from_wire(error: dict[str, Any]) -> WeightcacheError:
    """Rebuild the exception a server reply describes."""
    fields = dict(error)
    code = str(fields.pop("code", "INTERNAL"))
    message = str(fields.pop("message", ""))
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        exc = WeightcacheError(message, **fields)
        exc.code = code  # type: ignore[misc]  # keep the unknown code visible to callers
        return exc
    return cls(message, **fields)
