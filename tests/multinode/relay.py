"""TCP relays between network namespaces, so a scheduler on the host's loopback and agents in
node namespaces can talk while the nodes' own traffic stays on their veth links.

A socket belongs to the namespace its creating thread was in: a short-lived thread enters a
namespace (`setns`, through libc: Python 3.11 has no `os.setns`), creates the socket there and
ends; the socket keeps working from any thread. Test infrastructure only (root).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(netns: str | None, make: Callable[[], T]) -> T:
    """`make()` run by a thread inside network namespace `netns` (None: the host's)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            if netns is not None:
                fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
                try:
                    if _libc.setns(fd, CLONE_NEWNET) != 0:
                        errno = ctypes.get_errno()
                        raise OSError(errno, f"setns {netns}: {os.strerror(errno)}")
                finally:
                    os.close(fd)
            result.append(make())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class Relay:
    """Accepts on 127.0.0.1:`port` in `listen_ns` and forwards each connection to
    127.0.0.1:`target_port` in `target_ns` (None: the host's namespace)."""

    def __init__(
        self, listen_ns: str | None, port: int, target_ns: str | None, target_port: int
    ) -> None:
        self.target_ns, self.target_port = target_ns, target_port
        self._server = in_netns(listen_ns, lambda: socket.create_server(("127.0.0.1", port)))
        self.port: int = self._server.getsockname()[1]
        self._open: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="h3-relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = in_netns(
                self.target_ns,
                lambda: socket.create_connection(("127.0.0.1", self.target_port), timeout=10),
            )
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        self._open += [client, upstream]
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)

    def close(self) -> None:
        """Stop accepting and cut every relayed connection."""
        self._server.close()
        for sock in self._open:
            with contextlib.suppress(OSError):
                sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
