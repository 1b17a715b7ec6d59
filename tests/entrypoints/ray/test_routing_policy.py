"""The scale-out pieces that need no Ray processes: prefix hashing, the prefix index, the
routing policies, the flags and Serve application args, the merged /metrics page, and the
application the builder makes (its deployments' options)."""
from __future__ import annotations

import argparse
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.entrypoints.openai.server import serve_parser
from pagoda.entrypoints.ray.args import ScaleConfig, argv_from_config, uses_ray
from pagoda.entrypoints.ray.metrics_merge import merge_metrics
from pagoda.entrypoints.ray.routing import (PREFIX_BLOCK_CHARS, Policy, PrefixIndex, prefix_hashes,
                                            request_prefix_hashes, token_prefix_hashes)

SYSTEM = "s" * (3 * PREFIX_BLOCK_CHARS)


def test_prefix_hashes_share_exactly_the_shared_full_blocks() -> None:
    a = prefix_hashes(SYSTEM + "question one")
    b = prefix_hashes(SYSTEM + "another question entirely, longer than one block of text to hash.....")
    assert len(a) == 3 and len(b) == 4
    assert a == b[:3]
    assert prefix_hashes("x" + SYSTEM)[0] != a[0]
    assert prefix_hashes("short") == []  # no full block: nothing to route by
    assert token_prefix_hashes(list(range(40)))[:2] == token_prefix_hashes(list(range(32)) + [7] * 8)[:2]
    assert len(token_prefix_hashes(list(range(40)))) == 2


def test_request_prefix_hashes_reads_completions_and_chat_bodies() -> None:
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    other = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "bye"}]}
    h1, h2 = request_prefix_hashes("/v1/chat/completions", chat), request_prefix_hashes("/v1/chat/completions", other)
    assert h1 and h1[:3] == h2[:3]
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]}
    assert request_prefix_hashes("/v1/chat/completions", parts)[:3] == h1[:3]
    assert request_prefix_hashes("/v1/completions", {"prompt": SYSTEM}) == prefix_hashes(SYSTEM)
    assert request_prefix_hashes("/v1/completions", {"prompt": [SYSTEM, "b"]}) == prefix_hashes(SYSTEM)
    assert request_prefix_hashes("/v1/completions", {"prompt": list(range(32))}) == token_prefix_hashes(range(32))
    assert request_prefix_hashes("/v1/completions", {"prompt": 5}) == []
    assert request_prefix_hashes("/v1/completions", ["not", "a", "dict"]) == []


def test_prefix_index_matches_the_longest_live_prefix_and_forgets() -> None:
    index = PrefixIndex(capacity=100)
    a = prefix_hashes(SYSTEM + "x" * PREFIX_BLOCK_CHARS)  # 4 blocks
    index.record(a[:2], "r1")
    index.record(a, "r2")
    assert index.match(a, ["r1", "r2"]) == ("r2", 4)
    assert index.match(a, ["r1"]) == (None, 0)  # r2 took over every block r1 had
    index.record(prefix_hashes(SYSTEM), "r1")
    assert index.match(a, ["r1", "r2"]) == ("r2", 4)
    assert index.match(a, ["r1"]) == ("r1", 3)
    index.forget("r2")
    assert index.match(a, ["r1", "r2"]) == ("r1", 3)
    small = PrefixIndex(capacity=2)
    small.record(a, "r1")
    assert len(small) == 2 and small.match(a, ["r1"]) == (None, 0)  # oldest (first) blocks went
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)


