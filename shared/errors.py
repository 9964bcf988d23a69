"""The one error hierarchy. Each error carries its HTTP status; one middleware on each
server renders it in the Ollama (`{"error": "..."}`) or OpenAI shape."""

from __future__ import annotations


class MlxrError(Exception):
    status = 500
    openai_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(MlxrError):
    status = 400
    openai_type = "invalid_request_error"


class ContextOverflow(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(MlxrError):
    status = 401
    openai_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(MlxrError):
    status = 404
    openai_type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(InvalidRequest):
    status = 413


class ServerBusy(MlxrError):
    status = 503
    openai_type = "server_error"
    code = "server_busy"


class InsufficientMemory(MlxrError):
    status = 507
    openai_type = "server_error"
    code = "insufficient_memory"


class RunnerFailed(MlxrError):
    status = 500

    def __init__(self, message: str, *, stderr_tail: str = ""):
        if stderr_tail:
            message = f"{message}: {stderr_tail.strip()}"
        super().__init__(message)
        self.stderr_tail = stderr_tail


class RegistryError(MlxrError):
    status = 502
    openai_type = "server_error"


def from_status(status: int, message: str) -> MlxrError:
    """Rebuild a typed error from a status and message received over HTTP."""
    for cls in (ContextOverflow if "context length" in message else InvalidRequest,
                ModelNotFound, ServerBusy, InsufficientMemory, Unauthorized, PayloadTooLarge):
        if cls.status == status:
            return cls(message)
    return RunnerFailed(message)
