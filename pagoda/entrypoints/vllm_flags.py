"""``pagoda serve`` with a command line written for ``vllm serve``.

Users arrive with vLLM's flags. Before the serve parser sees the command line, ``translate``
spells vLLM's underscore forms with dashes (``--max_model_len`` is ``--max-model-len``, as
vLLM's parser allows), turns vLLM's aliases into pagoda's flags (``-tp 2``,
``--kv-cache-memory-bytes``), and takes out the flags whose vLLM meaning needs nothing here
(``--trust-remote-code``: only built-in architectures load; ``--swap-space``: preemption
recomputes), each named in one warning. A vLLM flag pagoda does not implement stays, and the
parser's "unrecognized arguments" error then says so (``unknown_flag_hint``).
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# vLLM's short and old names -> pagoda's flag.
ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-q": "--quantization",
    "--kv-cache-memory-bytes": "--kv-cache-memory",
    "--guided-decoding-backend": "--structured-outputs-backend",
}

# vLLM flags accepted and dropped: how many values each takes, and why nothing is lost.
IGNORED = {
    "--trust-remote-code": (0, "pagoda loads only its built-in architectures (no model code runs)"),
    "--disable-log-requests": (0, "pagoda logs no request bodies"),
    "--enable-log-requests": (0, "pagoda logs no request bodies"),
    "--swap-space": (1, "a preempted request is recomputed, not swapped"),
    "--disable-custom-all-reduce": (0, "pagoda's tensor parallelism uses torch.distributed's all-reduce"),
    "--max-seq-len-to-capture": (1, "decode graphs cover every context length"),
    "--disable-fastapi-docs": (0, "the server publishes /openapi.json only"),
    "--uvicorn-log-level": (1, "--log-level sets the server's log level"),
    "--disable-uvicorn-access-log": (0, "the server keeps no access log"),
    "--max-log-len": (1, "pagoda logs no prompts"),
    "--enable-prompt-tokens-details": (0, "usage always carries prompt_tokens_details.cached_tokens"),
    "--distributed-executor-backend": (1, "pagoda runs its ranks as processes (mp)"),
}

# vLLM flags with a value pagoda takes only in its default form.
DEFAULT_ONLY = {"--tokenizer-mode": "auto", "--response-role": "assistant"}


def translate(argv: list[str]) -> list[str]:
    """``argv`` (after ``serve``) with vLLM's spellings turned into pagoda's (module notes);
    ``ValueError`` for a ``DEFAULT_ONLY`` flag with another value."""
    out: list[str] = []
    ignored: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag.startswith("--") and "_" in flag:
            flag = flag.replace("_", "-")
        flag = ALIASES.get(flag, flag)
        if flag in IGNORED:
            takes, why = IGNORED[flag]
            ignored.append(f"{flag} ({why})")
            i += 1 if eq or takes == 0 else 2
            continue
        if flag in DEFAULT_ONLY:
            given = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if given != DEFAULT_ONLY[flag]:
                raise ValueError(f"{flag} {given}: pagoda implements only {flag} {DEFAULT_ONLY[flag]}")
            i += 1 if eq else 2
            continue
        out.append(flag + eq + value if eq else flag)
        i += 1
    if ignored:
        logger.warning("vLLM flags with nothing to do in pagoda, ignored: %s", "; ".join(ignored))
    return out


def ignore_vllm_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**kwargs)`` without vLLM's engine arguments that ``IGNORED`` lists (snake_cased),
    named in one warning; ``tokenizer_mode`` other than auto is refused (``ValueError``)."""
    mode = kwargs.pop("tokenizer_mode", "auto")
    if mode != "auto":
        raise ValueError(f"tokenizer_mode {mode!r}: pagoda implements only tokenizer_mode 'auto'")
    names = {flag[2:].replace("-", "_"): why for flag, (_, why) in IGNORED.items()}
    names["disable_log_stats"] = "the offline LLM logs no periodic stats"
    dropped = [f"{name} ({names[name]})" for name in kwargs if name in names]
    if dropped:
        logger.warning("vLLM engine arguments with nothing to do in pagoda, ignored: %s", "; ".join(dropped))
    return {k: v for k, v in kwargs.items() if k not in names}


def unknown_flag_hint(message: str) -> str:
    """The parser's "unrecognized arguments" message, with a word for a user of vLLM's flags."""
    return message + " (a flag of vllm serve that pagoda does not implement? `pagoda serve --help` lists pagoda's)"