def test_round_robin_cycles_and_least_loaded_takes_the_lightest() -> None:
    rr = Policy("round_robin")
    firsts = [rr.rank(["b", "a", "c"], {})[0][0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    ll = Policy("least_loaded")
    assert ll.rank(["a", "b", "c"], {"a": 3, "b": 1, "c": 2}) == [["b", "c", "a"]]
    ties = {ll.rank(["a", "b"], {})[0][0] for _ in range(4)}
    assert ties == {"a", "b"}  # equal loads rotate
    assert ll.rank([], {}) == []
    with pytest.raises(ValueError, match="unknown routing policy"):
        Policy("random")
    with pytest.raises(ValueError, match="margin"):
        Policy("prefix_affinity", margin=-1)


def test_prefix_affinity_prefers_the_holder_within_the_margin() -> None:
    policy = Policy("prefix_affinity", margin=2)
    hashes = prefix_hashes(SYSTEM)
    first = policy.rank(["a", "b"], {}, hashes)
    assert len(first) == 1  # nobody holds it yet: least loaded
    policy.routed(hashes, "b")
    assert policy.rank(["a", "b"], {"b": 2}, hashes) == [["b"], ["a"]]
    assert policy.affinity_hits == 1
    # b busier than a by more than the margin: a first, b as the last resort.
    assert policy.rank(["a", "b"], {"b": 3}, hashes) == [["a"], ["b"]]
    assert policy.affinity_overflows == 1
    # The holder is gone: plain least loaded among the rest.
    assert policy.rank(["a", "c"], {"a": 1}, hashes) == [["c", "a"]]
    policy.removed("b")
    assert policy.index.match(hashes, ["b"]) == (None, 0)
    # Requests without a prefix, or under round robin, never touch the index.
    rr = Policy("round_robin")
    rr.routed(hashes, "a")
    assert len(rr.index) == 0


def parse(*argv: str) -> argparse.Namespace:
    return serve_parser(raise_errors=True).parse_args(["model", *argv])


def test_scale_flags_choose_fixed_replicas_or_autoscaling() -> None:
    assert not uses_ray(parse())
    # --num-replicas 1 alone is the single server; a cluster address or autoscaling (even with a
    # maximum of one) still means Ray.
    assert not uses_ray(parse("--num-replicas", "1"))
    assert uses_ray(parse("--num-replicas", "2"))
    assert uses_ray(parse("--ray-address", "auto")) and uses_ray(parse("--num-replicas", "1", "--ray-address", "local"))
    assert uses_ray(parse("--max-replicas", "1")) and uses_ray(parse("--min-replicas", "0"))
    assert ScaleConfig.from_args(parse("--num-replicas", "3")) == ScaleConfig(3, None)
    auto = ScaleConfig.from_args(parse("--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "8"))
    assert auto.num_replicas is None
    assert auto.autoscaling == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0,
                                "initial_replicas": 1}
    delayed = ScaleConfig.from_args(parse("--max-replicas", "2", "--autoscaling-upscale-delay", "2",
                                          "--autoscaling-downscale-delay", "60"))
    assert delayed.autoscaling["upscale_delay_s"] == 2.0 and delayed.autoscaling["downscale_delay_s"] == 60.0
    with pytest.raises(ValueError, match="need autoscaling"):
        ScaleConfig.from_args(parse("--num-replicas", "2", "--autoscaling-upscale-delay", "2"))
    with pytest.raises(ValueError, match="not both"):
        ScaleConfig.from_args(parse("--num-replicas", "2", "--max-replicas", "4"))
    with pytest.raises(ValueError, match="at least --min-replicas"):
        ScaleConfig.from_args(parse("--min-replicas", "3", "--max-replicas", "2"))
    for bad in (["--num-replicas", "0"], ["--routing", "random"], ["--target-ongoing-requests", "0"]):
        with pytest.raises(ValueError):
            parse(*bad)


def test_ray_only_flags_on_the_single_server_are_refused() -> None:
    from pagoda.entrypoints.ray.args import check_single_server_args

    check_single_server_args(parse())
    check_single_server_args(parse("--num-replicas", "1"))
    for flags, named in ((["--routing", "round_robin"], "--routing"),
                         (["--pin-replicas-to-cpus"], "--pin-replicas-to-cpus"),
                         (["--replica-num-cpus", "2"], "--replica-num-cpus"),
                         (["--stream-batching-interval-ms", "0"], "--stream-batching-interval-ms"),
                         (["--num-replicas", "1", "--max-ongoing-requests", "4"], "--max-ongoing-requests")):
        with pytest.raises(ValueError, match=named):
            check_single_server_args(parse(*flags))


def test_serve_application_args_become_the_same_flags() -> None:
    parser = serve_parser(raise_errors=True)
    argv = argv_from_config({"model": "/m", "num_replicas": 2, "routing": "round_robin", "enforce-eager": "true",
                             "disable_log_stats": False, "metrics_compat": ["vllm"]}, parser)
    args = parser.parse_args(argv)
    assert (args.model, args.num_replicas, args.routing, args.enforce_eager) == ("/m", 2, "round_robin", True)
    assert args.disable_log_stats is False and args.metrics_compat == ["vllm"]
    assert parser.parse_args(argv_from_config({"enforce_eager": False}, parser)).enforce_eager is False
    with pytest.raises(ValueError, match="unknown pagoda serve option 'num_replica'"):
        argv_from_config({"num_replica": 2}, parser)
    with pytest.raises(ValueError, match="true or false"):
        argv_from_config({"enforce_eager": "maybe"}, parser)


def test_merged_metrics_page_is_valid_prometheus_with_a_replica_label() -> None:
    page = ('# HELP pagoda:prefix_cache_hits_total Hits.\n# TYPE pagoda:prefix_cache_hits_total counter\n'
            'pagoda:prefix_cache_hits_total{model_name="m"} {v}\n'
            '# HELP pagoda:num_requests_waiting Waiting.\n# TYPE pagoda:num_requests_waiting gauge\n'
            'pagoda:num_requests_waiting{model_name="m"} 1.0\n')
    merged = merge_metrics([("r1", page.replace("{v}", "5.0")), ("r2", page.replace("{v}", "7.0"))])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    hits = families["pagoda:prefix_cache_hits"]
    assert {s.labels["replica"]: s.value for s in hits.samples} == {"r1": 5.0, "r2": 7.0}
    assert all(s.labels["model_name"] == "m" for s in hits.samples)
    assert len(families["pagoda:num_requests_waiting"].samples) == 2
    assert merged.count("# TYPE pagoda:num_requests_waiting gauge") == 1


def test_builder_sets_replicas_router_autoscaling_and_health_checks() -> None:
    from pagoda.ray import build_app, build_application

    app = build_app({"model": "/m", "num_replicas": 3, "routing": "least_loaded", "max_num_seqs": 8,
                     "max_queued_requests": 4})
    engine = _engine_deployment(app)
    assert engine.num_replicas == 3
    assert engine.max_ongoing_requests == 12
    router = engine._deployment_config.request_router_config
    assert router.request_router_kwargs == {"policy": "least_loaded", "margin": 8}
    assert router.request_router_class.endswith("PagodaRequestRouter")
    assert engine._deployment_config.health_check_period_s == 2.0
    auto = _engine_deployment(build_application(parse("--min-replicas", "0", "--max-replicas", "5")))
    config = auto._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (0, 5, 16)
    with pytest.raises(ValueError, match="unknown pagoda serve option"):
        build_app({"model": "/m", "replicas": 2})


def test_a_shared_redis_tier_makes_load_decide_and_affinity_break_ties() -> None:
    from pagoda.ray import build_app

    def margin(**config: Any) -> int:
        router = _engine_deployment(build_app({"model": "/m", "num_replicas": 2, **config}))
        return router._deployment_config.request_router_config.request_router_kwargs["margin"]

    assert margin() == 8
    assert margin(kv_offload_redis_url="redis://127.0.0.1:6379/0") == 0
    assert margin(kv_offload_redis_url="redis://127.0.0.1:6379/0", prefix_affinity_margin=3) == 3
    # Margin 0: the holder wins only while it is not busier than the least loaded replica.
    policy = Policy("prefix_affinity", margin=0)
    hashes = ["h1", "h2"]
    policy.routed(hashes, "a")
    assert policy.rank(["a", "b"], {"a": 1, "b": 1}, hashes)[0] == ["a"]
    assert policy.rank(["a", "b"], {"a": 2, "b": 1}, hashes)[0] == ["b"]


def _engine_deployment(app: object) -> object:
    ingress = app._bound_deployment  # type: ignore[attr-defined]
    (engine,) = [a for a in ingress.init_args if hasattr(a, "_bound_deployment")]
    return engine._bound_deployment


def test_serve_refuses_bad_scale_out_flags_before_starting_ray(capsys: pytest.CaptureFixture[str],
                                                               tmp_path) -> None:
    from pagoda.entrypoints.ray.server import run_ray_server

    assert run_ray_server(parse("--num-replicas", "2", "--min-replicas", "1")) == 1
    assert "not both" in capsys.readouterr().err
    args = serve_parser(raise_errors=True).parse_args([str(tmp_path / "missing"), "--num-replicas", "2"])
    assert run_ray_server(args) == 1
    assert "missing" in capsys.readouterr().err


def test_asgi_frames_runs_an_app_in_process_and_tells_it_when_the_reader_leaves() -> None:
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from pagoda.entrypoints.ray.deployments import asgi_frames

    seen: dict[str, Any] = {}

    async def endpoint(request: Request) -> StreamingResponse:
        seen["body"] = await request.body()

        async def events():
            try:
                for i in range(1000):
                    yield f"event {i}\n"
                    await asyncio.sleep(0.001)
            finally:
                seen["disconnected"] = await request.is_disconnected()

        return StreamingResponse(events(), status_code=201, headers={"x-test": "1"})

    app = Starlette(routes=[Route("/s", endpoint, methods=["POST"])])

    async def read(limit: int) -> list[Any]:
        frames = asgi_frames(app, "POST", "/s", "", [("content-type", "text/plain")], b"hello")
        out = []
        async for frame in frames:
            out.append(frame)
            if len(out) == limit:
                break
        await frames.aclose()
        return out

    start, *chunks = asyncio.run(read(4))
    assert start[0] == 201 and ("x-test", "1") in start[1]
    assert seen["body"] == b"hello"
    assert b"".join(chunks).startswith(b"event 0\nevent 1\n")
    assert seen["disconnected"] is True  # closing the frames is the client going away


@pytest.mark.parametrize("interval_s", [0.0, 0.0005, 0.03])
def test_asgi_frames_batches_a_streams_events_and_loses_none(interval_s: float) -> None:
    import asyncio
    import random

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from pagoda.entrypoints.ray.deployments import asgi_frames

    rng = random.Random(0)

    async def endpoint(request: Request) -> StreamingResponse:
        async def events():
            for i in range(60):
                yield f"data: {i}\n\n"
                await asyncio.sleep(rng.choice([0, 0, 0.0002, 0.001, 0.004]))

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/s", endpoint, methods=["POST"])])

    async def read() -> list[Any]:
        return [f async for f in asgi_frames(app, "POST", "/s", "", [], b"", batch_interval_s=interval_s)]

    for _ in range(5 if interval_s else 1):
        (status, _headers), *chunks = asyncio.run(read())
        assert status == 200
        assert b"".join(chunks) == "".join(f"data: {i}\n\n" for i in range(60)).encode()  # all, in order
        assert chunks[0] == b"data: 0\n\n"  # the first event is never held back
        if interval_s >= 0.03:
            assert len(chunks) < 30  # 60 events over ~0.1 s come in a few frames


def test_ingress_guards_its_routes_as_the_single_server_does() -> None:
    """The ingress app (no Ray processes): a wrong key gets 401 and a declared body over the limit
    413, neither reading a byte of the body; a body slower than the deadline gets 408; a large
    invalid body is refused by the sandboxed body check before any route parses it."""
    import asyncio
    import json

    from pagoda.entrypoints.openai.body_check import BodyChecker
    from pagoda.entrypoints.openai.server import CHECKED_BODIES
    from pagoda.entrypoints.ray.deployments import IngressGuard, ingress_app

    def call(headers: dict[str, str], body: bytes | None) -> tuple[int, dict, int]:
        """(status, error, reads of the body) of one POST /v1/completions; ``body`` None: never sent."""
        reads = []

        async def receive() -> dict[str, Any]:
            reads.append(1)
            if body is None:
                await asyncio.sleep(30)
            return {"type": "http.request", "body": body or b"", "more_body": False}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "client": ("10.2.2.2", 1), "server": ("127.0.0.1", 80),
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        asyncio.run(ingress_app(scope, receive, send))
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return status, json.loads(payload)["error"], len(reads)

    checker = BodyChecker(CHECKED_BODIES, min_bytes=16)
    IngressGuard.configure("k", 1000, body_timeout_s=0.5, auth_failure_delay=0.0, checker=checker)
    try:
        status, error, reads = call({"authorization": "Bearer wrong", "content-length": "900"}, b"{}")
        assert (status, error["code"], reads) == (401, "invalid_api_key", 0)
        status, error, reads = call({"authorization": "Bearer k", "content-length": "5000"}, b"{}")
        assert (status, error["code"], reads) == (413, "request_too_large", 0)
        status, error, _ = call({"authorization": "Bearer k", "content-length": "10"}, None)
        assert (status, error["code"]) == (408, "request_timeout")
        invalid = b'{"model": "m", "prompt": 5, "max_tokens": "many"}'
        status, error, _ = call({"authorization": "Bearer k", "content-type": "application/json"}, invalid)
        assert status == 400 and error["param"] in ("prompt", "max_tokens"), error
    finally:
        IngressGuard.options = None
        checker.close()


def _bare_router() -> Any:
    """The Serve router's bookkeeping without a Serve controller (its hooks are plain methods)."""
    from types import SimpleNamespace

    from pagoda.entrypoints.ray.router import PagodaRequestRouter

    router = object.__new__(PagodaRequestRouter)
    router._deployment_id = SimpleNamespace(name="test-router-bookkeeping")
    router.initialize_state()
    return router


def test_router_counts_a_call_whose_completion_arrives_before_its_routed_hook_as_done() -> None:
    """Serve registers the completion callback before it calls ``on_request_routed``; a call that
    ends first must not leave the replica counted busy forever."""
    from types import SimpleNamespace

    router = _bare_router()
    replica = SimpleNamespace(unique_id="r1")

    def pending(rid: str) -> Any:
        return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=rid), kwargs={})

    router.on_request_routed(pending("a"), replica, None)  # the usual order
    assert router.stats()["in_flight"] == {"r1": 1}
    router.on_request_completed(replica, "a")
    router.on_request_completed(replica, "b")  # finished before its routed hook ran
    router.on_request_routed(pending("b"), replica, None)
    assert router.stats()["in_flight"] == {}
    router.on_request_routed(pending("b"), replica, None)  # a retry of the same request counts again
    assert router.stats()["in_flight"] == {"r1": 1}
    router.on_request_completed(replica, "b")
    assert router.stats()["in_flight"] == {}
