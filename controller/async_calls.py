"""The controller's gRPC server runs on one asyncio loop (grpc.aio), so a waiting agent stream holds no thread.

The agent stream (rpc/agent_service.AgentServicer.Connect) is a coroutine. Every other handler (FarmService,
the artifact downloads) stays a plain function that may block on the store: `on_threads` runs it on a
worker thread and gives it the synchronous context it was written for (abort raises, is_active turns
False and the callbacks run when the call ends: grpc.aio's own thread migration does neither when a
call is cancelled, so a cut watcher would keep its slot). `ServerLoop` owns the loop's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Iterator, TypeVar

import grpc

T = TypeVar("T")
# what to tell the caller of a call that failed on `error` (None: nothing, the error is raised as it is)
Unavailable = Callable[[BaseException], "str | None"]
_DONE = object()  # the end of a request or response stream, handed across the loop/thread boundary


class Aborted(Exception):
    """A handler on a worker thread ended its call with a status; the loop side sends it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class ThreadContext:
    """The part of grpc.ServicerContext farm's handlers use, for a handler running on a worker thread."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        # Read on the loop thread, where the call's state lives; the handler only reads copies.
        self._peer = context.peer()
        self._metadata = context.invocation_metadata()
        self._ended = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.reading: concurrent.futures.Future[Any] | None = None  # a request read waiting on the loop

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> Any:
        return self._metadata

    def is_active(self) -> bool:
        return not self._ended.is_set()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._ended.is_set():
                return False
            self._callbacks.append(callback)
            return True

    def end(self) -> None:
        """The call is over (finished, failed or cut): stop a waiting read and run the callbacks once."""
        with self._lock:
            if self._ended.is_set():
                return
            self._ended.set()
            callbacks, self._callbacks = self._callbacks, []
        if self.reading is not None:
            self.reading.cancel()
        for callback in callbacks:
            callback()


async def next_request(requests: AsyncIterator[T]) -> T | None:
    """The next message of an async request stream, or None at its end (a message is never None)."""
    try:
        return await requests.__anext__()
    except StopAsyncIteration:
        return None


def _thread_requests(requests: AsyncIterator[T], loop: asyncio.AbstractEventLoop, context: ThreadContext) -> Iterator[T]:
    """An async request stream read from a worker thread, one message at a time."""
    while context.is_active():
        context.reading = asyncio.run_coroutine_threadsafe(next_request(requests), loop)
        try:
            message = context.reading.result()
        except concurrent.futures.CancelledError:
            return
        if message is None:
            return
        yield message


def on_threads(handler: grpc.RpcMethodHandler, pool: concurrent.futures.Executor,
               unavailable: Unavailable | None = None) -> grpc.RpcMethodHandler:
    """The same handler as a coroutine of the loop that runs the plain function on `pool`; an error `unavailable`
    gives a message for ends the call UNAVAILABLE with it (the store out of reach: a call to try again)."""
    behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    if inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior):
        return handler  # written for the loop already

    def request_of(request: Any, context: ThreadContext, loop: asyncio.AbstractEventLoop) -> Any:
        return _thread_requests(request, loop, context) if handler.request_streaming else request

    if handler.response_streaming:
        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            loop = asyncio.get_running_loop()
            threaded = ThreadContext(context)
            responses: Iterator[Any] | None = None
            pending: asyncio.Future[Any] | None = None
            try:
                pending = loop.run_in_executor(pool, lambda: iter(behavior(request_of(request, threaded, loop),
                                                                           threaded)))
                responses = await pending
                while True:
                    pending = loop.run_in_executor(pool, next, responses, _DONE)
                    response = await pending
                    if response is _DONE:
                        return
                    yield response
            except Aborted as e:
                await context.abort(e.code, e.details)
            except Exception as e:
                await _unavailable(e, unavailable, context)
            finally:
                threaded.end()
                _close_after(responses, pending, pool)
        run: Callable[..., Any] = streaming
    else:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            loop = asyncio.get_running_loop()
            threaded = ThreadContext(context)
            try:
                return await loop.run_in_executor(pool, behavior, request_of(request, threaded, loop), threaded)
            except Aborted as e:
                await context.abort(e.code, e.details)
            except Exception as e:
                await _unavailable(e, unavailable, context)
            finally:
                threaded.end()
        run = unary
    return same_kind(handler, run)


async def _unavailable(error: Exception, unavailable: Unavailable | None, context: grpc.aio.ServicerContext) -> None:
    """Abort UNAVAILABLE with unavailable(error)'s message; re-raise an error it has none for."""
    why = unavailable(error) if unavailable is not None else None
    if why is None:
        raise error
    await context.abort(grpc.StatusCode.UNAVAILABLE, why[:2000])


def _close_after(responses: Iterator[Any] | None, pending: asyncio.Future[Any] | None,
                 pool: concurrent.futures.Executor) -> None:
    """Close a response generator the call left (its `finally` frees what it held), once no thread runs it."""
    close = getattr(responses, "close", None)
    if close is None:
        return
    if pending is None or pending.done():
        pool.submit(close)
    else:  # a next() still runs on its thread: closing now would find the generator executing
        pending.add_done_callback(lambda _: pool.submit(close))


def same_kind(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A method handler of handler's kind and (de)serializers around another behavior."""
    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kind[(handler.request_streaming, handler.response_streaming)](
        behavior, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def abort_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of handler's kind that refuses the call."""
    if handler.response_streaming:
        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(code, message)
            yield None  # never reached: makes this an async generator, as a streaming answer must be
        return same_kind(handler, refuse_stream)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
    return same_kind(handler, refuse)


class ServerLoop:
    """The asyncio loop the gRPC server lives on, in a thread of its own so callers stay synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result from this (other) thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def call(self, function: Callable[[], T], timeout_s: float | None = None) -> T:
        """Call a plain function on the loop's thread (objects bound to the loop are made there)."""
        async def call() -> T:
            return function()
        return self.run(call(), timeout_s)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


Guard = Callable[[grpc.RpcMethodHandler, grpc.HandlerCallDetails], grpc.RpcMethodHandler]


class CallGate(grpc.aio.ServerInterceptor):
    """Every call's handler on the loop: plain functions moved to `pool`, then `guard` (tokens, budgets) around it."""

    def __init__(self, pool: concurrent.futures.Executor, guard: Guard | None = None, *,
                 unavailable: Unavailable | None = None) -> None:
        self.pool, self.guard, self.unavailable = pool, guard, unavailable

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        handler = on_threads(handler, self.pool, self.unavailable)
        return self.guard(handler, handler_call_details) if self.guard else handler
