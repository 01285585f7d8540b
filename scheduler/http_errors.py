"""Every answer of the scheduler is JSON with OpenAI's error shape, and every answer is counted.

The middleware turns aiohttp's own errors (unknown route 404, wrong method 405 with `Allow`,
body too large 413) into `{"error": {"message", "type", "param", "code"}}`, answers an
exception that escaped a handler with a JSON 500 (logged with its traceback, counted in
`lorafleet_unhandled_errors_total`), and counts each response in
`lorafleet_http_requests_total{route, code}` (route: the matched route's pattern, so unknown
paths cannot blow up the label set). A handler whose client went away raises `ClientGone`:
counted with nginx's 499, nothing is sent.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from lorafleet.scheduler.openai_api import ApiError

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499
BODY_TIMEOUT_S = 60.0  # a request's body must arrive within this long once its headers have


# the request Content-Encodings aiohttp decodes (br and zstd only where their libraries are installed: otherwise its
# parser answers 400 before any handler runs); any other value would reach the handler still encoded
DECODED_ENCODINGS = ("", "identity", "gzip", "deflate", "br", "zstd")


class ClientGone(Exception):
    """The client disconnected; `response` is the stream already started, if any."""

    def __init__(self, response: web.StreamResponse | None = None):
        super().__init__("client went away")
        self.response = response


async def read_body(request: web.Request, timeout: float | None = None) -> bytes:
    """The request's body. A client that drops while sending it raises ClientGone (a 499, not an unhandled
    error); one whose body has not arrived `timeout` seconds after its headers gets a 408, so a stalled upload
    does not hold a handler forever; one that cannot be decoded (a Content-Encoding its bytes are not in) gets a 400,
    and one in a Content-Encoding aiohttp does not decode (it would hand over the encoded bytes) a 415.
    A body over the size limit still raises aiohttp's 413."""
    timeout = BODY_TIMEOUT_S if timeout is None else timeout
    enc = request.headers.get("Content-Encoding", "").strip().lower()
    if enc not in DECODED_ENCODINGS:
        raise ApiError(415, f"Content-Encoding {enc[:40]!r} is not supported: send the body as is, or in gzip or "
                            f"deflate", param=None, code="unsupported_content_encoding",
                       headers={"Connection": "close"})
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ConnectionError:
        raise ClientGone() from None
    except web.RequestPayloadError as exc:
        cause = exc.__cause__ or exc.__context__
        detail = str(getattr(cause, "message", "") or cause or exc)
        # (the rest of the body cannot be read either: marked at its end, so that aiohttp does not read on for
        # keep-alive and fail again, and the connection closes once the answer is sent)
        request.content.feed_eof()
        raise ApiError(400, f"the request body could not be read: {detail}", code="bad_request_body",
                       headers={"Connection": "close"}) from None


class ClientProtocolErrors(logging.Filter):
    """aiohttp logs a client's malformed HTTP (a header line over its limit, a wrong Content-Length, a broken chunked
    body) at ERROR with a traceback, and answers it 400 itself: the client's fault, not the server's. Such records
    become one WARNING line naming the problem and the client."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = f"{record.getMessage()}: malformed HTTP, answered 400: {exc}", ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def quiet_client_protocol_errors() -> None:
    """Installs ClientProtocolErrors on aiohttp's server logger (once)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientProtocolErrors) for f in logger.filters):
        logger.addFilter(ClientProtocolErrors())


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


def _from_http_exception(exc: web.HTTPException, request: web.Request, max_body: int) -> web.Response:
    status = exc.status
    if status == 404:
        err = ApiError(404, f"no route {request.method} {request.path}", code="not_found")
    elif status == 405:
        allow = exc.headers.get("Allow", "")
        err = ApiError(405, f"{request.method} is not allowed on {request.path} (allowed: {allow})",
                       code="method_not_allowed", headers={"Allow": allow})
    elif status == 413:
        err = ApiError(413, f"request body exceeds {max_body} bytes", code="body_too_large")
    else:
        err = ApiError(status, exc.reason or "request refused", code=None)
    return error_response(err)


def route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def errors_middleware(metrics, max_body: int):
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except ApiError as err:
            resp = error_response(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            resp = _from_http_exception(exc, request, max_body)
        except ClientGone as gone:
            metrics.http_requests.labels(route=route_label(request), code=str(CLIENT_CLOSED)).inc()
            return gone.response if gone.response is not None else web.Response(status=CLIENT_CLOSED)
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            metrics.unhandled_errors.inc()
            resp = error_response(ApiError(500, "internal error (logged on the server)", code="internal_error"))
        metrics.http_requests.labels(route=route_label(request), code=str(resp.status)).inc()
        return resp

    return middleware
