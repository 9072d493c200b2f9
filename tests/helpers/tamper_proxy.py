"""A TCP proxy on loopback that damages what it relays: it stands for a faulty network path
(a bad NIC, memory or middlebox corrupting bytes past TCP's own checksum, which netem's
`corrupt` cannot do: TCP drops and resends those packets)."""

from __future__ import annotations

import contextlib
import socket
import threading


class TamperProxy:
    """Forwards `host`:`port` to `upstream_host`:`upstream`. While `corrupt` is set, one byte
    of each reply past `offset` is flipped (for a KV pull: inside the payload's body)."""

    def __init__(
        self,
        upstream: int,
        offset: int = 100_000,
        host: str = "127.0.0.1",
        port: int = 0,
        upstream_host: str = "127.0.0.1",
    ) -> None:
        self.upstream, self.offset, self.upstream_host = upstream, offset, upstream_host
        self.corrupt = threading.Event()
        self.damaged = 0  # replies it flipped a byte of
        self.relayed = 0  # connections it carried
        self._sock = socket.create_server((host, port))
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection((self.upstream_host, self.upstream), timeout=10)
                up.settimeout(None)
            except OSError:
                client.close()
                continue
            self.relayed += 1
            threading.Thread(target=self._pump, args=(client, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        seen, flipped = 0, False
        try:
            while data := src.recv(65536):
                if (
                    reply
                    and self.corrupt.is_set()
                    and not flipped
                    and seen + len(data) > self.offset
                ):
                    i = max(self.offset - seen, 0)
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
                    flipped = True
                    self.damaged += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


if __name__ == "__main__":  # a relay in a process of its own (a network namespace's end)
    import sys
    import time

    listen_host, listen_port, up_host, up_port = sys.argv[1:5]
    TamperProxy(int(up_port), host=listen_host, port=int(listen_port), upstream_host=up_host)
    print("relaying", flush=True)
    while True:
        time.sleep(3600)
