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

Formats whose markers are special tokens and repeat (gpt-oss's harmony writes ``<|channel|>``
in every message header) need more than one token per text: a chain token that comes again is
written the second time by a *twin*, new vocabulary entries that split its text in two (never
produced by encoding, decoded to the same text). ``stop_tokens`` end generation like EOS (the
generation config lists them), as harmony's ``<|return|>`` and ``<|call|>`` do.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from pagoda.tools.make_model import (BOS, CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, UNK, _patch_config_json,
                                     _quiet_transformers, build_config, tokenizer_json)

THINK_TOKENS = ("<think>", "</think>")

# make_model's ChatML, plus Qwen3's switch: enable_thinking=false closes an empty think block.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)

# The token every ChatML generation prompt ends with ("\n" after "<|im_start|>assistant").
CHATML_TRIGGER = "<|im_start|>assistant\n"


def chain_ids(tokenizer: Any, trigger: str, pieces: Sequence[str], twins: dict[int, list[int]] | None = None
              ) -> list[int]:
    """The token chain: the last token of ``trigger``, then each piece's tokens. Pieces are
    tokenized one by one (so a tag stays one token); every token of the chain must be distinct,
    since a token's successor is all the model knows: a repeated token is replaced by its
    ``twins`` (the ids that write its text) where it has them."""
    chain = [tokenizer.encode(trigger, add_special_tokens=False)[-1]]
    for piece in pieces:
        for token in tokenizer.encode(piece, add_special_tokens=False):
            chain += (twins or {}).get(token, [token]) if token in chain else [token]
    if len(set(chain)) != len(chain):
        repeated = sorted({tokenizer.decode([t]) for t in chain if chain.count(t) > 1})
        raise ValueError(f"the chain repeats tokens {repeated}: each token may appear once")
    return chain


def make_scripted_model(out: str | Path, pieces: Sequence[str], trigger: str = CHATML_TRIGGER,
                        added_tokens: Sequence[str] = THINK_TOKENS, chat_template: str = THINKING_CHAT_TEMPLATE,
                        hidden_size: int = 64, vocab_size: int = 512, seed: int = 0,
                        special_tokens: Sequence[str] = (), stop_tokens: Sequence[str] = ()) -> Path:
    """Write the checkpoint to ``out`` (returned): greedy decoding after a prompt ending in
    ``trigger``'s last token writes ``"".join(pieces)`` and stops (EOS, or the first of
    ``stop_tokens``, which must be among the tokens). ``special_tokens`` are added as special
    tokens; a token that repeats in the chain gets a twin (once: a third use is refused)."""
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, _ = _tokenizer(vocab_size, added_tokens, special_tokens)
    repeated = tokenizer.convert_ids_to_tokens(_repeated(tokenizer, trigger, pieces))
    if repeated:  # built again, with a twin for each repeated token
        texts = {token: tokenizer.convert_tokens_to_string([token]) for token in repeated}
        tokenizer, by_text = _tokenizer(vocab_size, added_tokens, special_tokens, list(texts.values()))
        twins = {tokenizer.convert_tokens_to_ids(token): by_text[text] for token, text in texts.items()}
    else:
        twins = {}
    tokenizer.chat_template = chat_template
    chain = chain_ids(tokenizer, trigger, pieces, twins)
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
    stops = [tokenizer.convert_tokens_to_ids(t) for t in stop_tokens]
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS), eos_token_id=[eos, *stops] if stops else eos,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD))
    for stale in out.glob("model*.safetensors"):
        stale.unlink()
    with _quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    _patch_config_json(out, 10000.0, None, "float32")
    return out


def _repeated(tokenizer: Any, trigger: str, pieces: Sequence[str]) -> list[int]:
    """The tokens that come more than once in the chain, in order."""
    chain = [tokenizer.encode(trigger, add_special_tokens=False)[-1]]
    for piece in pieces:
        chain += tokenizer.encode(piece, add_special_tokens=False)
    return list(dict.fromkeys(t for t in chain if chain.count(t) > 1))


def _tokenizer(vocab_size: int, added_tokens: Sequence[str], special_tokens: Sequence[str],
               twin_texts: Sequence[str] = ()) -> tuple[Any, dict[str, list[int]]]:
    """``make_model``'s tokenizer with ``added_tokens`` and ``special_tokens`` (special); for each
    of ``twin_texts`` two more vocabulary entries (ids before the added tokens') whose texts join
    to it, returned as text -> their ids."""
    import json

    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads(tokenizer_json(vocab_size))
    vocab = data["model"]["vocab"]
    twins = {}
    for text in twin_texts:
        twins[text] = []
        for piece in _twin_pieces(text, vocab):
            vocab[piece] = len(vocab)
            twins[text].append(vocab[piece])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)), unk_token=UNK, bos_token=BOS, eos_token=EOS,
        pad_token=PAD, additional_special_tokens=[IM_START, IM_END], model_max_length=2048,
        clean_up_tokenization_spaces=False)
    tokenizer.add_tokens(list(added_tokens))
    if special_tokens:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens],
                             special_tokens=True)
    return tokenizer, twins


def _twin_pieces(text: str, vocab: dict[str, int]) -> tuple[str, str]:
    """Two new vocabulary entries (byte-level strings) that decode, joined, to ``text``."""
    chars = _byte_chars()
    encoded = "".join(chars[b] for b in text.encode())
    for i in range(1, len(encoded)):
        if encoded[:i] not in vocab and encoded[i:] not in vocab and encoded[:i] != encoded[i:]:
            return encoded[:i], encoded[i:]
    raise ValueError(f"{text!r} repeats in the chain and has no twin: add it as a token of its own")


def _byte_chars() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the others for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
