"""A TCP proxy on loopback in front of a server (the S3 server), which a test can cut and restore:
an object store that goes away and comes back, while the server and its data stay.

``cut()`` closes the listening socket and every connection through it (a client then gets
"connection refused", as from a store that is down); ``hang()`` cuts the connections but
accepts new ones and never answers them (a store that hangs); ``silence()`` keeps every
connection open and drops what passes both ways, and accepts new ones and never answers them
(a partition that drops packets: nothing refuses, nothing answers); ``restore()`` listens again
on the same port. It runs on threads of the test process; the clients are other processes (``ddptrain
train``), started with Popen's default ``close_fds``, so none holds the listening socket.
"""

from __future__ import annotations

import socket
import threading

from ddptrain import free_port


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.target, self.port = host, target_port, free_port()
        self.listener: socket.socket | None = None
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.hung: list[socket.socket] = []  # connections accepted while hanging, never answered
        self.silent = False  # silence(): what passes is dropped

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> TcpProxy:
        self._listen(self._accept)
        return self

    def _listen(self, serve) -> None:
        """Listen on the proxy's port again; ``serve(listener)`` on a thread of its own."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=serve, args=(listener,), daemon=True).start()

    def restore(self) -> TcpProxy:
        self.cut()
        self.silent = False
        return self.start()

    def silence(self) -> None:
        """The connections stay open and their bytes are dropped; new ones are accepted, never answered."""
        self.silent = True
        with self.lock:
            listener, self.listener = self.listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        self._listen(self._swallow)

    def hang(self) -> None:
        self.cut()
        self._listen(self._swallow)

    def _swallow(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            self.hung.append(client)

    def cut(self) -> None:
        with self.lock:
            listener, self.listener = self.listener, None
            connections, self.connections = self.connections, set()
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept(): the port is free at once
            except OSError:
                pass
            listener.close()
        hung, self.hung = self.hung, []
        for connection in [*connections, *hung]:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            connection.close()

    close = cut

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut
                return
            try:
                server = socket.create_connection((self.host, self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                if self.listener is not listener:  # cut meanwhile
                    client.close()
                    server.close()
                    return
                self.connections |= {client, server}
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self.silent:
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self.lock:
                self.connections -= {source, sink}
            source.close()  # the other direction's thread, woken by the shutdown, closes its own
