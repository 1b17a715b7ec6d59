"""Prompt handling in the front end: tokenization, chat templates and validation, so a bad
request is refused before it reaches the engine core and changes nothing there."""
from __future__ import annotations

from typing import Any, Union

from pagoda.config import EngineConfig
from pagoda.sampling_params import SamplingParams

PromptType = Union[str, dict, list[int]]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a missing/corrupt tokenizer
        raise ValueError(f"cannot load a tokenizer from {path!r}: {exc}") from exc


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, ``{"prompt_token_ids": [...]}`` or ids."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: give a string, a list of token "
                         "ids or a dict with 'prompt_token_ids'")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        model, sched = self.config.model, self.config.scheduler
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= model.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but max_model_len is {model.max_model_len} "
                             "(prompt plus at least one generated token must fit)")
        bad = [t for t in prompt_ids if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
        if not sched.enable_chunked_prefill and n > sched.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than max_num_batched_tokens "
                             f"{sched.max_num_batched_tokens}, and chunked prefill is disabled")
        if params.logprobs is not None and params.logprobs > model.vocab_size:
            raise ValueError(f"logprobs must be at most the vocabulary size {model.vocab_size}")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template, **kwargs)
