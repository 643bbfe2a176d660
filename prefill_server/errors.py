"""The prefill server's request error: ``BadRequest``, raised wherever a request is found invalid
(parsing, numbers, token ids, tools, a prompt too long) and answered as HTTP 400 with an OpenAI
error body (``openai_api.error_body``) or gRPC INVALID_ARGUMENT."""

from __future__ import annotations


class BadRequest(ValueError):
    """The client's request is invalid: HTTP 400 / gRPC INVALID_ARGUMENT."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
