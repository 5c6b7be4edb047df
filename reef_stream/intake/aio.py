"""The asyncio face of the producer SDK, for servers and async inference loops.

    async with AsyncRecordProducer() as producer:
        handle = await producer.send(generation)      # validated and handed over
        await producer.acknowledged(handle)           # the broker has it
        await producer.durable(handle)                # ... or it is at least spooled

It wraps one ``RecordProducer`` (same guarantees, same spool). ``send`` never
blocks the event loop: when the spool is full it waits in a worker thread.
"""

from __future__ import annotations

import asyncio

from reef_stream.core.events import DeadLetter, Feedback, Generation
from reef_stream.intake.producer import DeliveryState, FlushReport, RecordProducer, SendHandle


class AsyncRecordProducer:
    """Takes the keyword arguments of ``RecordProducer``."""

    def __init__(self, **kwargs):
        self.sync = RecordProducer(**kwargs)

    async def send(self, event: Generation | Feedback | DeadLetter) -> SendHandle:
        """Validate and hand over one record (raises InvalidRecord, SpoolFull)."""
        if self.sync._spool_is_empty():
            return self.sync.send(event)
        # Records go to the spool, where room may have to be waited for: not on the loop.
        return await asyncio.to_thread(self.sync.send, event)

    async def acknowledged(self, handle: SendHandle, timeout: float | None = None) -> bool:
        """Wait until the broker acknowledged ``handle`` (True) or ``timeout`` (False).

        Raises the record's error if it failed.
        """
        await self._until(handle, lambda h: h.done, timeout)
        if handle.state is DeliveryState.FAILED:
            raise handle.error
        return handle.state is DeliveryState.ACKNOWLEDGED

    async def durable(self, handle: SendHandle, timeout: float | None = None) -> bool:
        """Wait until ``handle`` is spooled or acknowledged (True) or ``timeout`` (False)."""
        await self._until(handle, lambda h: h.durable or h.done, timeout)
        if handle.state is DeliveryState.FAILED:
            raise handle.error
        return handle.durable

    async def _until(self, handle: SendHandle, condition, timeout: float | None) -> None:
        if condition(handle):
            return
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        self.sync.add_state_listener(handle, lambda h: loop.call_soon_threadsafe(changed.set))
        try:
            async with asyncio.timeout(timeout):
                while not condition(handle):
                    await changed.wait()
                    changed.clear()
        except TimeoutError:
            pass

    async def flush(self, timeout: float = 30.0) -> FlushReport:
        return await asyncio.to_thread(self.sync.flush, timeout)

    async def close(self, timeout: float = 30.0) -> FlushReport:
        return await asyncio.to_thread(self.sync.close, timeout)

    async def __aenter__(self) -> "AsyncRecordProducer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
