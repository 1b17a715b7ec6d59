"""A utility call whose result does not fit the wire type fails that call alone: the engine core
checks the result before sending it, so the front end's output loop never meets an undecodable
message (which would mark the whole engine dead)."""
from __future__ import annotations

import msgspec

from pagoda.engine.core_proc import EngineCoreProc
from pagoda.engine.messages import CoreOutputMsg, UtilityMsg, UtilityResultMsg


class _Proc:
    """Just what ``EngineCoreProc._utility`` uses, with a chosen result."""

    def __init__(self, value: object) -> None:
        self.value = value
        self.encoder = msgspec.msgpack.Encoder()
        self.result_check = msgspec.msgpack.Decoder(UtilityResultMsg)

    def _call(self, method: str, args: list) -> object:
        return self.value


def _round_trip(value: object) -> UtilityResultMsg:
    out = EngineCoreProc._utility(_Proc(value), UtilityMsg(7, "stats", []))  # type: ignore[arg-type]
    # What the front end does with it: it must decode.
    decoded = msgspec.msgpack.Decoder(CoreOutputMsg).decode(msgspec.msgpack.Encoder().encode(out))
    assert isinstance(decoded, UtilityResultMsg) and decoded.call_id == 7
    return decoded


def test_results_of_the_wire_type_pass_unchanged() -> None:
    stats = {"num_running": 2, "kv_cache_usage": 0.5, "running_lora_adapters": {"sql": 1}, "pid": 9}
    got = _round_trip(stats)
    assert got.error is None and got.result == stats


def test_a_result_outside_the_wire_type_becomes_this_calls_error() -> None:
    got = _round_trip({"nested": [1, 2, 3]})
    assert got.result is None
    assert got.error is not None and got.error.startswith("ValidationError")
