"""`chatml serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) for one model.

Routes: `POST /v1/chat/completions` (streaming with SSE or not), `POST /v1/messages`
(Anthropic's Messages API), `POST /v1/responses` (OpenAI's Responses API), `POST
/v1/completions` (legacy, raw prompts), `GET /v1/models`, `GET /health`. The three other APIs
are translations onto the same chat request (messages.py, responses.py, text_completion.py),
so every one reuses the same pool of cached sequences. Requests are stateless: each carries
the whole conversation (a Responses request may name a kept previous response). This is a thin
HTTP layer over the engine's stateless chat (engine/stateless.py, also `Engine.chat`): the
handler parses the body, has the request checked and rendered, and queues it on the engine's
model thread, which routes the prompt to the pool sequence that reuses the most, generates,
and sends the text back to the event loop piece by piece. A client that goes away cancels its
job at the next token; the sequence keeps what it computed (valid state), nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from urllib.parse import urlsplit

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..args import shard_rank, speculative_options
from ..runtime import grammar
from ..runtime.batch import DEFAULT_MAX_BATCH, DEFAULT_PASS_TOKENS
from ..runtime.pool import DEFAULT_SEQUENCES
from ..runtime.shard import EXIT_LOST
from ..runtime.worker import Job
from ..session import resolve_window
from ..stateless import DEFAULT_MAX_TOKENS, PreparedChat, later_choices, openai_message
from ..turn import Turn
from . import messages, responses, text_completion
from .completion import THINK_END, ApiError, Renderer, decode_body, parse_request
from .logprobs import openai_content

log = logging.getLogger("chatml.server")

MAX_BODY_BYTES = 4 << 20
MAX_QUEUED = 64  # jobs waiting for the model; beyond that, 503 (clients retry)
BODY_TIMEOUT_S = 60.0  # a request's body must have arrived this long after it began (or 408)
GRACEFUL_SHUTDOWN_S = 10  # once a stop began, connections still open this long are closed
STOP_POLL_S = 0.1  # how often the app looks whether its server's stop began (as uvicorn does)
API_KEY_ENV = "CHATML_API_KEY"


def check_api_key(key: str, source: str = "the API key") -> str:
    """`key` without surrounding whitespace; ValueError if empty or not sendable in a header.

    An empty key would turn authentication off (`--api-key "$UNSET"`), and a key with spaces
    around it could never match: HTTP trims header values.
    """
    key = key.strip()
    if not key:
        raise ValueError(f"{source} is empty")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{source} must be printable ASCII without spaces")
    return key


def resolve_api_key(
    key: str | None, key_file: str | None, environ: dict | os._Environ = os.environ
) -> str | None:
    """The key from --api-key, --api-key-file or $CHATML_API_KEY (in that order); None if
    none is given. ValueError naming the source when it is unusable."""
    if key is not None:
        return check_api_key(key, "--api-key")
    if key_file is not None:
        try:
            text = open(key_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file: cannot read {key_file}: {e}") from None
        return check_api_key(text, f"--api-key-file {key_file}")
    if API_KEY_ENV in environ:
        return check_api_key(environ[API_KEY_ENV], API_KEY_ENV)
    return None


def is_loopback(name: str) -> bool:
    """Whether a host name or address is this machine's loopback (localhost, 127.0.0.0/8,
    ::1)."""
    name = name.lower().removesuffix(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_origin(value: str) -> str:
    """An --allow-origin value as a browser writes it in the Origin header: scheme://host or
    scheme://host:port, lower case, no default port, nothing after; ValueError otherwise."""
    parts = urlsplit(value.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (not parts.scheme or not parts.hostname or port == -1 or "@" in parts.netloc
            or parts.path not in ("", "/") or parts.query or parts.fragment):  # fmt: skip
        raise ValueError(f"--allow-origin {value!r} is not an origin (scheme://host[:port], "
                         "e.g. http://localhost:3000)")  # fmt: skip
    scheme, host = parts.scheme.lower(), parts.hostname
    host = f"[{host}]" if ":" in host else host
    default = {"http": 80, "https": 443}.get(scheme)
    return f"{scheme}://{host}" + (f":{port}" if port not in (None, default) else "")


@dataclass
class ServerConfig:
    model: str = "tiny"  # the id /v1/models reports
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    sequences: int = DEFAULT_SEQUENCES
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_queued: int = MAX_QUEUED
    context_window: int | None = None  # default: the model's
    warm: bool = True  # prefill each answered conversation's next prompt while idle
    special_tokens_in_content: str = "text"  # "parse": --parse-special-in-content
    # Sampling defaults for fields a request omits (SamplingParams fields); None: the
    # checkpoint's generation_config.json, then OpenAI's defaults.
    sampling: dict | None = None
    responses_kept: int = responses.KEPT_RESPONSES  # for previous_response_id
    # Message arrays prefilled at start-up (--warm-prompts), before the first request.
    warm_prompts: list | None = None
    # Build llguidance's view of the tokenizer at start-up, in the background (seconds, once
    # per process), so that the first constrained request does not wait for it.
    prepare_grammar: bool = True
    body_timeout: float = BODY_TIMEOUT_S  # seconds for a request's body to arrive (then 408)
    # Web pages that may call the server from their origin (--allow-origin): CORS for them,
    # and past LocalOnly's Origin check.
    allow_origins: list[str] | None = None


# ----- HTTP ---------------------------------------------------------------------------------


def _error(e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else _close(e)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _anthropic_error(e: ApiError) -> JSONResponse:
    return JSONResponse(messages.error_body(e), status_code=e.status, headers=_close(e))


def _is_anthropic(path: str) -> bool:
    """Whether `path` is under /v1/messages, whose errors come in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def _close(e: ApiError) -> dict | None:
    # After a 408 or a 413 the rest of the body is unread (and may never come): the connection
    # cannot serve another request, so it is closed rather than left waiting for it.
    return {"Connection": "close"} if e.status in (408, 413) else None


def _shaped(request: Request, e: ApiError) -> JSONResponse:
    """`e` in the shape of the API the request's path belongs to."""
    return (_anthropic_error if _is_anthropic(request.url.path) else _error)(e)


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")


class BearerAuth:
    """ASGI middleware: every route but /health needs `Authorization: Bearer KEY` or, as
    Anthropic's clients send it, `x-api-key: KEY`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = check_api_key(api_key).encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)
        if not (bearer or x_api_key):
            e = ApiError(401, "Incorrect or missing API key (Authorization: Bearer KEY, or "
                         "x-api-key: KEY).", code="invalid_api_key")  # fmt: skip
            shaped = _anthropic_error if _is_anthropic(scope["path"]) else _error
            return await shaped(e)(scope, receive, send)
        return await self.app(scope, receive, send)


class LocalOnly:
    """ASGI middleware for a server on a loopback address without an API key: a 403 for a
    request whose Host is not a loopback name (a page whose name an attacker pointed at
    127.0.0.1, "DNS rebinding", could read the answers) or that carries the Origin of a web
    page elsewhere (browsers send a "simple" cross-site POST, text/plain, without asking
    first: any page could make the user's browser use the server), unless that origin was
    allowed (--allow-origin). Requests without an Origin (curl, SDKs) are not affected."""

    def __init__(self, app, allow_origins=()):
        self.app = app
        self.allowed = set(allow_origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin", b"").decode("latin-1")
        e = None
        if host and not is_loopback(_host_name(host)):
            e = ApiError(403, f"Host {host!r} is not a loopback name: this server listens on a "
                         "loopback address without an API key, so it answers requests for "
                         "localhost, 127.0.0.1 or [::1] only. To serve it under another name "
                         "(a reverse proxy), give it an API key.", code="forbidden_host")  # fmt: skip
        elif origin and origin not in self.allowed and not _loopback_origin(origin):
            e = ApiError(403, f"Origin {origin!r} may not use this server: without an API key "
                         "it refuses requests from web pages of other sites. To allow that "
                         f"page, start it with --allow-origin {origin}.",
                         code="forbidden_origin")  # fmt: skip
        if e is not None:
            shaped = _anthropic_error if _is_anthropic(scope["path"]) else _error
            return await shaped(e)(scope, receive, send)
        return await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """The name in a Host header, without the port (an IPv6 address comes in brackets)."""
    if host.startswith("[") and "]" in host:
        return host[1 : host.index("]")]
    return host.rsplit(":", 1)[0]


def _loopback_origin(origin: str) -> bool:
    try:
        return is_loopback(urlsplit(origin).hostname or "")
    except ValueError:
        return False


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel `job` when the client goes away (the body has been read: only that can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


class ServerApp:
    """The Starlette application around one engine's stateless chat."""

    def __init__(self, engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.window = resolve_window(engine, config.context_window)
        self.sampling = engine.sampling_defaults if config.sampling is None else config.sampling
        self.renderer = Renderer(
            engine, self.window, special_tokens_in_content=config.special_tokens_in_content
        )
        # count_tokens' renderer: no window (a body is at most max_body_bytes to tokenize)
        self._counter = Renderer(engine, special_tokens_in_content=config.special_tokens_in_content)
        self.worker = engine.stateless  # runs every request on the engine's model thread
        self.jobs: set[Job] = set()  # this server's requests not yet finished
        self.reading: set[anyio.CancelScope] = set()  # request bodies still arriving
        self.stopping = False  # the server's stop began: requests cancelled, new ones refused
        self._server: uvicorn.Server | None = None  # whose stop `watch` waits for
        self.kept = responses.ResponseStore(config.responses_kept)  # previous_response_id
        self.think_end = engine.tokenizer.backend.token_to_id(THINK_END)  # None: no such token
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        handlers = {HTTPException: self._http_error, Exception: self._server_error}
        self.starlette = Starlette(
            routes=routes, exception_handlers=handlers, lifespan=self._lifespan
        )
        key, origins = config.api_key, [check_origin(o) for o in config.allow_origins or ()]
        app = self.starlette if key is None else BearerAuth(self.starlette, key)
        if origins:  # outside BearerAuth: a browser's preflight carries no key
            app = CORSMiddleware(app, allow_origins=origins, allow_methods=["GET", "POST"],
                                 allow_headers=["*"])  # fmt: skip
        if key is None and is_loopback(config.host):
            app = LocalOnly(app, origins)
        self.asgi = app

    async def __call__(self, scope, receive, send) -> None:
        await self.asgi(scope, receive, send)

    def watch(self, server: uvicorn.Server) -> None:
        """Stop this app's requests as soon as `server`'s stop begins (a signal, or
        BackgroundServer.stop), not only once uvicorn has waited for every connection to
        close: a long stream would run on to its end, a half-sent body hold the stop forever."""
        self._server = server

    @asynccontextmanager
    async def _lifespan(self, app) -> AsyncIterator[None]:
        pool = self.worker.pool
        await anyio.to_thread.run_sync(self.engine.worker.call, pool.resize, self.config.sequences)
        if self.config.prepare_grammar:
            grammar.prepare(self.engine)
        if self.config.warm_prompts:
            await anyio.to_thread.run_sync(self._warm_prompts)
        watcher = asyncio.ensure_future(self._watch_stop()) if self._server else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            self.stop()
            await anyio.to_thread.run_sync(self._cancel_jobs)
            # The next server on the same cache folder resumes these conversations.
            await anyio.to_thread.run_sync(self.engine.save_pool)

    def _warm_prompts(self) -> None:
        """Prefill each --warm-prompts conversation into the pool (snapshots at its boundaries,
        so a request sharing its system prompt or tools reuses it), then to disk if enabled."""
        chat = self.worker
        for i, conversation in enumerate(self.config.warm_prompts):
            prepared = chat.prepare(parse_request(warm_request(conversation)), window=self.window,
                                    openai=True, renderer=self.renderer)  # fmt: skip
            prompt = prepared.prompt

            def fill(prompt=prompt) -> None:
                seq = chat.pool.acquire(prompt.ids, None)
                seq.extend(prompt.ids, stops=prompt.boundaries.points())
                if self.engine.disk is not None:
                    self.engine.disk.store_sequence(seq)

            self.engine.worker.call(fill)
            log.info("warm prompt %d: %d tokens prefilled", i, len(prompt.ids))

    async def _watch_stop(self) -> None:
        while not self._server.should_exit:
            await asyncio.sleep(STOP_POLL_S)
        self.stop()

    def stop(self) -> None:
        """The server's stop began (called on the event loop): this server's requests stop at
        their next token (the engine goes on), bodies still arriving and new requests get a
        503, so that uvicorn's wait for the connections to close is short."""
        self.stopping = True
        for scope in list(self.reading):
            scope.cancel()
        for job in list(self.jobs):
            job.cancel()

    def _cancel_jobs(self) -> None:
        """At shutdown, on a thread: wait for the cancelled requests to end."""
        for job in list(self.jobs):
            job.cancel()
        for job in list(self.jobs):
            job.wait(30)

    async def _read_body(self, request: Request) -> bytes:
        """The request's body: ApiError 413 over `max_body_bytes`, 408 if it has not all
        arrived `body_timeout` seconds after the request began, 503 once a stop began, 499
        (answered to no one) if the client went away."""
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
        if self.stopping:
            raise _shutting_down()
        body, size = [], 0
        with anyio.move_on_after(self.config.body_timeout) as deadline:
            self.reading.add(deadline)  # a stop cancels it
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:  # chunked bodies have no Content-Length: count as they come
                        raise ApiError(413, f"the request body exceeds {limit} bytes",
                                       code="body_too_large")  # fmt: skip
                    body.append(chunk)
                return b"".join(body)
            except ClientDisconnect:  # nobody will read the answer: one line, no traceback
                log.info("a client went away while sending its request body")
                raise ApiError(499, "the client went away while sending the request body",
                               code="client_disconnected") from None  # fmt: skip
            finally:
                self.reading.discard(deadline)
        if self.stopping:
            raise _shutting_down()
        raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout:g} "
                       "s of the request", code="request_timeout")  # fmt: skip

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _shaped(request, ApiError(exc.status_code, str(exc.detail), code=code))

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        return _shaped(request, ApiError(500, f"internal error: {exc}", type="server_error"))

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "model": self.config.model, "queued": self.engine.worker.queued()}
        )

    async def metrics(self, request: Request) -> Response:
        """Counters and gauges in Prometheus's text format: what the generations did, the
        batch, the cache and its disk tier, the queue. Read without the model thread (plain
        numbers it writes), so a scrape never waits behind a generation."""
        chat, eng = self.worker, self.engine
        c, batch, disk = chat.counts, eng.batch_stats, eng.disk
        rows = [
            ("generations_total", "counter", "Generations run: answered, failed or cancelled",
             chat.completed),
            ("answers_total", "counter", "Generations answered", c.answered),
            ("prompt_tokens_total", "counter", "Prompt tokens of the answers", c.prompt_tokens),
            ("prompt_cached_tokens_total", "counter",
             "Of those, tokens reused from the prefix cache", c.cached_tokens),
            ("generated_tokens_total", "counter", "Tokens generated", c.generated_tokens),
            ("time_to_first_token_seconds_total", "counter",
             "Time to first token of the answers, summed (divide by answers_total)", c.ttft_s),
            ("warmed_tokens_total", "counter", "Tokens prefilled by idle-time warm-ups",
             chat.warmed_tokens),
            ("batch_passes_total", "counter", "Passes through the model (steps and chunks)",
             batch["steps"]),
            ("batch_rows_total", "counter", "Rows those passes carried", batch["rows"]),
            ("pool_forks_total", "counter", "Prefixes forked into another pool sequence",
             chat.pool.forks),
            ("cache_evictions_total", "counter", "Snapshots and caches the budget evicted",
             eng.budget.evictions),
            ("cache_bytes", "gauge", "Bytes the pool held after the last answer", c.cache_bytes),
            ("cache_budget_bytes", "gauge", "The prefix cache's byte budget",
             eng.budget.max_bytes),
            ("queued_jobs", "gauge", "Jobs waiting for the model", eng.worker.queued()),
        ]  # fmt: skip
        if disk is not None:
            rows += [
                ("disk_reads_total", "counter", "Prefixes read back from the disk tier",
                 disk.reads),
                ("disk_writes_total", "counter", "Prefixes written to the disk tier", disk.writes),
            ]  # fmt: skip
        text = "".join(f"# HELP chatml_{name} {doc}\n# TYPE chatml_{name} {kind}\n"
                       f"chatml_{name} {value}\n" for name, kind, doc, value in rows)  # fmt: skip
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_entry()]})

    async def model(self, request: Request) -> Response:
        """One model (`client.models.retrieve`): the one served, under the name it is served as."""
        name = request.path_params["model"]
        if name != self.config.model:
            message = (
                f"the model '{name}' is not served here (this server serves '{self.config.model}')"
            )
            return _error(ApiError(404, message, param="model", code="model_not_found"))
        return JSONResponse(self._model_entry())

    def _model_entry(self) -> dict:
        return {
            "id": self.config.model, "object": "model", "created": 0, "owned_by": "chatml-engine",
            "context_window": self.window,
        }  # fmt: skip

    async def chat(self, request: Request) -> Response:
        try:
            raw = await self._read_body(request)
            self._check_queue()  # before any work on the body
            # Parsing, checking and tokenizing run on a thread, holding no lock that another
            # request waits on: a huge body does not stall the event loop or small requests.
            prepared = await anyio.to_thread.run_sync(self._prepare, raw)
            chat = prepared.request
            choices = await self._start_choices(request, prepared, warm=True)
        except ApiError as e:
            return _error(e)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if chat.stream:
            stream = self._stream(chat, choices, ident, created)
            return _Stream(stream, [c.job for c in choices], media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            turns = [await c.turn() for c in choices]
        except ApiError as e:
            return _error(e)
        finally:
            for c in choices:
                c.cancel()  # no-op once done; stops the work if this handler is torn down
        return JSONResponse(self._completion(turns, ident, created, chat.logprobs))

    def _check_queue(self) -> None:
        if self.stopping:
            raise _shutting_down()
        if self.engine.worker.queued() >= self.config.max_queued:
            raise ApiError(503, "the server is busy; retry later", type="server_error",
                           code="overloaded")  # fmt: skip

    def _prepare(self, raw: bytes):
        chat = parse_request(decode_body(raw), self.sampling)
        return self.worker.prepare(chat, window=self.window, renderer=self.renderer,
                                   default_max_tokens=self.config.max_tokens, openai=True)  # fmt: skip

    def _completion(self, turns: list[Turn], ident: str, created: int, logprobs: bool = False
                    ) -> dict:  # fmt: skip
        return {
            "id": ident, "object": "chat.completion", "created": created,
            "model": self.config.model,
            "choices": [{"index": i, "message": self._message(turn),
                         "logprobs": self._logprobs(turn, logprobs), "finish_reason": _finish(turn)}
                        for i, turn in enumerate(turns)],
            "usage": text_completion.usage_of(turns),
        }  # fmt: skip

    def _message(self, turn: Turn) -> dict:
        message: dict = {"role": "assistant", "content": turn.text}
        if turn.reasoning is not None:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = openai_message(turn).openai_tool_calls()
            message["content"] = turn.text or None
        return message

    def _logprobs(self, turn: Turn, asked: bool) -> dict | None:
        if not asked:
            return None
        return {"content": openai_content(self.engine.tokenizer, turn.logprobs or []),
                "refusal": None}  # fmt: skip

    async def _stream(self, chat, choices: list[Running], ident: str, created: int):
        pending: list[list] = [[] for _ in choices]  # per choice: logprobs not yet sent
        turns: list[Turn | None] = [None] * len(choices)

        def chunk(i: int, delta: dict | None = None, finish: str | None = None, **extra) -> str:
            entry = {"index": i, "delta": delta, "finish_reason": finish}
            if chat.logprobs and delta is not None:
                entry["logprobs"] = {"content": openai_content(self.engine.tokenizer, pending[i])}
                pending[i].clear()
            body = {
                "id": ident, "object": "chat.completion.chunk", "created": created,
                "model": self.config.model, "choices": [] if delta is None else [entry], **extra,
            }  # fmt: skip
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            for i in range(len(choices)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, event in merged(choices):
                if event[0] == "logprobs":
                    pending[i].extend(event[1])
                elif event[0] == "delta":
                    _, reasoning, content, _raw = event
                    if reasoning:
                        yield chunk(i, {"reasoning_content": reasoning})
                    if content:
                        yield chunk(i, {"content": content})
                elif event[0] == "error":
                    yield f"data: {json.dumps(event[1].body())}\n\n"
                    break
                elif event[0] == "done":
                    turn = turns[i] = event[1]
                    if turn.tool_calls:
                        calls = openai_message(turn).openai_tool_calls()
                        yield chunk(
                            i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                        )
                    yield chunk(i, {}, _finish(turn))
            else:
                if chat.include_usage:
                    yield chunk(0, None, usage=text_completion.usage_of(turns))
            yield "data: [DONE]\n\n"
        finally:
            for c in choices:
                c.cancel()

    # ----- the other APIs: translations onto the same chat request -------------------------

    async def _start_choices(self, request: Request, prepared: PreparedChat, *, warm: bool
                             ) -> list[Running]:  # fmt: skip
        """`_start` for each of the request's `n` choices: the first one prefills the prompt,
        and the others start once its first token is in, so they resume from its snapshot at
        the generation start (a fork, prefilling nothing of the prompt again) and decode in
        the same batched steps. Only the first warms the next request."""
        first = await self._start(request, prepared, warm=warm)
        if prepared.request.n == 1:
            return [first]
        rest = await asyncio.gather(*(
            self._start(request, later, warm=False, queue_checked=True)
            for later in later_choices(prepared)
        ), return_exceptions=True)  # fmt: skip
        started = [first, *(r for r in rest if isinstance(r, Running))]
        failed = [r for r in rest if isinstance(r, BaseException)]
        if failed:
            for r in started:
                r.cancel()
            raise failed[0]
        return started

    async def _start(self, request: Request, prepared: PreparedChat, *, warm: bool,
                     queue_checked: bool = False) -> Running:  # fmt: skip
        """Queue `prepared` on the model thread; returns once its first event is in (so an
        error in the prompt is still an HTTP error), raising the ApiError if it is one.
        `queue_checked`: a request's later choice, admitted with its first (the queue limit
        counts requests: one of n choices never waits on a full queue of its own)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        mine: list[Job] = []

        def emit(event: tuple) -> None:  # called on the engine's model thread
            if event[0] == "error" and event[1].code == "cancelled" and self.stopping:
                event = ("error", _shutting_down())  # cancelled by the stop, not the client
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                for j in mine:
                    j.cancel()

        if not queue_checked:
            self._check_queue()
        job = self.worker.submit(prepared, emit, warm=warm and self.config.warm)
        mine.append(job)
        self._track(job)
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        try:
            first = await events.get()
        except BaseException:
            job.cancel()
            watcher.cancel()
            raise
        if first[0] == "error":
            watcher.cancel()
            raise first[1]
        return Running(job, events, first, watcher)

    def _prepare_translated(self, asked, origins) -> PreparedChat:
        try:
            return self.worker.prepare(asked, window=self.window, renderer=self.renderer,
                                       default_max_tokens=self.config.max_tokens, openai=True)  # fmt: skip
        except ApiError as e:
            raise origins.error(e) from None

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API."""

        def prepare(raw: bytes):
            asked = messages.translate(decode_body(raw), self.sampling)
            return asked, self._prepare_translated(asked.chat, asked.origins)

        try:
            raw = await self._read_body(request)
            self._check_queue()
            asked, prepared = await anyio.to_thread.run_sync(prepare, raw)
            running = await self._start(request, prepared, warm=True)
        except ApiError as e:
            return _anthropic_error(e)
        ident, decode = f"msg_{uuid.uuid4().hex}", self.engine.tokenizer.decode
        if asked.chat.stream:
            stream = messages.stream(running.each(), asked, ident, self.config.model,
                                     len(prepared.prompt.ids), decode)  # fmt: skip
            return _Stream(stream, [running.job], media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            turn = await running.turn()
        except ApiError as e:
            return _anthropic_error(e)
        return JSONResponse(messages.message(turn, asked, ident, self.config.model, decode))

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's token count: the prompt a Messages request with this body would prefill
        (its `usage.input_tokens` + `cache_read_input_tokens`), rendered and tokenized without
        running the model; a prompt past the context window is counted as well."""

        def count(raw: bytes) -> int:
            asked = messages.translate(decode_body(raw), self.sampling, counting=True)
            try:  # a prompt past the window is counted too: how much to trim is the question
                return len(self._counter.render(asked.chat).ids)
            except ApiError as e:
                raise asked.origins.error(e) from None

        try:
            raw = await self._read_body(request)
            return JSONResponse({"input_tokens": await anyio.to_thread.run_sync(count, raw)})
        except ApiError as e:
            return _anthropic_error(e)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API."""

        def prepare(raw: bytes):
            asked = responses.translate(decode_body(raw), self.kept, self.sampling,
                                        think_end=self.think_end)  # fmt: skip
            return asked, self._prepare_translated(asked.chat, asked.origins)

        try:
            raw = await self._read_body(request)
            self._check_queue()
            asked, prepared = await anyio.to_thread.run_sync(prepare, raw)
            running = await self._start(request, prepared, warm=True)
        except ApiError as e:
            return _error(e)
        ident, created, model = f"resp_{uuid.uuid4().hex}", int(time.time()), self.config.model
        if asked.chat.stream:
            stream = responses.stream(running.each(), asked, self.kept, ident, created, model)
            return _Stream(stream, [running.job], media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            turn = await running.turn()
        except ApiError as e:
            return _error(e)
        out = responses.output(turn)
        responses.remember(self.kept, asked, ident, turn, out)
        return JSONResponse(responses.response(asked, ident, created, model, turn, out))

    async def completions(self, request: Request) -> Response:
        """The legacy completions API: a raw prompt, no chat template."""
        tokenizer = self.engine.tokenizer

        def prepare(raw: bytes):
            return text_completion.translate(
                decode_body(raw), tokenizer, self.window, self.sampling,
                max_token_bytes=self.renderer.max_token_bytes,
            )  # fmt: skip

        choices, scored = [], None
        try:
            raw = await self._read_body(request)
            self._check_queue()
            asked = await anyio.to_thread.run_sync(prepare, raw)
            if asked.max_tokens > 0:
                prepared = PreparedChat(asked.chat, asked.prompt, asked.max_tokens, self.window,
                                        None, False, time.perf_counter(), self.renderer)  # fmt: skip
                # No warm-up: it re-renders chat messages, and a raw prompt has none.
                choices = await self._start_choices(request, prepared, warm=False)
            elif asked.logprobs is not None:
                scored = await self._score(request, asked.prompt.ids, asked.logprobs)
        except ApiError as e:
            return _error(e)
        ident, model = f"cmpl-{uuid.uuid4().hex}", self.config.model
        if asked.chat.stream:
            events = merged(choices) if choices else None
            stream = text_completion.stream(events, asked, ident, model, tokenizer, scored)
            return _Stream(stream, [c.job for c in choices], media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache"})  # fmt: skip
        echo = asked.prompt.text if asked.echo else ""
        ids = asked.prompt.ids
        if not choices:  # max_tokens 0: the prompt only
            logprobs = None
            if scored is not None:
                logprobs = text_completion.logprobs_body(tokenizer, ids, scored, asked.logprobs)
            usage = text_completion.usage(len(ids), 0, 0)
            answers = [(echo, "length", logprobs)] * asked.chat.n
            body = text_completion.completion(ident, int(time.time()), model, answers, usage)
            return JSONResponse(body)
        try:
            collected = [await text_completion.collect(c.each()) for c in choices]
        except ApiError as e:
            return _error(e)
        finally:
            for c in choices:
                c.cancel()
        answers = []
        for text, turn in collected:
            logprobs = None
            if asked.logprobs is not None:
                logprobs = text_completion.generated_logprobs_body(tokenizer, turn, asked.logprobs)
            answers.append((echo + text, turn.finish_reason, logprobs))
        usage = text_completion.usage_of([turn for _, turn in collected])
        body = text_completion.completion(ident, int(time.time()), model, answers, usage)
        return JSONResponse(body)

    def _track(self, job: Job) -> None:
        """Count `job` among this server's unfinished requests (a stop cancels them)."""
        self.jobs = {j for j in self.jobs if not j.done.is_set()} | {job}

    async def _score(self, request: Request, ids: list[int], top: int) -> list:
        """The prompt's logprobs (`text_completion.prompt_logprobs`), computed on the model
        thread in chunks between the other requests' steps; cancelled if the client leaves."""
        self._check_queue()
        loop, ended = asyncio.get_running_loop(), asyncio.Queue()

        def end(kind: str, value) -> None:  # called on the engine's model thread
            with suppress(RuntimeError):  # the loop is gone (shutdown): nobody listens
                loop.call_soon_threadsafe(ended.put_nowait, (kind, value))

        make = partial(text_completion.prompt_logprobs, self.engine, ids, top)
        job = self.engine.worker.spawn(make, lambda item: None, end)
        self._track(job)
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        try:
            kind, value = await ended.get()
        finally:
            job.cancel()  # no-op once done; stops the work if this handler is torn down
            watcher.cancel()
        if kind == "raise":
            raise value
        if kind == "cancelled":  # the client left (nobody reads this) or the server stops
            raise _shutting_down()
        return value


class Running:
    """A generation queued on the model thread: its job, its events, the disconnect watcher."""

    def __init__(self, job: Job, events: asyncio.Queue, first: tuple, watcher: asyncio.Future):
        self.job, self.events, self.first, self.watcher = job, events, first, watcher

    def cancel(self) -> None:
        """Stop the generation (a no-op once it is done) and its disconnect watcher."""
        self.job.cancel()
        self.watcher.cancel()

    async def each(self) -> AsyncIterator[tuple]:
        """The events up to ("done", Turn) or ("error", ApiError), always starting with
        ("first", reused_tokens) (an answer that ends at once has no first token); leaving
        early cancels the job."""
        event = self.first
        try:
            if event[0] == "done":
                yield ("first", event[1].stats.reused_tokens)
            while True:
                yield event
                if event[0] in ("done", "error"):
                    return
                event = await self.events.get()
        finally:
            self.job.cancel()  # no-op once done
            self.watcher.cancel()

    async def turn(self) -> Turn:
        """The finished Turn; raises the job's ApiError."""
        async for event in self.each():
            if event[0] == "error":
                raise event[1]
            if event[0] == "done":
                return event[1]
        raise ApiError(500, "the generation ended without an answer", type="server_error")


async def merged(choices: list[Running]) -> AsyncIterator[tuple[int, tuple]]:
    """The choices' events (`Running.each`), each with its choice's index, as they come; ends
    when every choice is done or after the first error. Leaving early cancels them all."""
    if len(choices) == 1:
        async for event in choices[0].each():
            yield 0, event
        return
    events: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, running: Running) -> None:
        async for event in running.each():
            events.put_nowait((i, event))

    pumps = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    try:
        left = len(choices)
        while left:
            i, event = await events.get()
            yield i, event
            if event[0] == "error":
                return
            left -= event[0] == "done"
    finally:
        for p in pumps:
            p.cancel()
        for c in choices:
            c.cancel()


def _finish(turn: Turn) -> str:
    return "tool_calls" if turn.tool_calls else turn.finish_reason


class _Stream(StreamingResponse):
    """A streaming response that cancels its jobs (a request's choices) however it ends (a
    failed send included); none when nothing runs on the model (a prompt echoed as it is)."""

    def __init__(self, content, jobs: list[Job], **kwargs):
        super().__init__(content, **kwargs)
        self.jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel()


def create_app(engine, config: ServerConfig | None = None) -> ServerApp:
    """The ASGI application for `engine` (its lifespan starts and stops the model thread)."""
    return ServerApp(engine, config or ServerConfig())


# ----- running it ---------------------------------------------------------------------------


class BackgroundServer:
    """uvicorn in a thread on an already bound socket (tests, benchmarks): `url`, `stop()`."""

    def __init__(self, engine, config: ServerConfig | None = None):
        config = config or ServerConfig(port=0)
        self.app = create_app(engine, config)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((config.host, config.port))
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
            )
        )
        self.app.watch(self.server)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 for an address with ':')."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def run(args: argparse.Namespace, sampling: dict | None = None) -> int:
    """`chatml serve`: bind, load the model, serve until interrupted.

    The port is bound and the disk cache's folder locked first, so a taken port or a folder
    another server holds fails at once (exit 1), naming it, before the model loads; the
    banner is printed only once the socket listens and the model is loaded. `sampling`
    overrides the checkpoint's sampling defaults (flags).
    """
    import engine as engine_pkg

    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
        origins = [check_origin(o) for o in getattr(args, "allow_origin", None) or ()]
        speculative = speculative_options(args)
    except ValueError as e:
        print(f"chatml serve: error: {e}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and not api_key:
        log.warning(
            "serving on %s without an API key: anyone who can reach it can use it", args.host
        )
    shard = getattr(args, "shard", None)
    if shard_rank(args) != 0:  # a follower rank: it serves rank 0 inside load, then exits
        engine_pkg.load(args.model, quantize=getattr(args, "quantize", None), shard=shard,
                        **speculative)  # fmt: skip
        return 0
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        print(f"chatml serve: cannot listen on {args.host} port {args.port}: {e.strerror or e}",
              file=sys.stderr)  # fmt: skip
        return 1
    folder = None
    if not args.no_disk_cache:
        from ..storage.disk_cache import DiskCacheError, FolderLock

        try:
            folder = FolderLock(args.cache_dir)
        except DiskCacheError as e:  # busy, or not a folder this process can use
            sock.close()
            print(f"chatml serve: error: {e}", file=sys.stderr)
            return 1
    try:
        with sock:
            return _serve(args, sock, folder, sampling, api_key, origins, speculative, shard)
    finally:
        if folder is not None:
            folder.release()  # (the disk cache released it already, if it took it over)


def _serve(args, sock, folder, sampling, api_key, origins, speculative, shard) -> int:
    """`run` once the port listens and the cache folder is locked: load, serve, close."""
    import engine as engine_pkg

    from ..checkpoints.generation import describe

    eng = engine_pkg.load(
        args.model, cache_bytes=args.cache_bytes, quantize=getattr(args, "quantize", None),
        max_batch=getattr(args, "max_batch", DEFAULT_MAX_BATCH),
        pass_tokens=getattr(args, "pass_tokens", DEFAULT_PASS_TOKENS), shard=shard, **speculative,
    )  # fmt: skip
    disk, stopped_by = None, []
    try:
        try:
            warm = load_warm_prompts(args.warm_prompts, eng) if args.warm_prompts else None
        except ValueError as e:
            print(f"chatml serve: error: {e}", file=sys.stderr)
            return 2
        if folder is not None:  # with --shard, rank 0 gathers the entries (state_file)
            disk = eng.attach_disk(args.cache_dir, args.disk_cache_bytes, lock=folder)
        defaults = {**eng.sampling_defaults, **(sampling or {})}
        config = ServerConfig(
            model=args.model, host=args.host, port=args.port, api_key=api_key,
            sequences=args.sequences, max_tokens=args.max_tokens, sampling=defaults,
            special_tokens_in_content="parse" if args.parse_special_in_content else "text",
            warm_prompts=warm, warm=not getattr(args, "no_warm", False), allow_origins=origins,
        )  # fmt: skip
        app = create_app(eng, config)
        server = uvicorn.Server(uvicorn.Config(app, log_level="info",
                                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))  # fmt: skip
        app.watch(server)  # a stop cancels the requests at once
        lost = _stop_when_a_rank_is_lost(eng, server)
        # The handlers before the banner: a client (or a test) that stops the server as soon
        # as it reads the banner gets a clean stop, not the default SIGTERM's kill.
        with _stop_signals(server, stopped_by):
            host, port = sock.getsockname()[:2]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
            print(f"chatml serve: {args.model} on {url}", flush=True)
            shown = describe(defaults) if defaults else "OpenAI's (temperature 1, top_p 1)"
            print(f"  sampling defaults (a request's fields replace them): {shown}", flush=True)
            if disk is not None:
                print(f"  disk cache: {disk.dir} ({disk.entries} prefixes, budget "
                      f"{disk.max_bytes / (1 << 30):.1f} GiB)", flush=True)  # fmt: skip
            server.run(sockets=[sock])
    finally:
        eng.close()  # the disk cache's writes finish, its folder is released
    if lost:
        print(f"chatml serve: {lost[0]}", file=sys.stderr, flush=True)
        return EXIT_LOST
    if stopped_by:  # after the close: this line says everything queued is on disk
        kept = f"; disk cache closed, {disk.writes} prefixes written" if disk else ""
        print(f"chatml serve: stopped by {signal.Signals(stopped_by[0]).name}{kept}",
              flush=True)  # fmt: skip
    return 0


def _stop_when_a_rank_is_lost(eng, server: uvicorn.Server) -> list[str]:
    """With --shard, a peer rank gone (a failed transfer: a request's, or rank 0's heartbeat)
    stops the server, which then exits 3 naming it, as `chatml chat` does: every later request
    would fail. The list gets the reason."""
    lost: list[str] = []
    link = getattr(eng.model, "link", None)
    if link is None:
        return lost

    def watch() -> None:
        link.failed.wait()
        lost.append(link.broken)
        server.should_exit = True

    threading.Thread(target=watch, name="chatml-serve-shard-watch", daemon=True).start()
    return lost


@contextmanager
def _stop_signals(server: uvicorn.Server, stopped_by: list[int]):
    """SIGTERM and SIGINT stop the server gracefully and then let `run` return (exit 0).

    uvicorn catches them while it runs and, after its graceful shutdown, raises the signal
    again under the handler it found: the default one would kill the process there, before
    `eng.close()` (the disk writes' end). The handler found is this one: it records the
    signal (and stops the server, for a signal before uvicorn's handlers are in place)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: nothing to catch here
        return

    def stop(sig: int, frame) -> None:
        stopped_by.append(sig)
        server.should_exit = True

    kept = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def warm_request(entry: list | dict) -> dict:
    """A --warm-prompts entry as a request body: a message array, or an object with
    `messages` and `tools` (a tool set renders into the system block, so requests with those
    tools reuse its prefill)."""
    return {"messages": entry} if isinstance(entry, list) else dict(entry)


def _warm_entry(entry) -> bool:
    if isinstance(entry, dict):
        return set(entry) <= {"messages", "tools"} and isinstance(entry.get("messages"), list)
    return isinstance(entry, list) and bool(entry)


def load_warm_prompts(path: str, engine) -> list:
    """--warm-prompts FILE: a JSON list of message arrays (or of objects with `messages` and
    `tools`), each checked and rendered as a request's would be; ValueError naming the entry
    and the field otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--warm-prompts {path}: {e}") from None
    if not isinstance(data, list) or not all(map(_warm_entry, data)):
        raise ValueError(f"--warm-prompts {path}: expected a JSON list of message arrays (or "
                         'of {"messages": [...], "tools": [...]} objects)')  # fmt: skip
    for i, prompt in enumerate(data):
        try:
            Renderer(engine).render(parse_request(warm_request(prompt)))
        except ApiError as e:
            raise ValueError(f"--warm-prompts {path}: [{i}]: {e.message} ({e.param})") from None
    return data
