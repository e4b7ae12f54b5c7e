"""Domain errors shared by tracker and nodes; each maps to one HTTP status in one place."""

from __future__ import annotations


class MeshnetError(Exception):
    """Base of meshnet's domain errors. ``status`` is the HTTP status the API answers with."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict:
        """OpenAI-style error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(MeshnetError):
    """The caller sent something malformed or out of range (400)."""

    status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    """A body or tensor exceeds the configured limit (413)."""

    status = 413


class RequestTimeout(InvalidRequest):
    """A request body that did not arrive within its deadline (408)."""

    status = 408


class RangeNotSatisfiable(InvalidRequest):
    """A byte range that lies outside the file (416)."""

    status = 416

    def __init__(self, message: str, *, size: int):
        super().__init__(message, param="range")
        self.headers = {"content-range": f"bytes */{size}"}


class Unauthorized(MeshnetError):
    """A missing or wrong swarm token or API key (401)."""

    status = 401
    error_type = "authentication_error"


class UnsupportedMediaType(InvalidRequest):
    """The body's content type is not the one this route takes (415)."""

    status = 415


class NotFound(MeshnetError):
    """Unknown model, session or file (404)."""

    status = 404
    error_type = "not_found_error"


class Conflict(MeshnetError):
    """The request does not fit the current state, e.g. a wrong session position (409)."""

    status = 409
    error_type = "invalid_request_error"


class ClientDisconnected(MeshnetError):
    """The client went away before its answer (499, nginx's "client closed request"): an
    ordinary event, logged at info; the work it asked for has been stopped."""

    status = 499
    error_type = "client_closed_request"

    def __init__(self, message: str = "client disconnected") -> None:
        super().__init__(message, code="client_disconnected")


class CapacityExceeded(MeshnetError):
    """Retryable refusal: a KV budget or concurrency limit is full (503)."""

    status = 503
    error_type = "server_overloaded"


class RateLimited(MeshnetError):
    """A caller asked for more than its share (429): that caller waits, the others go on.
    ``retry_s``: when to ask again, where the share refills on a clock."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(
        self, message: str, *, retry_s: float | None = None, param: str | None = None,
        code: str = "rate_limit_exceeded",
    ) -> None:  # fmt: skip
        super().__init__(message, param=param, code=code)
        if retry_s is not None:
            self.headers = {"retry-after": str(max(1, int(retry_s + 0.999)))}


class Draining(MeshnetError):
    """The node is leaving the swarm (graceful drain): it opens no new session (503).
    ``param`` is its URL, so a head routes around this node, not the hop that relayed it."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, url: str) -> None:
        super().__init__(f"node {url} is draining (leaving the swarm): no new sessions",
                         param=url, code="draining")  # fmt: skip


class Quarantined(MeshnetError):
    """The tracker quarantined this node: replicas disagreed with its outputs (verification,
    docs/adr/0026). It runs no step (503); ``param`` is its URL, so heads fail over."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"node {url} is quarantined ({reason}): it serves no steps",
                         param=url, code="quarantined")  # fmt: skip


class ModelNotCovered(MeshnetError):
    """No chain of serving nodes covers the model's layers (503)."""

    status = 503
    error_type = "service_unavailable"


class ModelError(MeshnetError):
    """A model snapshot is missing, corrupt or unsupported (operator-facing)."""

    status = 500
    error_type = "model_error"


class UnsupportedArchitecture(ModelError):
    """The model's architecture has no adapter."""


class InsufficientMemory(MeshnetError):
    """The shard does not fit the declared or available memory."""

    status = 507
    error_type = "insufficient_memory"


_NAMES_ITS_NODE = ("hop_failed", "draining", "quarantined")  # errors whose param is a URL


class HopError(MeshnetError):
    """A downstream hop failed or answered with an error (502 unless it sent a 4xx)."""

    status = 502
    error_type = "upstream_error"

    def __init__(self, message: str, *, status: int = 502, hop: str | None = None, body=None):
        super().__init__(message, code="hop_failed")
        self.status = status
        self.hop = hop
        self.body = body

    def to_openai(self) -> dict:
        if isinstance(self.body, dict) and "error" in self.body:
            return self.body  # relay the deepest failure unchanged
        body = super().to_openai()
        body["error"]["param"] = self.hop  # which hop failed: the head routes around it
        return body

    @property
    def failed_url(self) -> str | None:
        """The hop that actually failed (a downstream hop may have reported it)."""
        if isinstance(self.body, dict):
            error = self.body.get("error") or {}
            if error.get("code") in _NAMES_ITS_NODE and error.get("param"):
                return error["param"]
        return self.hop

    @property
    def recoverable(self) -> bool:
        """Worth routing around: the hop is gone, broken, or lost the session."""
        return self.status >= 500 or self.status in (404, 409)
