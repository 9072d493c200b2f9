"""Errors in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, extra_headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(
            self.body(), status_code=self.status, headers={**self.headers, **(extra_headers or {})}
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "") -> APIError:
    return APIError(
        400,
        f"'{param}' is not supported by this server{': ' + detail if detail else ''}",
        param=param,
        code="unsupported_parameter",
    )
