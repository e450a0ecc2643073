"""Responses that stream under the ASGI server too.

Django's ASGI handler reads a response through its asynchronous iterator. A ``FileResponse`` has
only a synchronous one, which Django then consumes whole, into a list in memory, before the first
byte is sent: a 20 MB file costs 20 MB of the web process. ``StreamedFileResponse`` reads it a
block at a time in a worker thread instead, and sends each block before reading the next.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.http import FileResponse


class StreamedFileResponse(FileResponse):
    block_size = 256 * 1024  # memory held per response while it is sent

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert self.file_to_stream is not None  # set by FileResponse from the file it was given
        read = sync_to_async(self.file_to_stream.read, thread_sensitive=False)
        while block := await read(self.block_size):
            yield block
