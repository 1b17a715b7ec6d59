"""Tenants in the server: per-tenant prefix-cache isolation against a prefix-guessing attacker,
``cache_salt``, and the cap on ``n x max_tokens``."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
from starlette.requests import Request

from pagoda.engine.messages import SchedulerStats
from pagoda.entrypoints.openai.metrics import ServerMetrics
from pagoda.entrypoints.openai.tenants import TenantPolicy
from pagoda.request import DEFAULT_TENANT
from server_helpers import ServerProcess, start_server

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
PUBLIC = list(range(100, 100 + BLOCK))  # a block every user's prompt starts with
SECRET = list(range(200, 200 + BLOCK))  # the victim's secret: one block
WRONG = list(range(300, 300 + BLOCK))
TAIL = [400, 401, 402, 403]
CAP = 2048


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(llama_dir, tmp_path_factory.mktemp("tenant-logs"), "--tenant-id-source", "header",
                       "--tenant-cache-isolation", "--max-request-output-tokens", str(CAP))
    yield srv
    srv.stop()


def cached(server: ServerProcess, prompt: list[int], tenant: str, **extra) -> int:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, headers={"X-Tenant-Id": tenant}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def hits(server: ServerProcess) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("pagoda:prefix_cache_hits_total"))
    return float(line.rsplit(" ", 1)[1])


def guess(server: ServerProcess, attacker: str, victim: str) -> dict[str, tuple[int, float]]:
    """The victim sends its secret; the attacker caches the public block itself, then tries a
    wrong and the right secret block: cached tokens and hit-counter growth of each guess."""
    cached(server, PUBLIC + SECRET + TAIL, victim)
    cached(server, PUBLIC + [7] * BLOCK + TAIL, attacker)
    seen = {}
    for name, block in (("wrong", WRONG), ("right", SECRET)):
        before = hits(server)
        seen[name] = (cached(server, PUBLIC + block + TAIL, attacker), hits(server) - before)
    return seen


def test_prefix_guessing_tells_right_from_wrong_within_one_tenant(server):
    # The attack works where the cache is shared (attacker and victim are one tenant): this is
    # what the isolation test below must not see.
    seen = guess(server, attacker="team-1", victim="team-1")
    assert seen["right"] == (2 * BLOCK, 2 * BLOCK) and seen["wrong"] == (BLOCK, BLOCK)


def test_isolated_tenants_cannot_tell_right_from_wrong(server):
    seen = guess(server, attacker="mallory", victim="alice")
    assert seen["right"] == seen["wrong"] == (BLOCK, BLOCK)  # only the attacker's own public block


def test_cache_salt_separates_caches_within_a_tenant(server):
    prompt = list(range(20, 20 + 2 * BLOCK)) + TAIL
    assert cached(server, prompt, "salty", cache_salt="one") == 0
    assert cached(server, prompt, "salty", cache_salt="one") == 2 * BLOCK
    assert cached(server, prompt, "salty", cache_salt="two") == 0
    assert cached(server, prompt, "salty") == 0  # no salt: another cache again
    chat = {"messages": [{"role": "user", "content": "hello there, how are you today my friend?"}],
            "max_tokens": 1, "cache_salt": "three"}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 200, resp.text


def test_a_lone_surrogate_in_the_salt_is_a_400(server):
    body = '{"prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": "s\\ud800"}'
    resp = httpx.post(server.base_url + "/v1/completions", content=body, timeout=60,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text


@pytest.mark.parametrize("field", [{"cache_salt": ""}, {"cache_salt": 5}, {"n": 8, "max_tokens": CAP // 8 + 1}])
def test_bad_salts_and_too_many_output_tokens_are_400(server, field):
    body = {"prompt": [1, 2, 3], "max_tokens": 1, **field}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == ("max_tokens" if "n" in field else "cache_salt")


def test_n_times_max_tokens_within_the_cap_runs(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "n": 8, "ignore_eos": True}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 8


def _raw(**headers: str) -> Request:
    pairs = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "headers": pairs})


def test_tenant_sources():
    key = TenantPolicy("api-key")
    alice = key.tenant(_raw(authorization="Bearer k-alice"), None)
    bob = key.tenant(_raw(authorization="Bearer k-bob"), None)
    assert alice.startswith("key-") and alice != bob and "k-alice" not in alice  # a digest, never the key
    assert key.tenant(_raw(), "someone") == DEFAULT_TENANT
    assert TenantPolicy("user").tenant(_raw(authorization="Bearer x"), "u1") == "u1"
    assert TenantPolicy("user").tenant(_raw(), None) == DEFAULT_TENANT
    header = TenantPolicy("header", "X-Org")
    assert header.tenant(_raw(x_org="acme"), "u1") == "acme"
    assert header.tenant(_raw(x_tenant_id="acme"), "u1") == DEFAULT_TENANT
    assert TenantPolicy("none").tenant(_raw(authorization="Bearer x"), "u1") == DEFAULT_TENANT
    assert TenantPolicy("user").tenant(_raw(), "a\ud800").startswith("sha-")  # not valid UTF-8
    long_id = TenantPolicy("user").tenant(_raw(), "u" * 500)
    assert len(long_id) <= 64 and long_id != TenantPolicy("user").tenant(_raw(), "u" * 499 + "v")


def test_isolation_salts_differ_per_tenant_and_keep_the_request_salt():
    shared, isolated = TenantPolicy(), TenantPolicy(cache_isolation=True)
    assert shared.cache_salt("a", None) is None
    assert shared.cache_salt("a", "s") == shared.cache_salt("b", "s") != shared.cache_salt("a", "t")
    assert shared.cache_salt("a", "s\ud800").isascii()  # a lone surrogate crosses as a digest
    salts = {isolated.cache_salt(t, s) for t in ("a", "b") for s in (None, "s", "t")}
    assert len(salts) == 6 and None not in salts
    # A client's salt cannot reproduce another tenant's: the tenant is part of what is hashed.
    assert isolated.cache_salt("a", "b") != isolated.cache_salt("a:b", None)


def test_tenant_gauges_follow_engine_stats():
    metrics = ServerMetrics("m")
    metrics.on_engine_stats(SchedulerStats(tenant_requests={"a": 3, "other": 2}, tenant_running_seqs={"a": 5}))
    text = metrics.render()[0].decode()
    assert 'pagoda:tenant_requests{model_name="m",tenant="a"} 3.0' in text
    assert 'pagoda:tenant_requests{model_name="m",tenant="other"} 2.0' in text
    assert 'pagoda:tenant_running_seqs{model_name="m",tenant="a"} 5.0' in text
    metrics.on_engine_stats(SchedulerStats())  # one tenant again: the series go away
    assert "tenant=" not in metrics.render()[0].decode()


def test_guess_bench_cannot_tell_right_from_wrong(server, tmp_path):
    import json

    from pagoda.entrypoints.cli import build_parser

    out = tmp_path / "guess.json"
    args = build_parser().parse_args(["bench", "stress", "guess", "--base-url", server.base_url, "--probes", "2",
                                      "--vocab-size", "500", "--out", str(out)])
    code = args.func(args)
    result = json.loads(out.read_text())
    assert all(r["right"] == r["wrong"] == [BLOCK, BLOCK] for r in result["rounds"]), result["rounds"]
    assert code == 0 and result["passed"]
