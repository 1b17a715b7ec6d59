"""In-process engine for offline use: front-end processing and the engine core in one loop,
with no HTTP and no IPC."""
from __future__ import annotations

import itertools
import logging
import time

from pagoda.config import EngineArgs, EngineConfig
from pagoda.engine.core import EngineCore
from pagoda.engine.input_processor import InputProcessor, PromptType
from pagoda.engine.messages import AbortRequest, EngineCoreRequest, RequestError
from pagoda.engine.output_processor import OutputProcessor, RequestState
from pagoda.generation_config import log_generation_defaults
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.omp import configure_openmp
from pagoda.outputs import RequestOutput
from pagoda.request import DEFAULT_TENANT
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        configure_openmp()  # the offline entry point (in time if torch has not started yet)
        self.config = EngineConfig.from_args(args)
        log_generation_defaults(self.config.model.generation_defaults)
        self.tokenizer = load_tokenizer(self.config.model.tokenizer)
        self.core = EngineCore(self.config)
        try:
            self.input_processor = InputProcessor(self.config, self.tokenizer)
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            self.core.shutdown()  # its tensor-parallel workers and group must not outlive a failed start
            raise
        self._ids = itertools.count()

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    lora_request: LoRARequest | None = None, tenant: str = DEFAULT_TENANT,
                    cache_salt: str | None = None, priority: int = 0,
                    images: list[ImageInput] | None = None, background: bool = False) -> None:
        """Queue a prompt. ``tenant``: whose share of the engine it runs in; ``cache_salt``: it
        reuses cached prefixes only of requests with the same salt; ``priority``: the priority
        policy's order (lower first); ``background``: the background (batch) class, run only in
        steps with no other request (scheduler/background.py). A prompt dict's ``multi_modal_data`` (vLLM's form) is
        preprocessed here, unless ``images`` gives it preprocessed already (its ids expanded)."""
        text, ids = self.input_processor.tokenize(prompt)
        if images is None:
            ids = self.input_processor.truncate(ids, params, isinstance(prompt, dict) and "multi_modal_data" in prompt)
            ids, images = self.input_processor.prompt_images(prompt, ids)
        self.input_processor.validate(ids, params)
        now = time.time()
        self.output_processor.add_request(request_id, text, ids, params, now)
        try:
            self.core.add_request(EngineCoreRequest(request_id, ids, params, now, lora_request, tenant, cache_salt,
                                                    priority, images=images, background=background))
        except BaseException:
            self.output_processor.requests.pop(request_id, None)  # refused: nothing of it stays
            raise

    def abort_request(self, request_id: str) -> None:
        self.core.abort(AbortRequest(request_id))
        self.output_processor.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step; returns the requests that changed (cumulative outputs), or with
        ``finished_only`` those that finished (what ``LLM.generate`` keeps: a cumulative output
        of every running request every step would copy each one's tokens so far, a step's cost
        growing with the outputs' length). A request the engine failed comes back finished, its
        unfinished samples with finish reason "error"."""
        outs = self.core.step()
        states, aborts = self.output_processor.process(outs.outputs)
        for abort in aborts:
            self.core.abort(abort)
        failed = [s for s in map(self._fail, outs.errors) if s is not None]
        self.last_stats = outs.stats
        failed_ids = {s.request_id for s in failed}
        states = [s for s in states if s.request_id not in failed_ids] + failed
        return [self.output_processor.make_output(s) for s in states if not finished_only or s.finished]

    def _fail(self, error: RequestError) -> RequestState | None:
        logger.error("request %s failed in the engine (status %d): %s", error.request_id, error.status,
                     error.message)
        return self.output_processor.fail(error.request_id)

    def shutdown(self) -> None:
        self.core.shutdown()
        self.input_processor.structured.shutdown()
