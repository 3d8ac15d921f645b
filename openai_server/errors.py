"""OpenAI-shaped errors: one exception type the handlers raise, one JSON body every client parses."""
from __future__ import annotations

from http import HTTPStatus

from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error a client should see: HTTP status plus OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.status, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, phrased for a client (always a 400, never 422)."""
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    cause = first.get("ctx", {}).get("error")
    reason = str(cause) if isinstance(cause, Exception) else first["msg"]
    message = reason if param is None else f"{param}: {reason}"
    return APIError(message, 400, param=param)
