"""The exceptions Ratchet raises. Every one of them derives from :class:`RatchetError`.

RatchetError
├── NotFound                    a row that does not exist (or belongs to another tenant)
├── Conflict                    a state change that the current state forbids
├── InvalidRequest              input that names a field and says what is wrong with it
├── KeyRejected                 an API key that is malformed, unknown, revoked or expired
├── IdempotencyMismatch         an Idempotency-Key reused with a different body
├── DatabaseNotMigrated         the schema is behind the code
├── LeaseLost                   this worker no longer holds the task's lease: stop, write nothing
├── ToolError                   a tool call that cannot run or failed
│   ├── ToolArgumentsInvalid    the model's arguments failed validation
│   ├── ToolOutcomeUnknown      a call that may or may not have acted (its server died mid-call)
│   └── SandboxUnavailable      run_python cannot run code on this worker (no usable sandbox)
├── EgressDenied                an outbound URL that the egress policy refuses
└── ModelError                  a model provider call failed
    ├── ModelTransientError     worth retrying: timeouts, 5xx, connection errors
    │   └── ModelRateLimited    the provider said 429 (maybe with Retry-After)
    └── ModelPermanentError     not worth retrying: bad request, auth, bad output
        └── ContextLengthExceeded   the provider said the prompt is over the model's window
"""

from __future__ import annotations


class RatchetError(Exception):
    """Something went wrong in Ratchet."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self)


class NotFound(RatchetError):
    """No such resource."""


class Conflict(RatchetError):
    """The resource's current state does not allow that."""


class InvalidRequest(RatchetError):
    """The request is not valid."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class QueueFull(RatchetError):
    """The tenant holds its most queued tasks: retry once some have started."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class KeyRejected(RatchetError):
    """The API key is not valid."""


class IdempotencyMismatch(RatchetError):
    """This Idempotency-Key was already used with a different request body."""


class DatabaseNotMigrated(RatchetError):
    """The database schema is not at the current revision: run `ratchet migrate`."""


class LeaseLost(RatchetError):
    """This worker no longer holds the task's lease; it must write nothing more."""


class CancelRequested(RatchetError):
    """The client asked to cancel this task: the step holding it ends it at its next write."""


class ToolError(RatchetError):
    """The tool call failed."""


class ToolArgumentsInvalid(ToolError):
    """The tool's arguments are not valid."""


class ToolOutcomeUnknown(ToolError):
    """The tool call was sent, and whether it took effect is unknown."""


class SandboxUnavailable(ToolError):
    """run_python is unavailable on this worker: it has no sandbox to run code in."""


class EgressDenied(RatchetError):
    """The outbound address is not allowed by the egress policy."""


class ModelError(RatchetError):
    """The model provider call failed."""

    error_type = "model_error"


class ModelTransientError(ModelError):
    """The model provider failed in a way worth retrying."""

    error_type = "model_unavailable"

    def __init__(self, message: str | None = None, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelRateLimited(ModelTransientError):
    """The model provider is rate limiting us (HTTP 429)."""

    error_type = "model_rate_limited"


class ModelPermanentError(ModelError):
    """The model provider rejected the call; retrying will not help."""

    error_type = "model_rejected"


class ContextLengthExceeded(ModelPermanentError):
    """The prompt does not fit the model's context window."""

    error_type = "context_length_exceeded"
