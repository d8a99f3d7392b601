"""OpenAI-shaped errors, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Bad input of any kind (malformed JSON, a wrong field type, an unknown route) is answered 4xx in
this shape; a 500 only ever means a bug in the server.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# The `type` OpenAI's API gives each status; anything else is named after its HTTP phrase.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the client sees; raise it anywhere below a route."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        # Such as Allow on a 405 and Retry-After on a 429.
        self.headers = headers

    def body(self) -> dict:
        error_type = _ERROR_TYPES.get(self.status_code) or HTTPStatus(self.status_code).phrase.lower().replace(" ", "_")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def sse_error(error: APIError) -> str:
    """The error as a server-sent event, for a stream that cannot end as it should."""
    return f"data: {json.dumps(error.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    _document_errors_as_answered(app)


_ERROR_SCHEMA = {
    "description": "Bad request: an OpenAI-shaped error",
    "content": {"application/json": {"schema": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
        }}},
    }}},
}


def _document_errors_as_answered(app: FastAPI) -> None:
    """/openapi.json says 400 with the OpenAI error shape where FastAPI would document its 422."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = _ERROR_SCHEMA
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.response()


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": ")).response()
    # loc is ("body", "messages", 0, "content", "str"): the param is the top-level field, the
    # message names the whole path (with pydantic's union branch, such as "str", last).
    path = [str(part) for part in first["loc"] if part != "body"]
    detail = first["msg"].removeprefix("Value error, ")
    if not path:
        return bad_request(f"request body: {detail}").response()
    return bad_request(f"{'.'.join(path)}: {detail}", path[0]).response()


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
        return APIError(404, message, code="not_found").response()
    if error.status_code == 400 and error.__cause__ is not None:
        # FastAPI has one message for every way a body fails to parse; its cause says which.
        return bad_request(_unparsable(error.__cause__)).response()
    return APIError(error.status_code, str(error.detail), headers=error.headers).response()


def _unparsable(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8: {cause.reason} at byte {cause.start}"
    if isinstance(cause, RecursionError):
        return "the request body nests too deeply to parse"
    return f"the request body is not valid JSON: {cause}"


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s %s", request.method, request.url.path)
    return APIError(500, "internal server error").response()
