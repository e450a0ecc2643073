"""A TCP proxy for fault tests: it forwards a port to a server until ``cut()``, which drops every
live connection and refuses new ones (as a network split or a restarting server would), until
``restore()``."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tests.processes import free_port

_CHUNK = 64 * 1024


class TcpProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, name=f"proxy :{self.port}", daemon=True).start()

    def cut(self) -> None:
        """Drop every connection at once; new ones are closed as soon as they are accepted (the
        listener stays bound, so no other process can take the port meanwhile)."""
        with self._lock:
            self._cut.set()
            for sock in self._sockets:
                _close(sock)
            self._sockets.clear()

    def restore(self) -> None:
        self._cut.clear()

    def close(self) -> None:
        self._stopped.set()
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self._cut.is_set():
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:  # a cut while this connection was being made drops it too
                if self._cut.is_set():
                    _close(client)
                    _close(upstream)
                    continue
                self._sockets.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(_CHUNK):
                sink.sendall(data)
        except OSError:
            pass  # cut, or the other side went away
        finally:
            with self._lock:
                self._sockets.discard(source)
                self._sockets.discard(sink)
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    # shutdown first: it wakes a thread blocked in recv() on the socket, which close() alone may not.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@contextmanager
def tcp_proxy(target_host: str, target_port: int) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port)
    try:
        yield proxy
    finally:
        proxy.close()
