"""Checkpoints whose greedy output is a chosen text (for tests of reasoning and tool parsers).

A random model does not write ``<think>`` tags or tool calls, so tests of the code that reads
them need a model that does, deterministically. This builds one: a Llama checkpoint whose layers
add nothing (``o_proj`` and ``down_proj`` are zero, so the last hidden state is the RMS-normed
embedding of the current token) and whose LM head maps each token of a chosen chain to the next
one. The chain's tokens get orthonormal embeddings, so each one's successor wins by a clear
margin (about ``sqrt(hidden_size)`` logits); the last one leads to EOS. The greedy continuation of
any prompt that ends with the chain's first token is therefore the rest of the chain, then EOS.

The tokenizer is ``make_model``'s byte-level BPE with extra (non-special, so detokenized) tokens
such as ``<think>`` and ``</think>``, and a ChatML template that honours ``enable_thinking``
(false writes an empty ``<think></think>`` after the assistant header, as Qwen3's does).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from pagoda.tools.make_model import (BOS, CHAT_TEMPLATE, EOS, PAD, _patch_config_json, _quiet_transformers,
                                     build_config, build_tokenizer)

THINK_TOKENS = ("<think>", "</think>")

# make_model's ChatML, plus Qwen3's switch: enable_thinking=false closes an empty think block.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)

# The token every ChatML generation prompt ends with ("\n" after "<|im_start|>assistant").
CHATML_TRIGGER = "<|im_start|>assistant\n"


def chain_ids(tokenizer: Any, trigger: str, pieces: Sequence[str]) -> list[int]:
    """The token chain: the last token of ``trigger``, then each piece's tokens. Pieces are
    tokenized one by one (so a tag stays one token); every token of the chain must be distinct,
    since a token's successor is all the model knows."""
    chain = [tokenizer.encode(trigger, add_special_tokens=False)[-1]]
    for piece in pieces:
        chain += tokenizer.encode(piece, add_special_tokens=False)
    if len(set(chain)) != len(chain):
        repeated = sorted({tokenizer.decode([t]) for t in chain if chain.count(t) > 1})
        raise ValueError(f"the chain repeats tokens {repeated}: each token may appear once")
    return chain


def make_scripted_model(out: str | Path, pieces: Sequence[str], trigger: str = CHATML_TRIGGER,
                        added_tokens: Sequence[str] = THINK_TOKENS, chat_template: str = THINKING_CHAT_TEMPLATE,
                        hidden_size: int = 64, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write the checkpoint to ``out`` (returned): greedy decoding after a prompt ending in
    ``trigger``'s last token writes ``"".join(pieces)`` and stops (EOS)."""
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.add_tokens(list(added_tokens))
    tokenizer.chat_template = chat_template
    chain = chain_ids(tokenizer, trigger, pieces)
    if len(chain) > hidden_size:
        raise ValueError(f"a chain of {len(chain)} tokens needs hidden_size >= {len(chain)}")
    config = build_config("llama", hidden_size, 1, 4, None, None, None, len(tokenizer), False, 2048,
                          10000.0, None)
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # norms 1; q/k/v/gate/up small (their outputs are dropped)
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.copy_(torch.randn(embed.shape, generator=gen))
        basis, _ = torch.linalg.qr(torch.randn(hidden_size, hidden_size, generator=gen))
        head = model.lm_head.weight
        head.copy_(torch.randn(head.shape, generator=gen) * 0.01)  # no exact ties off the chain
        eos = tokenizer.convert_tokens_to_ids(EOS)
        for i, token in enumerate(chain):
            embed[token] = basis[i]
            head[chain[i + 1] if i + 1 < len(chain) else eos] += basis[i]
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS), eos_token_id=eos,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD))
    for stale in out.glob("model*.safetensors"):
        stale.unlink()
    with _quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    _patch_config_json(out, 10000.0, None, "float32")
    return out
