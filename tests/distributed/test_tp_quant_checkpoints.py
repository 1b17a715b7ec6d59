"""Pre-quantized checkpoints under real tensor parallelism (worker processes, gloo): each rank
loads its slice of the packed tensors and the all-reduced result matches transformers on the
checkpoint's dequantized weights, as with one rank (tests/models/test_quant_checkpoints.py,
which also checks every format's shards in-process)."""
from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.models.quant_checkpoints import MODEL_SHAPE, QuantSpec, dequantize_checkpoint, oracle_model, write_quantized

PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 67))]
# The bf16 CPU kernels' bound from tests/models/test_quant_checkpoints.py (max, mean |dlogprob|).
KERNEL_LOGPROB_TOL = (0.5, 0.1)


@pytest.mark.parametrize("spec", [QuantSpec("gptq", 4, 64, sym=False, desc_act=True)], ids=lambda s: s.name)
def test_two_ranks_match_transformers(spec, tmp_path):
    from pagoda.tools.make_model import make_model

    qdir = tmp_path / spec.name
    write_quantized(make_model(tmp_path / "dense", **MODEL_SHAPE), qdir, spec)
    llm = LLM(str(qdir), tensor_parallel_size=2, dtype="float32", kv_cache_memory=8 << 20, max_model_len=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5, logprobs=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    hf = oracle_model(qdir, dequantize_checkpoint(qdir))
    diffs = []
    for prompt, out in zip(PROMPTS, outs):
        sample = out.outputs[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + sample.token_ids])).logits[0].log_softmax(-1)
        rows = list(enumerate(out.prompt_logprobs[1:])) + [(len(prompt) - 1 + j, e) for j, e in enumerate(sample.logprobs)]
        diffs += [abs(v - ref[i, t].item()) for i, entry in rows for t, v in entry.items()]
    diffs = torch.tensor(diffs)
    assert diffs.max() <= KERNEL_LOGPROB_TOL[0] and diffs.mean() <= KERNEL_LOGPROB_TOL[1], \
        (diffs.max().item(), diffs.mean().item())
