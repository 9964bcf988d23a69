"""The one error hierarchy. Each error carries its HTTP status; one middleware on each
server renders it in the Ollama (`{"error": "..."}`) or OpenAI shape.

Each class here also has a `kind`: its stable name on the runner wire (shared/protocol.py), so
the supervisor rebuilds exactly the class the runner raised (`from_wire`). It is not `code`:
that is the OpenAI error object's `code`, which clients see (and which is null for most
classes)."""

from __future__ import annotations


class MlxrError(Exception):
    status = 500
    kind = "error"
    openai_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(MlxrError):
    status = 400
    kind = "invalid_request"
    openai_type = "invalid_request_error"


class ContextOverflow(InvalidRequest):
    kind = "context_overflow"
    code = "context_length_exceeded"


class UnsupportedModel(InvalidRequest):
    """A model mlxr cannot run: its architecture, a tensor type or its tokenizer (the message
    names which)."""
    kind = "unsupported_model"


class Unauthorized(MlxrError):
    status = 401
    kind = "unauthorized"
    openai_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(MlxrError):
    status = 404
    kind = "model_not_found"
    openai_type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(InvalidRequest):
    status = 413
    kind = "payload_too_large"


class ServerBusy(MlxrError):
    status = 503
    kind = "server_busy"
    openai_type = "server_error"
    code = "server_busy"


class InsufficientMemory(MlxrError):
    status = 507
    kind = "insufficient_memory"
    openai_type = "server_error"
    code = "insufficient_memory"


class RunnerFailed(MlxrError):
    status = 500
    kind = "runner_failed"

    def __init__(self, message: str, *, stderr_tail: str = ""):
        if stderr_tail:
            message = f"{message}: {stderr_tail.strip()}"
        super().__init__(message)
        self.stderr_tail = stderr_tail


class RegistryError(MlxrError):
    status = 502
    kind = "registry_error"
    openai_type = "server_error"


class InsufficientStorage(MlxrError):
    """The disk is full (ENOSPC, EDQUOT): the message says what was being written and what
    was kept of it."""
    status = 507
    kind = "insufficient_storage"
    openai_type = "server_error"
    code = "insufficient_storage"


class Forbidden(MlxrError):
    """A request refused for where it comes from (a Host header that is not this machine,
    on a server bound to a loopback address)."""
    status = 403
    kind = "forbidden"
    openai_type = "permission_error"


class InvalidModelFile(InvalidRequest):
    """A model file that is malformed or hostile: a safetensors or GGUF header claiming more
    than the file holds, byte ranges that disagree with shapes or overlap, a config.json with
    absurd or missing values (the message names the file and what is wrong)."""
    kind = "invalid_model_file"


KINDS: dict[str, type[MlxrError]] = {
    cls.kind: cls for cls in (MlxrError, InvalidRequest, ContextOverflow, UnsupportedModel,
                              Unauthorized,
                              ModelNotFound, PayloadTooLarge, ServerBusy, InsufficientMemory,
                              RunnerFailed, RegistryError)}
KINDS[InsufficientStorage.kind] = InsufficientStorage
KINDS[Forbidden.kind] = Forbidden
KINDS[InvalidModelFile.kind] = InvalidModelFile


def from_wire(status: int, message: str, kind: str | None = None) -> MlxrError:
    """Rebuild a typed error received over HTTP: the class its `kind` names, with the status
    it was sent with; with no kind, or one this side does not know (an older or foreign
    runner), the class its status suggests."""
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return from_status(status, message)
    err = cls(message)
    if status and err.status != status:
        err.status = status
    return err


def from_status(status: int, message: str) -> MlxrError:
    """The error a status alone suggests: the first class in the hierarchy with it (a 400 is
    an InvalidRequest), RunnerFailed for any other."""
    for cls in (InvalidRequest, ModelNotFound, ServerBusy, InsufficientMemory, Unauthorized,
                PayloadTooLarge):
        if cls.status == status:
            return cls(message)
    return RunnerFailed(message)
