"""The batch runner's parts without a model: the gate that keeps batch lines behind
interactive requests, the one place the batch priority is named, line parsing, and the
storage directory's lock and results log."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pagoda.entrypoints.openai.batch import runner
from pagoda.entrypoints.openai.batch.runner import BatchGate, batch_priority, line_body
from pagoda.entrypoints.openai.batch.service import parse_line
from pagoda.entrypoints.openai.batch.storage import BatchStorage, StorageInUseError


def fake_engine(max_num_seqs: int = 4) -> SimpleNamespace:
    return SimpleNamespace(output_processor=SimpleNamespace(requests={}), last_stats=None,
                           config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs)))


def test_gate_caps_lines_and_waits_for_a_free_slot_and_an_empty_queue() -> None:
    async def main() -> None:
        engine = fake_engine(max_num_seqs=3)
        gate = BatchGate(engine, cap=2)
        await gate.acquire()
        await gate.acquire()
        third = asyncio.ensure_future(gate.acquire())
        await asyncio.sleep(0.1)
        assert not third.done()  # the cap
        gate.release()
        await asyncio.wait_for(third, 1)
        gate.release()
        engine.output_processor.requests = {str(i): None for i in range(3)}  # every slot taken
        blocked = asyncio.ensure_future(gate.acquire())
        await asyncio.sleep(0.1)
        assert not blocked.done()
        engine.output_processor.requests = {"0": None}
        engine.last_stats = SimpleNamespace(num_waiting=1)  # an interactive request waits
        await asyncio.sleep(0.1)
        assert not blocked.done()
        engine.last_stats = SimpleNamespace(num_waiting=0)
        await asyncio.wait_for(blocked, 1)
        gate.release()
        # Stale stats that said someone waits do not block an idle engine.
        engine.output_processor.requests, engine.last_stats = {}, SimpleNamespace(num_waiting=2)
        await asyncio.wait_for(gate.acquire(), 1)
        assert gate.active == 2

    asyncio.run(main())


def test_the_batch_priority_is_sent_only_under_the_priority_policy() -> None:
    from pagoda.scheduler.priority import BATCH_PRIORITY

    body = {"model": "m", "prompt": "x", "priority": -5}
    assert batch_priority("fcfs") is None and batch_priority("lpm") is None
    assert batch_priority("priority") == BATCH_PRIORITY > 0
    assert json.loads(line_body(body, None)) == body
    assert json.loads(line_body(body, 100)) == {**body, "priority": 100}  # a line cannot jump the queue
    assert body["priority"] == -5  # the line itself is unchanged


@pytest.mark.parametrize(("text", "code"), [("[1]", "invalid_json_line"), ("{", "invalid_json_line"),
                                            ('{"body": {}}', "missing_required_parameter"),
                                            ('{"custom_id": "a", "body": 3}', "missing_required_parameter")])
def test_unusable_lines(text: str, code: str) -> None:
    line, error = parse_line(4, text)
    assert line is None and error.code == code and error.line == 5


def test_a_line() -> None:
    line, error = parse_line(0, '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"n": 1}}')
    assert error is None and (line.custom_id, line.method, line.url, line.body) == ("a", "POST", "/v1/completions",
                                                                                    {"n": 1})


def test_storage_is_owned_by_one_server_and_keeps_finished_lines(tmp_path) -> None:
    first = BatchStorage(tmp_path / "store")
    with pytest.raises(StorageInUseError):
        BatchStorage(tmp_path / "store")
    first.append_result("batch_x", 3, {"custom_id": "a"})
    with open(first.results_path("batch_x"), "a") as out:
        out.write('{"line": 4, "resu')  # a crash in the middle of a write
    assert first.load_results("batch_x") == {3: {"custom_id": "a"}}
    first.close()
    BatchStorage(tmp_path / "store").close()  # free again once the owner closed it
    temporary = BatchStorage(None)
    assert temporary.root.exists()
    temporary.close()
    assert not temporary.root.exists()


def test_every_line_reaches_the_app_in_the_background_class_and_tag_reads_it() -> None:
    from pagoda.engine.async_engine import PromptInput
    from pagoda.entrypoints.openai.serving_common import BACKGROUND_SCOPE_KEY, Serving
    from pagoda.sampling_params import SamplingParams

    scopes = []

    async def app(scope, receive, send) -> None:
        scopes.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    response = asyncio.run(runner.call_app(app, "/v1/completions", b"{}", [], {"x": 1}, asyncio.Event()))
    assert response.status == 200 and scopes[0][BACKGROUND_SCOPE_KEY] is True and scopes[0]["x"] == 1

    serving = Serving.__new__(Serving)  # tag reads only the engine's policy, tracer and the tenant policy
    from pagoda.entrypoints.openai.tenants import TenantPolicy
    serving.tenants = TenantPolicy()
    serving.engine = SimpleNamespace(config=SimpleNamespace(scheduler=SimpleNamespace(policy="fcfs")), tracer=None)
    req = SimpleNamespace(user=None, cache_salt=None, priority=0, timeout=None)
    for scope, expected in (({}, False), ({BACKGROUND_SCOPE_KEY: True}, True)):
        prompt = PromptInput("x", [1], SamplingParams())
        serving.tag([prompt], req, SimpleNamespace(scope=scope, headers={}))  # type: ignore[arg-type]
        assert prompt.background is expected
