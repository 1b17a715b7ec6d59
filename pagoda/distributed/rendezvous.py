"""Where the ranks of one pagoda instance meet: a fresh port per instance, on loopback unless a
multi-node address is given, so several instances on one machine never collide."""
from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on ``host``. The tiny window before the rendezvous binds it is
    the usual price of letting the OS choose."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tcp_init_method(host: str) -> str:
    """``tcp://HOST:PORT`` with a port nobody else on ``host`` uses right now."""
    port = free_port(host)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def init_method_host(init_method: str) -> str:
    return urlparse(init_method).hostname or ""


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS


def pin_to_loopback() -> None:
    """Make gloo's and NCCL's own sockets use the loopback interface too. Set in the engine
    process before workers are spawned, so the workers inherit it."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
