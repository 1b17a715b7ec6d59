"""``scripted_model`` with special tokens that repeat in the script (harmony's markers): the
second use is a twin that decodes to the same text, and Hugging Face's greedy generation writes
the script and stops at the stop token."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from pagoda.tools.scripted_model import make_scripted_model

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")
PIECES = ("<|channel|>", "analysis", "<|message|>", "Hm", "<|end|>", "<|start|>assistant", "<|channel|>", "final",
          "<|message|>", "Yes", "<|return|>")
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_repeated_special_tokens_are_written_by_twins(tmp_path: Path) -> None:
    path = make_scripted_model(tmp_path, PIECES, trigger="<|start|>assistant", chat_template=TEMPLATE,
                               added_tokens=("assistant", "analysis", "final", "Hm", "Yes"), special_tokens=MARKERS,
                               stop_tokens=("<|return|>",))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=True,
                                           tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
    assert tokenizer.decode(out, skip_special_tokens=False) == "".join(PIECES)
    assert out[-1] == tokenizer.convert_tokens_to_ids("<|return|>")  # a stop token: generation ended there
    assert len(set(out)) == len(out)
    # The marker's first use is the special token itself, which encoding produces; the second its
    # twin, ordinary vocabulary (kept when special tokens are skipped).
    channel = tokenizer.convert_tokens_to_ids("<|channel|>")
    assert out.count(channel) == 1 and tokenizer.encode("<|channel|>", add_special_tokens=False) == [channel]
    assert tokenizer.decode(out, skip_special_tokens=True).count("<|channel|>") == 1
