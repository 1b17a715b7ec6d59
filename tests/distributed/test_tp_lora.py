"""LoRA under tensor parallelism: A/B shards follow the base layers' (column-parallel layers
split B's output rows, row-parallel ones A's input columns, the delta joins the all-reduce),
and rank 0's slot placements are repeated on every rank, so TP=2 gives the TP=1 tokens."""
from __future__ import annotations

from pagoda import LLM, LoRARequest, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 67)), [300, 301, 302, 9, 14, 200], [8, 9, 10]]
NAMES = ["attn8", "mlp16rs", None, "qvdown16"]


def generate(llama_dir, adapters, tp: int) -> list[list[int]]:
    # Two slots for three adapters: placements and evictions happen on every rank.
    llm = LLM(str(llama_dir), tensor_parallel_size=tp, kv_cache_memory=8 << 20, max_model_len=256, enable_lora=True,
              max_loras=2, max_lora_rank=16)
    try:
        loras = [LoRARequest(n, i + 1, str(adapters[n])) if n else None for i, n in enumerate(NAMES)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=loras)
        base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].token_ids for o in base]
    finally:
        llm.shutdown()


def test_tp2_lora_equals_tp1(llama_dir, lora_adapters):
    want, base = generate(llama_dir, lora_adapters, 1)
    got, _ = generate(llama_dir, lora_adapters, 2)
    assert got == want
    assert [w != b for w, b in zip(want, base)] == [n is not None for n in NAMES]
