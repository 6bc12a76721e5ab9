"""One thread that takes what has queued meanwhile and writes it as one batch (one transaction).

The result writer and the lease renewer are this: many agents' messages arrive together, and taking
turns on the store's lock one commit at a time is what a lab cannot afford.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from typing import Generic, TypeVar

T = TypeVar("T")


class BatchThread(ABC, Generic[T]):
    """Queued items, written `max_batch` at most at a time by one thread; subclasses say how (`write`)."""

    def __init__(self, name: str, max_batch: int) -> None:
        self.max_batch = max(1, max_batch)
        self._queue: "queue.SimpleQueue[T | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """What is still queued is not written (the agents send it again to whichever controller is next)."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(10)

    def put(self, item: T) -> None:
        self._queue.put(item)

    @abstractmethod
    def write(self, batch: list[T]) -> None:
        """Write one batch (one transaction); called on the thread, never concurrently."""

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            stopping = False
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            self.write(batch)
            if stopping:
                return


__all__ = ["BatchThread"]
