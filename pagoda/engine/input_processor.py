"""Prompt handling in the front end: tokenization, chat templates and validation, so a bad
request is refused before it reaches the engine core and changes nothing there.

This is where the rules that need the model live (vocabulary, context length,
``--max-logprobs``); rules about parameters alone are in ``sampling_params.py``. The offline
``LLM`` and the API server both call ``InputProcessor.validate`` for every prompt.
"""
from __future__ import annotations

import json
from typing import Any, Union

from pagoda.config import EngineConfig
from pagoda.multimodal.chat_parts import check_image_count, content_text
from pagoda.multimodal.inputs import ImageInput
from pagoda.multimodal.processor import FIELD as MM_FIELD
from pagoda.multimodal.processor import ImagePreprocessor, images_of
from pagoda.sampling_params import ParamError, SamplingParams, check
from pagoda.structured_output.validate import StructuredValidator

PromptType = Union[str, dict, list[int]]

# Text is bounded before it is tokenized (tokenizing costs time and memory in proportion to it):
# a prompt that fits max_model_len tokens averages a few characters per token, rarely more than
# ten even for whitespace-heavy code, so 32 characters per token of context refuses nothing that
# could run while keeping the worst case to a fraction of a second of tokenizing per request.
MAX_PROMPT_CHARS_PER_TOKEN = 32
# Messages in one conversation; each is rendered by the chat template.
MAX_MESSAGES = 1024
# Roles the chat templates know. "developer" is OpenAI's newer name for "system" and is passed
# to the template as "system". "tool" carries a tool's result back (tool calling).
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# The names an earlier assistant reply's thinking comes by: OpenAI-style servers send
# ``reasoning_content`` (and vLLM also takes ``reasoning``); gpt-oss's chat template reads ``thinking``.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
_ROLE_ALIASES = {"developer": "system"}


