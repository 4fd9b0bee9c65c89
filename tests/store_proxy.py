"""A TCP proxy in front of a TCPStore that counts what the store's clients send.

Each chunk a client sends is counted once: torch's TCPStore client writes one buffer per request
(its SendBuffer), so the count is the requests, or at most a few more where a large value spans
segments. An upper bound, which is what a traffic budget needs.
"""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["CountingProxy"]


class CountingProxy:
    """Listens on an ephemeral port and forwards every connection to ``port``; :attr:`sent` is
    the number of chunks the clients sent so far."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._target = (host, port)
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self.sent = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if counted:
                    with self._lock:
                        self.sent += 1
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop accepting (open connections end with their peers)."""
        self._closed.set()
        self._listener.close()
