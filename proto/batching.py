"""Batches on the agent stream: several queued messages leave in one write (AgentBatch, ControllerBatch).

Each message on a synchronous gRPC stream is a write and a read with thread hand-offs on both ends; a task
took four (work request, offer, result, acknowledgement). A side that lists "batch" in its Hello or Welcome
reads batches; the other side then sends whatever is queued at once as one. Nothing waits to fill a batch:
a quiet stream sends single messages as before, a busy one sends fewer, larger ones.
"""

from __future__ import annotations

import queue
from typing import Any, TypeVar, Union

BATCH_CAPABILITY = "batch"
MAX_BATCH_MESSAGES = 64  # what one side may put in a batch; more is refused as hostile

Message = TypeVar("Message")
# a stream's outbox: the agent's queue.Queue (read with a timeout), the controller's SimpleQueue (no lock in Python)
Outbox = Union["queue.Queue[Message | None]", "queue.SimpleQueue[Message | None]"]


def _queued_after(outbox: Outbox[Message], limit: int) -> tuple[list[Message], bool]:
    """What is queued right now behind a message just taken (at most `limit`, without waiting), and whether the
    stream's end (None) was among it: the end is taken out, so the caller sends what it has and then stops."""
    more: list[Message] = []
    while len(more) < limit:
        try:
            message = outbox.get_nowait()
        except queue.Empty:
            break
        if message is None:
            return more, True
        more.append(message)
    return more, False


def opened(message: Any) -> list[Any]:
    """A message's parts: a batch's messages, or the message itself (a batch is never put inside another)."""
    return list(message.batch.messages) if message.WhichOneof("kind") == "batch" else [message]


def gathered(first: Message, outbox: Outbox[Message]) -> tuple[list[Message], bool]:
    """`first` and what is queued behind it, batches opened, at most MAX_BATCH_MESSAGES in all, and whether the
    stream's end was among it. A queued message holds at most two (an agent's result with its next request)."""
    messages = opened(first)
    more, ending = _queued_after(outbox, (MAX_BATCH_MESSAGES - len(messages)) // 2)
    for message in more:
        messages += opened(message)
    return messages, ending
