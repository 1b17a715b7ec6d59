"""Run a command in a private network namespace (tests and benchmarks of the Ray path).

Some Ray components listen on every interface whatever the node address; inside a network
namespace of its own, with only a loopback device, "every interface" is that loopback, so
nothing is reachable from outside. Files are shared as usual, so a Unix socket is the way in:

    python -m pagoda.tools.netns [--uds PATH --port PORT] -- COMMAND...

brings ``lo`` up, runs COMMAND, and (with ``--uds``) relays connections on the Unix socket
PATH to 127.0.0.1:PORT inside the namespace; SIGTERM/SIGINT are passed on to COMMAND and the
exit status is COMMAND's. ``netns_command`` wraps a command in ``unshare`` for this.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from typing import Sequence

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def lo_up() -> None:
    """Bring the loopback device of this network namespace up (a new namespace starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def unshare_prefix() -> list[str]:
    """``unshare`` arguments for a new network namespace: plain as root, else inside a user
    namespace mapping us to root (unprivileged user namespaces). RuntimeError if neither works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("running Ray privately needs util-linux's 'unshare' (a private network namespace)")
    for prefix in ([unshare, "-n"], [unshare, "-r", "-n"]):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    raise RuntimeError("cannot create a private network namespace here ('unshare -n' and 'unshare -rn' both "
                       "failed); Ray would listen on shared interfaces")


def netns_command(command: Sequence[str], uds: str | None = None, port: int | None = None) -> list[str]:
    relay = ["--uds", uds, "--port", str(port)] if uds is not None else []
    return [*unshare_prefix(), sys.executable, "-m", "pagoda.tools.netns", *relay, "--", *command]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _relay(uds: str, port: int, child: subprocess.Popen) -> int:
    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    with contextlib.suppress(FileNotFoundError):
        os.unlink(uds)
    server = await asyncio.start_unix_server(connect, path=uds)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, child.send_signal, sig)
    try:
        while child.poll() is None:
            await asyncio.sleep(0.2)
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(uds)
    return child.returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.tools.netns")
    parser.add_argument("--uds", default=None, help="Unix socket to relay to 127.0.0.1:PORT")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    lo_up()
    child = subprocess.Popen(command)
    if args.uds is not None:
        return asyncio.run(_relay(args.uds, args.port, child))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
