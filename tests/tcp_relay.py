"""ssh ProxyCommand: relay stdin/stdout to a TCP port (``tcp_relay.py HOST PORT``).

Lets `ray up` reach a test sshd on a free port: Ray's local provider always connects to the
default SSH port of head_ip, unless a ProxyCommand says otherwise."""

import os
import selectors
import socket
import sys


def main() -> None:
    sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.buffer.raw, selectors.EVENT_READ, "in")
    sel.register(sock, selectors.EVENT_READ, "sock")
    while True:
        for key, _ in sel.select():
            if key.data == "in":
                data = os.read(sys.stdin.fileno(), 65536)
                if not data:
                    sock.shutdown(socket.SHUT_WR)
                    sel.unregister(sys.stdin.buffer.raw)
                    continue
                sock.sendall(data)
            else:
                data = sock.recv(65536)
                if not data:
                    return
                while data:
                    data = data[os.write(sys.stdout.fileno(), data) :]


if __name__ == "__main__":
    main()
