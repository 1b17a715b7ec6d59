"""Where an offline run's time goes, step by step (``pagoda bench gpu``'s throughput stage).

``StepProfile`` wraps an ``LLM``'s ``LLMEngine.step`` and records each call's wall time with the
step's scheduler figures (tokens run, prompt tokens among them, the share of KV blocks in use):
nothing is added to the step but the wrapper. ``summary`` splits the run into steps that ran
prompt tokens and decode-only steps, the latter by batch size, each with its memory roofline:
a decode-only step must read every weight once and each running sequence's context, so at best
it takes ``(weight bytes + KV cache bytes in use) / bandwidth`` (the context counted in whole
blocks, as the cache holds it; with prefix caching off, as the benchmark runs, every block in
use is a running sequence's).

With async scheduling a call returns the step before the one it submits; the figures pair each
call's time with the step it returned, which over a run's thousands of steps is the same split.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# Decode-only steps are reported in these batch-size bands (the last is open-ended).
BANDS = (1, 8, 32, 128, 256)


@dataclass
class StepRecord:
    seconds: float
    tokens: int  # tokens the step ran (prompt and decode)
    prompt_tokens: int
    kv_usage: float  # share of the KV cache's blocks in use after the step


class StepProfile:
    """Times every ``engine.step`` of ``llm`` from construction to ``close()``."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.engine
        self.records: list[StepRecord] = []
        self._step = self.engine.step
        self.engine.step = self._timed_step

    def _timed_step(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        outputs = self._step(*args, **kwargs)
        seconds = time.perf_counter() - start
        stats = self.engine.last_stats
        if stats is not None:
            self.records.append(StepRecord(seconds, stats.step_tokens, stats.step_prefill_tokens,
                                           stats.kv_cache_usage))
        return outputs

    def close(self) -> None:
        self.engine.step = self._step

    def summary(self, weight_bytes: int, kv_cache_bytes: int, bandwidth: float) -> dict[str, Any]:
        """The run's steps: all, those with prompt tokens, decode-only ones (in ``BANDS``), each
        with count, seconds, tokens and mean ms a step; decode-only ones also with tok/s and the
        share of their memory roofline (``roofline_fraction``). ``kv_cache_bytes``: the whole
        cache's."""
        prompt = [r for r in self.records if r.prompt_tokens]
        decode = [r for r in self.records if not r.prompt_tokens and r.tokens]
        out: dict[str, Any] = {"all": _group(self.records), "with_prompt_tokens": _group(prompt),
                               "decode_only": _decode_group(decode, weight_bytes, kv_cache_bytes, bandwidth)}
        out["with_prompt_tokens"]["prompt_tokens"] = sum(r.prompt_tokens for r in prompt)
        bands: dict[str, Any] = {}
        for lo, hi in zip(BANDS, BANDS[1:] + (None,)):
            members = [r for r in decode if r.tokens >= lo and (hi is None or r.tokens < hi)]
            if members:
                bands[f"{lo}+" if hi is None else f"{lo}-{hi - 1}"] = _decode_group(
                    members, weight_bytes, kv_cache_bytes, bandwidth)
        out["decode_only_by_batch"] = bands
        return out


def _group(records: list[StepRecord]) -> dict[str, Any]:
    seconds = sum(r.seconds for r in records)
    return {"steps": len(records), "seconds": seconds, "tokens": sum(r.tokens for r in records),
            "mean_ms": 1000 * seconds / len(records) if records else 0.0}


def _decode_group(records: list[StepRecord], weight_bytes: int, kv_cache_bytes: int,
                  bandwidth: float) -> dict[str, Any]:
    out = _group(records)
    if not records:
        return out
    ideal = sum(weight_bytes + r.kv_usage * kv_cache_bytes for r in records) / bandwidth
    out.update(mean_batch=out["tokens"] / len(records), tokens_per_s=out["tokens"] / max(out["seconds"], 1e-12),
               roofline_s=ideal, roofline_fraction=ideal / max(out["seconds"], 1e-12))
    return out


def describe(summary: dict[str, Any]) -> str:
    """One line: the share of time in steps with prompt tokens, and decode-only steps' count,
    mean batch, mean step time and roofline share."""
    total = summary["all"]["seconds"] or 1e-12
    prompt, decode = summary["with_prompt_tokens"], summary["decode_only"]
    text = (f"steps with prompt tokens {prompt['seconds'] / total:.0%} of the time ({prompt['steps']} steps); "
            f"decode-only {decode['seconds'] / total:.0%}")
    if decode["steps"]:
        text += (f" ({decode['steps']} steps, mean batch {decode['mean_batch']:.0f}, {decode['mean_ms']:.2f} ms a "
                 f"step, {decode['roofline_fraction']:.2f} of the roofline)")
    return text
