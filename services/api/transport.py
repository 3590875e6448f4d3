"""One socket write per response: uvicorn's HTTP protocol over a gathering transport.

uvicorn writes a response's status line and headers when the app sends
``http.response.start`` and its body when it sends ``http.response.body``: two ``send()``
calls and two TCP segments per answer, where a kept answer costs little else (the second
system call was about a third of the API's CPU per kept answer). :class:`GatheringTransport`
holds what is written to a connection during one step of the event loop and writes it as
one buffer at the end of the step, or at once past :data:`FLUSH_BYTES`; everything else is
the transport's own. :func:`http_protocol` is uvicorn's httptools protocol (its h11 one
when httptools is not installed) over it.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

# Past this many bytes gathered, write at once: a large body is not held in a second buffer.
FLUSH_BYTES = 256 * 1024


class GatheringTransport(asyncio.Transport):
    """A transport that writes what it is given within one loop step as one buffer."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._gathered: list[bytes] = []
        self._size = 0

    # ------------------------------------------------------------------ writing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._gathered:
            self._loop.call_soon(self.flush)
        self._gathered.append(bytes(data))
        self._size += len(data)
        if self._size >= FLUSH_BYTES:
            self.flush()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Write what was gathered (a no-op when nothing was, or once the connection is
        closing: the peer is gone)."""
        if not self._gathered:
            return
        data = self._gathered[0] if len(self._gathered) == 1 else b"".join(self._gathered)
        self._gathered.clear()
        self._size = 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._gathered.clear()
        self._size = 0
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._size + self._transport.get_write_buffer_size()

    # ------------------------------------------------------------------ the transport's own

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.flush()  # what the old protocol wrote goes first
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()


def http_protocol() -> tuple[type[asyncio.Protocol], str]:
    """uvicorn's HTTP protocol over a :class:`GatheringTransport`, and its parser's name:
    ``httptools`` (C parser) when installed, else ``h11``."""
    base: type[Any]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base, name = HttpToolsProtocol, "httptools"
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base, name = H11Protocol, "h11"

    class GatheringProtocol(base):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            stream = cast(asyncio.Transport, transport)
            super().connection_made(GatheringTransport(stream, asyncio.get_running_loop()))

    GatheringProtocol.__name__ = GatheringProtocol.__qualname__ = f"Gathering{base.__name__}"
    return GatheringProtocol, name
