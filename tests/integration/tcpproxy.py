"""A TCP proxy on loopback whose connections a test can break: reset, stall, or leave half-open.

    with TcpProxy(redis_port) as proxy:      # clients connect to proxy.url(0) instead of Redis
        proxy.reset_all()                    # every open connection gets an RST, both ends
        proxy.stall()                        # nothing is forwarded either way; sockets stay open
        proxy.restore()                      # ...until now
        proxy.blackhole()                    # open connections go silent for good (half-open)

Each client connection gets its own connection to the upstream server and bytes are passed on as
they come. The proxy runs an asyncio loop on a thread of its own; the controls may be called from
any other thread and return once the fault is in place.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Side(asyncio.Protocol):
    """One socket of a proxied connection: the client's or the upstream server's."""

    def __init__(self, link: _Link, upstream: bool) -> None:
        self.link = link
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.link.proxy.stalled:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.link.forward(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.link.lost(self)


class _Link:
    """A client connection and its upstream connection."""

    def __init__(self, proxy: TcpProxy) -> None:
        self.proxy = proxy
        self.client = _Side(self, upstream=False)
        self.server: _Side | None = None
        self.early: list[bytes] = []  # what the client sent before the upstream connection was up
        self.dead = False  # blackholed: read and dropped both ways, never closed

    def sides(self) -> list[_Side]:
        return [s for s in (self.client, self.server) if s is not None and s.transport is not None]

    def forward(self, source: _Side, data: bytes) -> None:
        if self.dead:
            return
        target = self.client if source.upstream else self.server
        if target is None:
            self.early.append(data)
        elif target.transport is not None:
            target.transport.write(data)

    def attached(self, server: _Side) -> None:
        self.server = server
        if server.transport is not None:
            for data in self.early:
                server.transport.write(data)
        self.early.clear()

    def lost(self, side: _Side) -> None:
        """One end closed: close the other, as a live network path would pass the FIN on; a
        blackholed path passes nothing, so its other end stays open."""
        if self.dead:
            return
        for other in self.sides():
            if other is not side and other.transport is not None:
                other.transport.close()
        self.proxy.links.discard(self)


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``; see the module docstring."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.stalled = False
        self.links: set[_Link] = set()
        self.accepted = 0  # client connections accepted so far
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._closing = False
        self._connecting: set[asyncio.Task[None]] = set()  # upstream connections under way
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcpproxy", daemon=True)

    # --- life ----------------------------------------------------------------------------
    def start(self) -> TcpProxy:
        self._thread.start()
        self._server = self._call(self._serve())
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        """Stop listening and close every connection, blackholed ones too."""
        if not self._thread.is_alive():
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    # --- faults --------------------------------------------------------------------------
    def reset_all(self) -> int:
        """Abort every open connection with an RST to both of its ends (SO_LINGER 0, then close),
        whatever was on the way; returns how many connections there were."""
        return self._call(self._reset_all())

    def stall(self) -> None:
        """Stop forwarding, both ways, on every connection, open or yet to come, until :meth:`restore`.
        Sockets stay open; what is sent meanwhile waits in the kernel's buffers."""
        self._call(self._set_stalled(True))

    def blackhole(self) -> int:
        """Make every open connection silent for good, as when a NAT or firewall drops its state:
        bytes from either end are dropped and neither end is ever closed. New connections work.
        Returns how many connections went silent."""
        return self._call(self._blackhole())

    def restore(self) -> None:
        """End a stall (blackholed connections stay silent: their ends must notice by themselves)."""
        self._call(self._set_stalled(False))

    # --- on the loop ---------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _serve(self) -> asyncio.Server:
        return await self._loop.create_server(self._accept, "127.0.0.1", 0)

    def _accept(self) -> _Side:
        link = _Link(self)
        self.links.add(link)
        self.accepted += 1
        task = self._loop.create_task(self._connect(link))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)
        return link.client

    async def _connect(self, link: _Link) -> None:
        try:
            _, server = await self._loop.create_connection(lambda: _Side(link, upstream=True), *self.upstream)
        except OSError:
            if link.client.transport is not None:
                link.client.transport.close()
            return
        assert isinstance(server, _Side)
        # Reset, the proxy closed, or the client gone (its close had no upstream end to pass on to)
        # while it connected: nothing is left to forward for.
        if link.dead or self._closing or link.client.transport is None:
            if server.transport is not None:
                server.transport.abort()
            return
        link.attached(server)

    async def _reset_all(self) -> int:
        links = list(self.links)
        for link in links:
            link.dead = True  # nothing more is forwarded, and one end's close is not passed on
            for side in link.sides():
                assert side.transport is not None
                sock = side.transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                side.transport.abort()
        self.links.difference_update(links)
        return len(links)

    async def _set_stalled(self, stalled: bool) -> None:
        self.stalled = stalled
        for link in self.links:
            for side in link.sides():
                assert side.transport is not None
                if stalled:
                    side.transport.pause_reading()
                elif not side.transport.is_reading():
                    side.transport.resume_reading()

    async def _blackhole(self) -> int:
        silenced = [link for link in self.links if not link.dead]
        for link in silenced:
            link.dead = True
            for side in link.sides():
                assert side.transport is not None
                if not side.transport.is_reading():
                    side.transport.resume_reading()  # read and drop, so neither end backs up
        return len(silenced)

    async def _close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        # An upstream connection still under way would be left open by the loop's stop: let each
        # finish (it then closes itself) before the links are closed.
        if self._connecting:
            await asyncio.wait(set(self._connecting), timeout=5)
        for link in list(self.links):
            for side in link.sides():
                assert side.transport is not None
                side.transport.abort()
        self.links.clear()