def check_unicode(text: str, param: str) -> None:
    """Refuse text holding a lone UTF-16 surrogate (JSON ``"\\ud800"`` decodes to one): it is
    not Unicode text, and the tokenizer would fail on it with a ``TypeError``."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParamError(param, f"{param} holds a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at "
                         f"character {exc.start}, which is not valid Unicode text") from None


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.structured = StructuredValidator(config, tokenizer)
        self.image_preprocessor = ImagePreprocessor(config.model) if config.model.is_multimodal else None

    @property
    def max_prompt_chars(self) -> int:
        return MAX_PROMPT_CHARS_PER_TOKEN * self.config.model.max_model_len

    def check_text(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse text too long to be a prompt that fits the context, before tokenizing it."""
        limit = self.max_prompt_chars
        check(num_chars <= limit, param, f"{param} has {num_chars} characters; at most {limit} "
              f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of max_model_len {self.config.model.max_model_len})")

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of ``text``; ``ParamError`` naming ``param`` if it is not valid Unicode."""
        check_unicode(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, ``{"prompt_token_ids": [...]}`` or ids."""
        if isinstance(prompt, str):
            check(bool(prompt), "prompt", "prompt must not be empty")
            self.check_text(len(prompt))
            return prompt, self.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") is not None:
                return self.tokenize_multimodal(prompt)
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ParamError("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt):
            return None, list(prompt)
        raise ParamError("prompt", f"unsupported prompt type {type(prompt).__name__}: give a string, a list of "
                         "token ids or a dict with 'prompt_token_ids'")

    def tokenize_multimodal(self, prompt: dict) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt in vLLM's form ``{"prompt": text, "multi_modal_data":
        {"image": [PIL.Image, ...]}}`` (or ``"prompt_token_ids"``), the text holding the model's
        image placeholder once per image. The modality, the images' type and count are checked
        here (a text-only model takes none); the ids are not expanded yet (``process_images``)."""
        images = multi_modal_images(prompt["multi_modal_data"])
        check_image_count(len(images), self.config.model, self.config.media, "multi_modal_data")
        return self.tokenize({k: v for k, v in prompt.items() if k != "multi_modal_data"})

    def process_images(self, multi_modal_data: Any, token_ids: list[int]) -> tuple[list[int], list[ImageInput]]:
        """A prompt's images (vLLM's ``multi_modal_data``: ``{"image": PIL image or list}``)
        preprocessed by the model's image processor, and ``token_ids`` with each image's
        placeholder expanded to its feature count; ``(token_ids, [])`` when there are none.
        ``ParamError`` for images sent to a text-only model, or placeholders not matching them."""
        if multi_modal_data is None:
            return token_ids, []
        images = images_of(multi_modal_data)
        if not images:
            return token_ids, []
        check(self.image_preprocessor is not None, MM_FIELD,
              f"this model ({self.config.model.architecture}) takes no images; send text only")
        assert self.image_preprocessor is not None
        return self.image_preprocessor.process(token_ids, images)

    def prompt_images(self, prompt: PromptType, token_ids: list[int]) -> tuple[list[int], list[ImageInput]]:
        """``process_images`` of a prompt dict's ``multi_modal_data`` (other prompts have none)."""
        data = prompt.get(MM_FIELD) if isinstance(prompt, dict) else None
        return self.process_images(data, token_ids)

    @staticmethod
    def token_ids(ids: Any) -> list[int]:
        check(isinstance(ids, (list, tuple)) and all(_is_token_id(t) for t in ids), "prompt",
              "prompt token ids must be a list of integers")
        return list(ids)

    def truncate(self, prompt_ids: list[int], params: SamplingParams, has_images: bool = False) -> list[int]:
        """The prompt's last ``params.truncate_prompt_tokens`` tokens (-1: the last
        max_model_len), as vLLM keeps them; the prompt as it is without the field. A prompt with
        images is refused with it (cutting could split an image's placeholder run)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        check(not has_images, "truncate_prompt_tokens", "truncate_prompt_tokens cannot cut a prompt with images")
        keep = self.config.model.max_model_len if keep == -1 else keep
        return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ParamError`` (a ``ValueError``) naming the field if the prompt cannot run as asked."""
        check(isinstance(params, SamplingParams), "sampling_params", "sampling_params must be a SamplingParams")
        params.validate()  # again: a caller may have changed a field after construction
        check(self.config.pooler is None or params.pooling is not None, "model",
              "this model is served for embeddings (/v1/embeddings, LLM.embed) and does not generate")
        self._validate_prompt(prompt_ids, params.pooling is not None)
        max_seqs = self.config.scheduler.max_num_seqs
        check(params.n <= max_seqs, "n", f"n must be at most max_num_seqs ({max_seqs}): a request's samples "
              f"run side by side, got {params.n}")
        if params.pooling is None:
            self._validate_lengths(len(prompt_ids), params)
        else:  # an embedding: one prefill, nothing sampled
            check(params.n == 1 and params.structured_outputs is None, "pooling",
                  "an embedding request has n 1 and no structured output")
        self._validate_vocab_params(params)
        if params.structured_outputs is not None:  # a schema the backend cannot take, or longer than allowed
            self.structured.validate(params.structured_outputs, *self._output_budget(len(prompt_ids), params))
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            check(value is None or value <= limit, name,
                  f"{name} must be at most {limit} (the server's --max-logprobs), got {value}")

    def _validate_prompt(self, prompt_ids: list[int], pooled: bool = False) -> None:
        """``pooled``: an embedding's prompt, which may fill the context (nothing follows it)."""
        model, sched = self.config.model, self.config.scheduler
        n = len(prompt_ids)
        check(n > 0, "prompt", "the prompt is empty")
        if pooled:
            check(n <= model.max_model_len, "prompt", f"the prompt has {n} tokens but max_model_len is "
                  f"{model.max_model_len}")
        else:
            check(n < model.max_model_len, "prompt", f"the prompt has {n} tokens but max_model_len is "
                  f"{model.max_model_len} (prompt plus at least one generated token must fit)")
        bad = [t for t in prompt_ids if not 0 <= t < model.vocab_size]
        check(not bad, "prompt", f"prompt token id {bad[0] if bad else 0} is outside the vocabulary "
              f"[0, {model.vocab_size})")
        check(sched.enable_chunked_prefill or n <= sched.max_num_batched_tokens, "prompt",
              f"the prompt has {n} tokens, more than max_num_batched_tokens {sched.max_num_batched_tokens}, "
              "and chunked prefill is disabled")

    def _output_budget(self, n: int, params: SamplingParams) -> tuple[int | None, str]:
        """The most tokens a request with an ``n``-token prompt may generate, and its name (no
        budget for an embedding, which generates nothing)."""
        if params.pooling is not None:
            return None, ""
        if params.max_tokens is not None:
            return params.max_tokens, f"this request's max_tokens ({params.max_tokens})"
        room = self.config.model.max_model_len - n
        return room, f"the {room} tokens max_model_len ({self.config.model.max_model_len}) leaves after the prompt"

    def _validate_lengths(self, n: int, params: SamplingParams) -> None:
        limit = self.config.model.max_model_len
        cap = self.config.scheduler.max_request_output_tokens
        if cap is not None:
            max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
            check(params.n * max_tokens <= cap, "max_tokens",
                  f"n ({params.n}) x max_tokens ({max_tokens}) = {params.n * max_tokens} output tokens, more than "
                  f"this server allows one request (--max-request-output-tokens {cap}); lower n or max_tokens")
        if params.max_tokens is not None:
            check(n + params.max_tokens <= limit, "max_tokens",
                  f"max_tokens ({params.max_tokens}) plus the prompt's {n} tokens exceed max_model_len {limit}; "
                  f"lower max_tokens to at most {limit - n}")
        else:  # generation runs up to max_model_len: min_tokens must fit before that
            check(n + params.min_tokens <= limit, "min_tokens",
                  f"min_tokens ({params.min_tokens}) plus the prompt's {n} tokens exceed max_model_len {limit}")

    def _validate_vocab_params(self, params: SamplingParams) -> None:
        vocab = self.config.model.vocab_size
        check(params.top_k <= vocab, "top_k",
              f"top_k must be -1 or 0 (off) or in [1, {vocab}] (the vocabulary size), got {params.top_k}")
        bad = [t for t in params.stop_token_ids or [] if t >= vocab]
        check(not bad, "stop_token_ids", f"stop_token_ids: id {bad[0] if bad else 0} is outside the vocabulary "
              f"[0, {vocab})")
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        check(not bad, "logit_bias", f"logit_bias: token id {bad[0] if bad else 0} is outside the vocabulary "
              f"[0, {vocab})")
        bad = [t for t in params.allowed_token_ids or () if t >= vocab]
        check(not bad, "allowed_token_ids", f"allowed_token_ids: token id {bad[0] if bad else 0} is outside the "
              f"vocabulary [0, {vocab})")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self.spell_bad_words(params.bad_words)
        bad = [t for w in params.bad_words_token_ids or () for t in w if t >= vocab]
        check(not bad, "bad_words", f"bad_words: token id {bad[0] if bad else 0} is outside the vocabulary "
              f"[0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            check(value is None or value <= vocab, name,
                  f"{name} must be at most the vocabulary size {vocab}, got {value}")

    def spell_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids as vLLM spells them: the word at the text's start, and after a
        space where that is a different spelling of as many tokens (a new word's first token)."""
        check(self.tokenizer is not None, "bad_words", "bad_words need the tokenizer (this engine has none)")
        spelled: list[list[int]] = []
        for word in words:
            plain = self.encode(word.lstrip(), False, "bad_words")
            spelled.append(plain)
            spaced = self.encode(" " + word.lstrip(), False, "bad_words")
            if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                spelled.append(spaced)
        return [w for w in spelled if w]

    # ---- chat --------------------------------------------------------------------------------
    def check_messages(self, messages: Any, param: str = "messages") -> list[dict[str, Any]]:
        """Validate a conversation (count, roles, text-only content, total size) and return it as
        the chat template expects it: each content one string, role aliases resolved, an earlier
        reply's thinking (``reasoning_content``, ``reasoning`` or ``thinking``) under all three
        names."""
        check(isinstance(messages, (list, tuple)) and len(messages) > 0, param, f"{param} must not be empty")
        check(len(messages) <= MAX_MESSAGES, param, f"{param} has {len(messages)} messages; at most {MAX_MESSAGES}")
        out = [self._template_message(m, i, param) for i, m in enumerate(messages)]
        self.check_text(sum(len(content_text(m["content"])) + len(m.get("reasoning_content") or "") for m in out),
                        param)
        for m in out:
            check_unicode(content_text(m["content"]), param)
            if m.get("reasoning_content"):
                check_unicode(m["reasoning_content"], param)
        return out

    @staticmethod
    def _template_message(message: Any, index: int, param: str) -> dict[str, Any]:
        where = f"{param}[{index}]"
        check(isinstance(message, dict), param, f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        check(role in CHAT_ROLES, param, f"{where}: unsupported role {role!r}; pagoda accepts "
              + ", ".join(repr(r) for r in CHAT_ROLES))
        out = {**message, "role": _ROLE_ALIASES.get(role, role), "content": _content_text(message.get("content"),
                                                                                        where, param)}
        if out.get("tool_calls"):
            out["tool_calls"] = [_template_tool_call(c) for c in out["tool_calls"]]
        for name in REASONING_FIELDS:
            check(isinstance(out.get(name), (str, type(None))), param, f"{where}.{name} must be a string")
        reasoning = next((out[name] for name in REASONING_FIELDS if out.get(name) is not None), None)
        if reasoning is not None:
            # An earlier turn's thinking under every name a chat template reads it by (Qwen3's
            # ``reasoning_content``, gpt-oss's ``thinking``), whichever one the client sent.
            out.update({name: reasoning for name in REASONING_FIELDS})
        return out

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template, **kwargs)


# The tokenizer's apply_chat_template's own parameters: chat_template_kwargs may not set them
# (the request's fields or the call's arguments do, or nothing may).
TEMPLATE_OWN_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def chat_template_args(add_generation_prompt: bool, continue_final_message: bool,
                       chat_template_kwargs: dict[str, Any] | None, documents: Any = None,
                       reasoning_effort: str | None = None) -> dict[str, Any]:
    """What a chat template gets besides the messages and tools, as vLLM gives it (the server's
    request fields and ``LLM.chat``'s arguments alike): ``chat_template_kwargs`` as template
    variables, ``reasoning_effort`` as one (unless those set it), ``documents``,
    ``continue_final_message``. ``ParamError`` for a combination that cannot render."""
    check(not (continue_final_message and add_generation_prompt), "continue_final_message",
          "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt to "
          "false to continue the final message")
    check(chat_template_kwargs is None or isinstance(chat_template_kwargs, dict), "chat_template_kwargs",
          "chat_template_kwargs must be a mapping of template variables")
    variables = dict(chat_template_kwargs or {})
    reserved = sorted(set(variables) & TEMPLATE_OWN_ARGS)
    check(not reserved, "chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}: "
          "give them as request fields")
    kwargs: dict[str, Any] = {}
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    kwargs.update(variables)
    if documents:
        kwargs["documents"] = documents
    if continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs


def _template_tool_call(call: Any) -> Any:
    """Chat templates read a call's arguments as a mapping; OpenAI sends them as JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        args = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": args}}


def _content_text(content: Any, where: str, param: str) -> str | list[dict[str, str]]:
    """A message's content as the template takes it: one string (a string, null, or a list of
    ``{"type": "text"}`` parts), or, when it holds images (``{"type": "image"}`` parts, which
    ``multimodal.chat_parts.split_images`` makes), its list of text and image parts."""
    if content is None or isinstance(content, str):
        return content or ""
    check(isinstance(content, (list, tuple)), param, f"{where}.content must be a string or a list of parts")
    parts: list[dict[str, str]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        check(kind in ("text", "image"), param, f"{where}.content: content parts of type {kind!r} are not "
              "supported (only 'text' and 'image_url')")
        if kind == "image":
            parts.append({"type": "image"})
            continue
        text = part.get("text")
        check(isinstance(text, str), param, f"{where}.content: a text part needs a string 'text'")
        parts.append({"type": "text", "text": text})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def multi_modal_images(data: Any) -> list[Any]:
    """The images of a prompt's ``multi_modal_data`` (``{"image": image or [images]}``)."""
    check(isinstance(data, dict), "multi_modal_data", "multi_modal_data must be a dict such as "
          "{'image': [PIL.Image, ...]}")
    other = sorted(str(k) for k in data if k != "image")
    check(not other, "multi_modal_data", f"multi_modal_data: unsupported modality {', '.join(other)[:80]!r}; "
          "pagoda takes 'image'")
    images = data.get("image")
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    from PIL import Image  # only prompts with images pay for it

    check(all(isinstance(i, Image.Image) for i in images), "multi_modal_data",
          "multi_modal_data['image'] must be a PIL.Image or a list of them")
    return images
