"""The sandbox: a worker that crashes, times out or allocates past its limit is a clean error
for that call alone, and the pool serves the next call."""
from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from pagoda.sandbox import Sandbox, SandboxCrash, SandboxError, SandboxMemoryError, SandboxTimeout


# Run in the worker (imported there by name: the worker's path includes this folder).
def start(greeting: str) -> str:
    return greeting


def echo(state: str, value: int) -> list:
    return [state, value, os.getpid()]


def segfault(state: str) -> None:
    ctypes.string_at(0)


def sleep(state: str, seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def allocate(state: str, mib: int) -> int:
    return len(bytearray(mib << 20))


def recurse(state: str, depth: int) -> int:
    """Recursion through C (``sum``, ``map``): each level takes native stack, as a recursive
    grammar compiler does."""
    sys.setrecursionlimit(10 * depth + 1000)

    def deep(d: int) -> int:
        return 0 if d == 0 else 1 + sum(map(deep, [d - 1]))

    return deep(depth)


def not_json(state: str) -> object:
    return object()


@pytest.fixture(scope="module", autouse=True)
def _workers_find_this_module() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(
            p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p))
        yield


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    box = Sandbox(start, ("hello",), workers=1, timeout=5, memory_mib=256)
    yield box
    box.shutdown()


def test_calls_get_the_workers_state_and_json_results(sandbox: Sandbox) -> None:
    state, value, pid = sandbox.call(echo, 7)
    assert (state, value) == ("hello", 7) and pid != os.getpid() and pid in sandbox.pids()
    with pytest.raises(SandboxError, match="not JSON serializable"):
        sandbox.call(not_json)
    assert sandbox.call(echo, 8)[2] == pid  # an exception in the call keeps the worker


@pytest.mark.parametrize("fn, args, error, message", [
    (segfault, (), SandboxCrash, "SIGSEGV"),
    (sleep, (60,), SandboxTimeout, "longer than 2 s"),
    (allocate, (2048,), SandboxMemoryError, "memory"),
])
def test_a_failing_call_is_a_clean_error_and_the_pool_serves_on(sandbox: Sandbox, fn, args, error,
                                                                 message) -> None:
    before = sandbox.call(echo, 0)[2]
    restarts = sandbox.restarts
    with pytest.raises(error, match=message):
        sandbox.call(fn, *args, timeout=2)
    state, value, pid = sandbox.call(echo, 1)
    assert (state, value) == ("hello", 1)
    if error is SandboxMemoryError:  # Python freed the memory: the same worker serves on
        assert pid == before and sandbox.restarts == restarts
    else:  # the worker is gone and a new one took its place
        assert pid != before and sandbox.restarts == restarts + 1
        with pytest.raises(ProcessLookupError):
            os.kill(before, 0)
    assert sandbox.call(allocate, 64) == 64 << 20  # within the limit


def test_calls_run_on_a_stack_of_the_given_size() -> None:
    """Recursion 20,000 levels deep overflows a 1 MiB stack (the worker crashes) but fits in
    64 MiB: the depth a caller can afford is the sandbox's choice, not the main thread's."""
    small = Sandbox(start, ("x",), timeout=30, stack_mib=1)
    large = Sandbox(start, ("x",), timeout=30, stack_mib=64)
    try:
        with pytest.raises(SandboxCrash, match="SIGSEGV"):
            small.call(recurse, 20_000)
        assert small.call(recurse, 100) == 100
        assert large.call(recurse, 20_000) == 20_000
    finally:
        small.shutdown()
        large.shutdown()


def slow_start(greeting: str) -> str:
    time.sleep(2)
    return greeting


def test_calls_go_to_a_started_worker_while_a_crashed_one_is_replaced() -> None:
    box = Sandbox(slow_start, ("x",), workers=2, timeout=30)
    try:
        box.start()
        pids = {box.call(echo, i)[2] for i in range(4)}
        while len(pids) < 2:  # both workers have answered once
            pids.add(box.call(echo, 0)[2])
        with pytest.raises(SandboxCrash):
            box.call(segfault)
        survivor = box.call(echo, 1)[2]  # not the replacement, which is still starting
        assert survivor in pids and box.restarts == 1
        assert len(box.pids()) == 2
    finally:
        box.shutdown()


def test_the_budget_is_the_calls_whatever_thread_ran_the_last_one() -> None:
    """Each call runs on a new thread; with glibc's per-thread malloc arenas a thread whose
    predecessor had not yet exited reserved an arena of its own (64 MiB of address space, 128
    while making it) beside the predecessor's, and a budget of 256 MiB could not also hold a
    128 MiB allocation (this loop failed every time; the suite's 64 MiB call now and then, on
    a busy machine). The workers keep one arena."""
    box = Sandbox(start, ("x",), workers=1, timeout=30, memory_mib=256)
    try:
        for _ in range(12):
            with pytest.raises(SandboxMemoryError):
                box.call(allocate, 2048)
            assert box.call(allocate, 128) == 128 << 20
    finally:
        box.shutdown()
