"""Response senders of a model that is not decoupled (Triton's default mode, 24.06 and later).

Such a model may answer a request through `request.get_response_sender()` rather than in execute's
list: exactly one response, the flag TRITONSERVER_RESPONSE_COMPLETE_FINAL sent with it or alone after
it, from execute or from a thread after it returned. execute then returns None, or a list with None in
the place of each request answered so; the others' responses are in the list. The batch's answer is
still one per request, in order, as if execute had returned them all: the stub waits for the responses
still to come, then answers. A batch whose requests never ask for a sender meets none of this.

Misuse fails as in Triton, with its messages: a second response, the final flag before a response, a
flag other than 0 or the final one, or a response returned for a request that sent one (which fails
the whole execute). When execute fails, requests that sent their response keep it and the others get
the error; their senders close. A request that neither took its sender nor has a response in the list
fails alone, as a None returned without senders does (Triton would leave it unanswered).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Collection
from typing import Any

import triton_python_backend_utils as pb_utils

Answer = tuple[str, Any, Any]  # ("ok", outputs, response parameters) or ("error", (message, code), None)
Convert = Callable[[Any, Collection[str]], Answer]  # a response, the outputs asked for -> its answer

UNSUPPORTED_FLAG = "Unable to send response. Unsupported flag provided."
NO_RESPONSE = "Inference Response object must be provided when the response flags is set to zero."
MORE_THAN_ONE = "Unable to send response. Non-decoupled model cannot send more than one response."
FINAL_FIRST = ("Unable to send response. Non-decoupled model cannot send complete final before sending a "
               "response.")
CLOSED = "Unable to send response. Response sender has been closed."


def wrong_return(returned: Any, count: int) -> str | None:
    """What is wrong with execute's return for `count` requests, in Triton's words; None when it is one
    response (or None) per request. (A tuple, which Triton refuses, is taken as a list.)"""
    if not isinstance(returned, (list, tuple)):
        return f"Expected a list in the execute return, found type '{type(returned)}'."
    if len(returned) != count:
        return ("Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
                f"InferenceRequest(s) size is:{count}, and InferenceResponse(s) size is:{len(returned)}")
    return None


class DefaultSenders:
    """The senders of the batch a non-decoupled model's execute is running, made when a request asks."""

    def __init__(self, convert: Convert) -> None:
        self._convert = convert
        self._requests: list[Any] = []
        self._lock = threading.Lock()
        self.batch: SentResponses | None = None  # the running batch's, once one of its requests asked

    def start(self, requests: list[Any]) -> None:
        """A batch begins: none of its requests has a sender yet."""
        self._requests, self.batch = requests, None

    def of(self, request: Any) -> ResponseSender:
        """`request`'s sender; closed when no execute runs (pb_utils._model_calls is set meanwhile): its
        batch was answered without it."""
        with self._lock:  # (the model's threads may ask at once)
            if pb_utils._model_calls is None:
                return ResponseSender(None, -1, closed=True)
            if self.batch is None:
                self.batch = SentResponses(self._requests, self._convert)
            return self.batch.sender(request)


class SentResponses:
    """One batch's answers as its requests' senders and execute's list give them."""

    def __init__(self, requests: list[Any], convert: Convert) -> None:
        self._requests = requests  # (kept: their ids index them)
        self._index = {id(r): i for i, r in enumerate(requests)}
        self._asked = [r.requested_output_names() for r in requests]
        self._convert = convert
        self._lock = threading.Lock()
        self._senders: dict[int, ResponseSender] = {}
        self._answers: list[Answer | None] = [None] * len(requests)
        self._left = len(requests)
        self._answered: concurrent.futures.Future[None] = concurrent.futures.Future()
        if not requests:
            self._answered.set_result(None)

    def sender(self, request: Any) -> ResponseSender:
        """Its request's sender; a request of no batch running (an old one's, one the model made) gets
        one that is closed."""
        index = self._index.get(id(request))
        if index is None:
            return ResponseSender(None, -1, closed=True)
        if index not in self._senders:
            self._senders[index] = ResponseSender(self, index)
        return self._senders[index]

    def send(self, sender: ResponseSender, response: Any, final: bool) -> None:
        answer = None if response is None else self._convert(response, self._asked[sender.index])
        with self._lock:
            if answer is not None and sender.sent:
                raise pb_utils.TritonModelException(MORE_THAN_ONE)
            if answer is None and not sender.sent:
                raise pb_utils.TritonModelException(FINAL_FIRST)
            if sender.closed:
                raise pb_utils.TritonModelException(CLOSED)
            sender.closed = final
            if answer is not None:
                sender.sent = True
                self._answer(sender.index, answer)

    def answers(self, returned: Any, failure: str | None, loop: asyncio.AbstractEventLoop | None
                ) -> list[Answer]:
        """The batch's answers, once execute returned `returned` or failed (`failure`, its message): what
        the senders sent, the list's responses for the others, each in its request's place. Waits for
        the responses still to come, running `loop` meanwhile (an async model's tasks may send them)."""
        count = len(self._answers)
        if failure is None and returned is not None:
            wrong = wrong_return(returned, count)
            failure = None if wrong is None else f"execute failed: {wrong}"
        listed = {} if failure is not None or returned is None else {
            i: self._convert(r, self._asked[i]) for i, r in enumerate(returned) if r is not None}
        with self._lock:
            if any(i in self._senders and self._senders[i].sent for i in listed):
                failure = f"execute failed: {MORE_THAN_ONE}"
            if failure is not None:  # as in Triton: the senders close, the requests without a response fail
                for sender in self._senders.values():
                    sender.closed = True
                failed: Answer = ("error", (pb_utils._named(failure), pb_utils.TritonError.INTERNAL), None)
                for i in range(count):
                    if self._answers[i] is None:
                        self._answer(i, failed)
            else:
                for i, answer in listed.items():
                    if i in self._senders:  # a response returned is its request's one and final response
                        self._senders[i].sent = self._senders[i].closed = True
                    self._answer(i, answer)
                for i in range(count):  # None returned, and no sender to answer later: as without senders
                    if self._answers[i] is None and i not in self._senders:
                        self._answer(i, self._convert(None, self._asked[i]))
        if loop is not None and not self._answered.done():
            loop.run_until_complete(asyncio.wrap_future(self._answered, loop=loop))
        self._answered.result()
        return self._answers  # type: ignore[return-value]  # every one answered by now

    def _answer(self, index: int, answer: Answer) -> None:
        """(with the lock held)"""
        self._answers[index] = answer
        self._left -= 1
        if self._left == 0:
            self._answered.set_result(None)


class ResponseSender(pb_utils.InferenceResponseSender):
    """Triton's InferenceResponseSender for a model that is not decoupled: `send(response=None,
    flags=0)`, one response in all, with flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL or followed by the
    flag alone."""

    def __init__(self, batch: SentResponses | None, index: int, closed: bool = False) -> None:
        self._batch, self.index = batch, index  # (None: a request of no batch running)
        self.sent = False     # its response was sent (or returned)
        self.closed = closed  # the final flag was sent, or the batch failed

    def send(self, response: Any = None, flags: int = 0) -> None:
        if flags not in (0, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise pb_utils.TritonModelException(UNSUPPORTED_FLAG)
        if response is None and not flags:
            raise pb_utils.TritonModelException(NO_RESPONSE)
        if self._batch is None:
            raise pb_utils.TritonModelException(CLOSED)
        self._batch.send(self, response, bool(flags))

    def is_cancelled(self) -> bool:
        """False: a request of a model that is not decoupled is not told of its client going away."""
        return False
