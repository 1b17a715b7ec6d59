"""``pagoda serve --num-replicas N`` as a subprocess inside a private network namespace
(``pagoda.tools.netns``): Ray listens only on that namespace's loopback, and the test reaches
the endpoint through a Unix socket relayed to it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from pagoda.tools.netns import netns_command

INNER_PORT = 8000  # inside the namespace: nothing else listens there
STARTUP_TIMEOUT_S = 240.0


class RayServer:
    def __init__(self, model_dir: Path, log_dir: Path, *extra: str, api_key: str | None = None,
                 set_env: dict[str, str] | None = None) -> None:
        self.api_key = api_key
        self.uds = str(log_dir / "endpoint.sock")
        self.log_path = log_dir / "ray-server.log"
        command = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", str(model_dir), "--port",
                   str(INNER_PORT), *extra, *(["--api-key", api_key] if api_key else [])]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(netns_command(command, uds=self.uds, port=INNER_PORT), stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **(set_env or {})})
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), base_url="http://pagoda", timeout=120,
                                 headers=self.headers)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]

    def openai(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://pagoda/v1", api_key=self.api_key or "unused", http_client=self.http,
                             max_retries=0, **kw)

    def async_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.uds), base_url="http://pagoda",
                                 timeout=120, headers=self.headers)

    def health(self) -> dict[str, Any] | None:
        try:
            response = self.http.get("/health", timeout=30)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def wait_healthy(self, replicas: int, timeout: float = STARTUP_TIMEOUT_S,
                     exclude: set[str] = frozenset()) -> dict[str, Any]:
        """Wait until ``replicas`` replicas (none of ``exclude``) report healthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            health = self.health()
            if health is not None:
                good = [r for r in health["replicas"] if r["healthy"] and r["replica"] not in exclude]
                if len(good) == replicas and len(health["replicas"]) == replicas:
                    return health
            time.sleep(0.5)
        raise RuntimeError(f"not {replicas} healthy replicas after {timeout} s: {self.health()}\n{self.log()}")

    def replica_metric(self, name: str) -> dict[str, float]:
        """Per replica, the sum of the samples of metric ``name`` in the merged /metrics."""
        text = self.http.get("/metrics").text
        totals: dict[str, float] = {}
        for m in re.finditer(rf'^{re.escape(name)}{{replica="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(2))
        return totals

    def stop(self) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
