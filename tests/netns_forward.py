"""A TCP forwarder: ``python netns_forward.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT``.

Run by tests/netns.py inside the bucket's namespace: SeaweedFS serves on that namespace's loopback,
and this makes it reachable on the namespace's bridge address. One thread pair per connection;
a side that closes closes the other. Ends with its namespace (the cluster kills every process in it).
"""

from __future__ import annotations

import socket
import sys
import threading


def pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main(listen_host: str, listen_port: str, target_host: str, target_port: str) -> None:
    server = socket.create_server((listen_host, int(listen_port)), reuse_port=False, backlog=256)
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection((target_host, int(target_port)), timeout=10)
        except OSError:
            client.close()
            continue
        upstream.settimeout(None)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    main(*sys.argv[1:])
