"""How closely pagoda follows ``transformers`` on one GGUF file, per ``q6_k`` loading choice: the
greedy tokens matched before the first difference (four prompts of ``--tokens`` each; random
models' peaked logits make later tokens chaotic), and the largest gap between pagoda's top-5
logprobs and transformers' on transformers' own greedy continuation (teacher-forced). transformers
dequantizes every tensor with gguf's exact values, so it is the reference.

    python benchmarks/gguf_agreement.py /tmp/q4km-peers/bench-model-*-q6_k.gguf
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = [[5, 77, 300, 12, 9, 401, 33], list(range(20, 60)), [7] * 3, [100, 200, 300, 400, 500]]
CHOICES = ("int8", "int8-channel", "dequantize")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the GGUF file")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from pagoda import LLM, SamplingParams

    path = Path(args.path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=args.tokens, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]
        ref_logprobs = [torch.log_softmax(hf(torch.tensor([p + r])).logits[0].float(), -1)
                        for p, r in zip(PROMPTS, refs)]
    for choice in CHOICES:
        llm = LLM(str(path), kv_cache_memory=64 << 20, max_model_len=512, dtype="float32",
                  quantization_config={"q6_k": choice})
        try:
            greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
            matched = [next((i for i, (a, b) in enumerate(zip(ref, o.outputs[0].token_ids)) if a != b), args.tokens)
                       for ref, o in zip(refs, outs)]
            forced = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(PROMPTS, refs)], forced, use_tqdm=False)
            worst = max(abs(value - lp[pos - 1, token].item())
                        for p, r, o, lp in zip(PROMPTS, refs, outs, ref_logprobs)
                        for pos in range(len(p), len(p) + len(r))
                        for token, value in o.prompt_logprobs[pos].items())
        finally:
            llm.shutdown()
        print(json.dumps({"q6_k": choice, "greedy_matched": sum(matched), "of": args.tokens * len(PROMPTS),
                          "per_prompt": matched, "worst_top5_logprob_gap": round(worst, 4)}), flush=True)


if __name__ == "__main__":
    main()
