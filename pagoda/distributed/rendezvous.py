"""Where the ranks of one pagoda instance meet: a fresh port per instance, on loopback unless a
multi-node address is given, so several instances on one machine never collide."""
from __future__ import annotations

import datetime
import os
import socket
from urllib.parse import urlparse

import torch.distributed as dist

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


def init_method_port(init_method: str) -> int:
    port = urlparse(init_method).port
    if port is None:
        raise ValueError(f"rendezvous address {init_method!r} has no port")
    return port


def open_store(init_method: str, is_master: bool, timeout: datetime.timedelta) -> "dist.TCPStore":
    """The key-value store the ranks meet in. Rank 0 hosts it and listens on the rendezvous host
    only (torch's own server would listen on every interface); the others connect to it, waiting
    up to ``timeout`` for it to appear."""
    host, port = init_method_host(init_method), init_method_port(init_method)
    if not is_master:
        return dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        # The store server takes over the listening socket (it closes its own copy).
        return dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False,
                             master_listen_fd=os.dup(sock.fileno()))
    except OSError as exc:
        raise OSError(f"cannot listen for the other ranks on {host}:{port}: {exc}") from exc
    finally:
        sock.close()
