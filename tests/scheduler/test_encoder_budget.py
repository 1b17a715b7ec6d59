"""The scheduler's encoder budget (``--max-num-encoder-tokens-per-step``): prompt chunks stop
at the start of an image whose patches do not fit the step's budget, cached images cost
nothing, an image larger than the budget runs alone, decodes run every step, and requests
without images schedule as before. A fake runner: an image becomes cached once a step covers it."""
from __future__ import annotations

from pagoda.config import SchedulerConfig
from pagoda.kvcache.manager import KVCacheManager
from pagoda.multimodal.inputs import ImageInput
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import ModelOutput, SeqStepResult

TOKEN = 7  # the image placeholder id in these prompts


def _scheduler(encoder_tokens: int | None, cached: set[str], budget: int = 64, chunked: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=1024,
                          enable_chunked_prefill=chunked, long_prefill_token_threshold=0, policy="fcfs",
                          max_num_encoder_tokens_per_step=encoder_tokens)
    return Scheduler(cfg, KVCacheManager(128, 4, enable_prefix_caching=False), cached.__contains__)


def _image(digest: str, offset: int, length: int) -> ImageInput:
    patches = 4 * length  # a 2x2 spatial merge: four patches per placeholder token
    return ImageInput(digest, offset, length, (1, 2, 2 * length), (patches, 1), bytes(4 * patches))


def _image_prompt(layout: list) -> tuple[list[int], list[ImageInput]]:
    """``layout``: ints (that many text tokens) and (hash, length) pairs (an image)."""
    ids: list[int] = []
    images = []
    for part in layout:
        if isinstance(part, int):
            ids += [1000 + len(ids) + i for i in range(part)]
        else:
            images.append(_image(part[0], len(ids), part[1]))
            ids += [TOKEN] * part[1]
    return ids, images


def _add(s: Scheduler, rid: str, ids: list[int], images=(), max_tokens: int = 2) -> None:
    s.add_request(Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), (0,),
                          images=list(images)))


def _step(s: Scheduler, cached: set[str]) -> dict[str, tuple[int, int]]:
    """One step with a fake model and runner; returns each request's scheduled ``(start, end)``."""
    out = s.schedule()
    results = ModelOutput()
    for item in out.scheduled:
        for image in item.seq.request.images:
            if image.offset < item.end and item.start < image.end:
                cached.add(image.hash)  # the runner encoded it (or found it) this step
        if item.samples:
            results.results[item.seq.seq_id] = SeqStepResult([item.seq.token_ids[-1] + 1])
    s.update(out, results)
    return {item.seq.request_id: (item.start, item.end) for item in out.scheduled}


def test_prompt_is_split_at_image_starts_while_a_decode_runs():
    cached: set[str] = set()
    s = _scheduler(40, cached)
    _add(s, "text", list(range(4)), max_tokens=50)
    _step(s, cached)  # its prompt; it decodes from now on
    ids, images = _image_prompt([3, ("a", 5), 2, ("b", 5), 2, ("c", 5), 3])  # 20 patches each
    _add(s, "img", ids, images)
    a, b, c = images
    chunks = []
    while "img" in s.requests and s.requests["img"][0].is_prefilling or not chunks:
        steps = _step(s, cached)
        assert steps["text"][1] - steps["text"][0] == 1  # the decode ran this step
        chunks.append(steps["img"])
    # Two images (40 patches) per step: the third one's encoding waits for the next step.
    assert chunks == [(0, c.offset), (c.offset, len(ids))]
    assert cached == {"a", "b", "c"}


def test_cached_images_cost_nothing():
    cached = {"a", "b"}
    s = _scheduler(20, cached)
    ids, images = _image_prompt([3, ("a", 5), 2, ("b", 5), 2, ("c", 5), 2, ("d", 5), 3])
    _add(s, "img", ids, images)
    first = _step(s, cached)["img"]
    assert first == (0, images[3].offset)  # a and b are cached; c takes the 20 patches
    assert _step(s, cached)["img"] == (images[3].offset, len(ids))


def test_the_same_image_twice_in_one_step_is_charged_once():
    cached: set[str] = set()
    s = _scheduler(20, cached)
    for rid in ("x", "y"):
        ids, images = _image_prompt([2, ("5a3e", 5), 2])
        _add(s, rid, ids, images)
    steps = _step(s, cached)
    assert steps["x"] == steps["y"] == (0, 9)


def test_an_image_larger_than_the_budget_runs_alone():
    cached: set[str] = set()
    s = _scheduler(12, cached)
    ids, images = _image_prompt([2, ("b19", 5), 1, ("5a11", 2), 2])  # 20 patches, then 8
    _add(s, "img", ids, images)
    _add(s, "other", *_image_prompt([1, ("0e", 2), 1]))
    steps = _step(s, cached)
    assert steps["img"] == (0, images[1].offset)  # the big one alone: nothing after it fits
    assert steps["other"] == (0, 1)  # its text, up to its image (8 more patches would not fit)
    steps = _step(s, cached)
    assert steps["img"] == (images[1].offset, len(ids))
    assert "other" not in steps  # 8 + 8 > 12
    assert _step(s, cached)["other"] == (1, 4)


def test_cut_inside_an_image_by_the_token_budget_costs_it_once():
    cached: set[str] = set()
    s = _scheduler(20, cached, budget=6)
    ids, images = _image_prompt([2, ("a", 8), 2])  # 32 patches: over the budget, alone
    _add(s, "img", ids, images)
    assert [_step(s, cached)["img"] for _ in range(2)] == [(0, 6), (6, 12)]


def test_text_only_requests_schedule_as_without_a_budget():
    plans = []
    for limit in (None, 1):
        s = _scheduler(limit, set(), budget=16)
        for i in range(3):
            _add(s, f"t{i}", list(range(100 * i, 100 * i + 11)), max_tokens=4)
        plans.append([_step(s, set()) for _ in range(6)])
    assert plans[0] == plans[1]


def test_a_waiting_image_that_does_not_fit_lets_text_requests_start():
    cached: set[str] = set()
    s = _scheduler(20, cached)
    _add(s, "first", *_image_prompt([2, ("a", 5), 1]))
    _add(s, "second", *_image_prompt([("b", 5), 3]))  # begins with an image: 0 tokens this step
    _add(s, "text", list(range(6)))
    steps = _step(s, cached)
    assert steps["first"] == (0, 8) and "second" not in steps
    assert steps["text"] == (0, 6)  # not held up behind "second"
    assert _step(s, cached)["second"] == (0, 8)  # its turn next step, first in the queue


def test_whole_prompts_over_the_budget_run_alone():
    cached: set[str] = set()
    s = _scheduler(24, cached, chunked=False)
    _add(s, "two", *_image_prompt([1, ("a", 4), 1, ("b", 4), 1]))  # 32 patches, one prompt
    _add(s, "one", *_image_prompt([1, ("c", 2), 1]))
    steps = _step(s, cached)
    assert steps["two"] == (0, 11) and "one" not in steps
    assert _step(s, cached)["one"] == (0, 4)
