"""``LLM``: offline batch generation, vLLM-shaped."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Iterable, Sequence

from jinja2 import TemplateError
from tqdm import tqdm

from pagoda.config import EngineArgs
from pagoda.engine.input_processor import PromptType, chat_template_args
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.vllm_flags import ignore_vllm_kwargs
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.chat_parts import ImageRef, check_image_count, split_images
from pagoda.multimodal.media import load_images_sync
from pagoda.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagoda.pooling import finish_embedding
from pagoda.sampling_params import ParamError, SamplingParams, check, check_int


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's ``cache_salt``: None, or a non-empty string."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    check(salt is None or (isinstance(salt, str) and salt != ""), "cache_salt",
          "cache_salt must be a non-empty string if given")
    return salt


class LLM:
    """Generate from a Hugging Face model directory::

        llm = LLM(model="path/to/model")
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``kwargs`` are ``EngineArgs`` fields (the ``pagoda serve`` flags, snake_cased), with
        their defaults; the JSON options may also be dicts. vLLM's engine arguments that have
        nothing to do here (``trust_remote_code``, ``swap_space``, ...: ``vllm_flags.IGNORED``)
        are dropped with a warning; ``seed=None`` draws a seed at random, as in vLLM."""
        for name in ("speculative_config", "quantization_config", "limit_mm_per_prompt", "override_generation_config"):
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = json.dumps(kwargs[name])
        kwargs = ignore_vllm_kwargs(kwargs)
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; see EngineArgs for the options")
        args = EngineArgs(model=model, **kwargs)
        self.engine = LLMEngine(args)
        self.config = self.engine.config

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one ``RequestOutput`` per prompt, in input order.
        All prompts are validated before any work starts (the same rules as the server's, in
        ``SamplingParams`` and ``InputProcessor.validate``): a bad one raises ``ValueError``
        naming the field, and the engine stays as it was. ``lora_request``: one adapter for
        every prompt, or one (or None: the base model) per prompt; needs ``enable_lora``. A
        prompt dict may carry a ``cache_salt`` (a non-empty string): it reuses cached prefixes
        only of prompts with the same salt. ``priority`` (vLLM's): one integer per prompt, lower
        first; needs ``scheduling_policy="priority"`` unless all are 0. A vision-language model
        takes images as vLLM does: ``{"prompt": text with one image placeholder per image,
        "multi_modal_data": {"image": PIL image or list}}`` (or ``"prompt_token_ids"``); a
        text-only model refuses them (``ParamError``)."""
        prompt_list = self._as_list(prompts)
        params = self._params_for(prompt_list, sampling_params)
        loras = self._loras_for(prompt_list, lora_request)
        priorities = self._priorities_for(prompt_list, priority)
        prepared = []
        processor = self.engine.input_processor
        for prompt, p in zip(prompt_list, params):
            text, ids = processor.tokenize(prompt)
            ids = processor.truncate(ids, p, isinstance(prompt, dict) and "multi_modal_data" in prompt)
            ids, images = processor.prompt_images(prompt, ids)  # images preprocessed once, here
            processor.validate(ids, p)
            prepared.append(({"prompt": text, "prompt_token_ids": ids}, p, _cache_salt(prompt), images))
        for lora in dict.fromkeys(r for r in loras if r is not None):
            self.engine.core.add_lora(lora)  # a bad adapter is refused before any request starts
        request_ids = []
        try:
            for (prompt, p, salt, images), lora, rank in zip(prepared, loras, priorities):
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, prompt, p, lora, cache_salt=salt, priority=rank, images=images)
                request_ids.append(rid)
        except BaseException:  # one the engine refused after all: none of the call's prompts stay
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        return self._run(request_ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order: the prompt's final hidden states pooled and
        normalised as the model's pooler says (``EngineConfig.pooler``), cut to its first
        ``dimensions`` values when given (then normalised again). Needs an embedding model
        (``task="embed"``, or a checkpoint with sentence-transformers files)."""
        pooler = self.config.pooler
        if pooler is None:
            raise ParamError("model", "this model is not served for embeddings: start it with task='embed' "
                             "(or runner='pooling')")
        if dimensions is not None:
            check_int("dimensions", dimensions, 1, self.config.model.hidden_size)
        outs = self.generate(prompts, SamplingParams(max_tokens=None, pooling=pooler.pooling_type), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids,
                                       EmbeddingOutput(finish_embedding(_embedding_of(o), pooler.normalize,
                                                                        dimensions)))
                for o in outs]

    def _priorities_for(self, prompts: list, priority: Sequence[int] | None) -> list[int]:
        if priority is None:
            return [0] * len(prompts)
        ranks = list(priority)
        check(len(ranks) == len(prompts), "priority", f"got {len(ranks)} priorities for {len(prompts)} prompts")
        check(all(type(r) is int for r in ranks), "priority", "priority must be a list of integers")
        check(self.config.scheduler.policy == "priority" or not any(ranks), "priority",
              "priority other than 0 needs LLM(..., scheduling_policy='priority')")
        return ranks

    def _loras_for(self, prompts: list, lora_request) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        elif isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(prompts):
                raise ParamError("lora_request", f"got {len(lora_request)} lora_requests for {len(prompts)} prompts")
            loras = list(lora_request)
        else:
            raise ParamError("lora_request", "lora_request must be a LoRARequest, or a list of them (or None)")
        check(all(r is None or isinstance(r, LoRARequest) for r in loras), "lora_request",
              "lora_request must be LoRARequest objects (or None)")
        if any(r is not None for r in loras) and self.config.lora is None:
            raise ParamError("lora_request", "lora_request needs LLM(..., enable_lora=True)")
        return loras

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True, *,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate.
        Every conversation is checked first (not empty, known roles, text and image parts, image
        count, bounded size); a bad one raises ``ValueError`` naming ``messages`` before any work
        starts. Image parts are OpenAI's ``image_url`` (data:, http(s) and file URLs under the
        media options, as the server takes them) or ``{"type": "image_pil", "image_pil": image}``;
        such a conversation becomes vLLM's ``{"prompt": text, "multi_modal_data": {"image":
        [...]}}``. vLLM's keyword arguments as its ``LLM.chat`` takes them: ``tools`` (OpenAI's
        tool definitions, for the template), ``continue_final_message`` (the last assistant
        message continued: with ``add_generation_prompt=False``), ``chat_template_kwargs`` (the
        template's own variables, e.g. ``{"enable_thinking": False}``), ``lora_request`` as
        ``generate`` takes it."""
        check(isinstance(messages, (list, tuple)) and len(messages) > 0, "messages", "messages must not be empty")
        check(tools is None or (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)),
              "tools", "tools must be a list of tool definitions (dicts)")
        kwargs = chat_template_args(add_generation_prompt, continue_final_message, chat_template_kwargs)
        if tools:
            kwargs["tools"] = list(tools)
        conversations = messages if isinstance(messages[0], (list, tuple)) else [messages]
        processor = self.engine.input_processor
        split = [split_images(list(c)) for c in conversations]
        for _, images in split:
            check_image_count(len(images), self.config.model, self.config.media, "messages")
        checked = [processor.check_messages(c) for c, _ in split]
        try:
            prompts = [processor.apply_chat_template(c, add_generation_prompt, chat_template, **kwargs)
                       for c in checked]
        except (TemplateError, TypeError) as exc:  # the template refused these messages or variables
            raise ParamError("chat_template_kwargs" if chat_template_kwargs else "messages",
                             f"the chat template cannot render this conversation: {exc}") from exc
        return self.generate([self._chat_prompt(p, images) for p, (_, images) in zip(prompts, split)],
                             sampling_params, use_tqdm, lora_request)

    def _chat_prompt(self, text: str, images: list[ImageRef]) -> dict[str, Any]:
        if images:
            loaded = load_images_sync(self.config.media, [(ref.source, ref.where) for ref in images], "messages")
            return {"prompt": text, "multi_modal_data": {"image": loaded}}
        # The template already contains any BOS token: do not let tokenization add another.
        return {"prompt": text, "prompt_token_ids": self.engine.input_processor.encode(text, False, "messages")}

    @staticmethod
    def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt of token ids (bools are refused by the validation)
        check(isinstance(prompts, Iterable) and not isinstance(prompts, (bytes, bytearray)), "prompts",
              f"prompts must be a string, a list of token ids, a prompt dict, or a list of them, "
              f"got {type(prompts).__name__}")
        return list(prompts)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no ``SamplingParams`` (vLLM's method): the
        model's generation-config defaults (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens; ``generation_config="vllm"`` drops
        them) over ``SamplingParams()``'s."""
        return SamplingParams(**self.config.model.generation_defaults)

    def _params_for(self, prompts: list, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ParamError("sampling_params", f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        check(all(isinstance(p, SamplingParams) for p in sampling_params), "sampling_params",
              "sampling_params must be SamplingParams objects")
        return list(sampling_params)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step(finished_only=True):
                    if output.finished:
                        done[output.request_id] = output
                        out_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for rid in request_ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in request_ids]

    def reset_prefix_cache(self) -> int:
        return self.engine.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _embedding_of(output: RequestOutput) -> list[float]:
    if output.embedding is None:
        reason = output.outputs[0].finish_reason if output.outputs else None
        raise RuntimeError(f"request {output.request_id} ended without an embedding ({reason})")
    return output.embedding
