"""A TCP relay in a background thread: `PortForwarder(host, port, target_port)` listens on
host:port and forwards every connection, byte for byte in both directions, to 127.0.0.1:target_port.

`scripts/serve_cluster.sh` puts one in front of smg so that its --port is bound only once smg
counts every worker healthy: smg itself listens (and answers /health) as soon as it starts, and
answers `404 model_not_found` until its workers register. Bytes pass unchanged, so HTTP keep-alive,
streaming responses and smg's headers (`x-smg-routed-worker-id`) work as they do on smg's own port.
"""

from __future__ import annotations

import asyncio
import socket
import threading

CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy reader to writer until EOF, then half-close writer; on an error close writer, which
    ends the other direction too."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):  # reset, broken pipe, or a transport already closing
        writer.close()


class PortForwarder:
    def __init__(self, host: str, port: int, target_port: int):
        """Bind host:port now (OSError if it is taken) and start relaying to 127.0.0.1:target_port."""
        self.target_port = target_port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()  # of the open connections, both sides
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"forward-{port}-to-{target_port}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def _relay(self, client_reader, client_writer) -> None:
        self._writers.add(client_writer)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            self._writers.discard(client_writer)
            return
        self._writers.add(upstream_writer)
        try:
            await asyncio.gather(_pipe(client_reader, upstream_writer), _pipe(upstream_reader, client_writer))
        finally:
            for writer in (upstream_writer, client_writer):
                writer.close()
                self._writers.discard(writer)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            server = self._loop.run_until_complete(asyncio.start_server(self._relay, sock=self._sock))
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._error = e
            self._sock.close()
            self._started.set()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()  # the listening socket: no new connections from here on
            for writer in list(self._writers):  # open connections end: their relays see EOF and return
                writer.transport.abort()
            tasks = asyncio.all_tasks(self._loop)
            if tasks:
                self._loop.run_until_complete(asyncio.wait(tasks, timeout=5))
            self._loop.close()

    def close(self) -> None:
        """Stop accepting and stop relaying (open connections are dropped)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
