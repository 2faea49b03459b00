"""A free TCP port for a rendezvous (MASTER_PORT), so concurrent test jobs do not collide."""
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
