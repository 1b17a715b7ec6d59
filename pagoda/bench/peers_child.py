"""The peers of ``pagoda bench peers`` (Hugging Face ``generate`` and llama.cpp), each run as a
script in its own process: it gets its own threading defaults (not the OpenMP settings pagoda
makes for itself) and gives its memory back when it ends. Imports nothing from pagoda.

Reads a job as JSON on stdin and prints one JSON line:

    job:    {"engine": "hf" | "llama.cpp", "model": DIR, "dtype": "float32" | "bfloat16",
             "gguf": PATH, "threads": N, "batches": {"1": [[ids], ...], "8": ...},
             "output_len": N, "prefill_prompts": [[ids], ...]}
    result: {"decode_tok_s": {"1": x, ...}, "prefill_tok_s": x, "greedy": [ids of batch 1's
             first prompt]}

or, to write a file type only llama.cpp's quantizer makes (Q4_K_M), ``{"engine":
"llama.cpp-quantize", "source": F32 GGUF, "out": PATH, "ftype": "Q4_K_M"}`` -> ``{"out": PATH}``.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any


def run_hf(job: dict[str, Any]) -> dict[str, Any]:
    """``generate`` as a user writes it. Decode rate: ``B * (n - 1)`` tokens over the time a
    call generating ``n`` tokens takes beyond one generating a single token (the prefill)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    hf = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"])).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def generate(prompts: list[list[int]], n: int) -> tuple[float, list[int]]:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()

    n = job["output_len"]
    generate(job["batches"]["1"], 2)  # warm-up
    decode, greedy = {}, []
    for size, prompts in job["batches"].items():
        first = min(generate(prompts, 1)[0] for _ in range(2))
        elapsed, tokens = generate(prompts, n)
        decode[size] = len(prompts) * (n - 1) / max(elapsed - first, 1e-9)
        if size == "1":
            greedy = tokens
    prefill = [generate([p], 1)[0] for p in job["prefill_prompts"]]
    return {"decode_tok_s": decode, "prefill_tok_s": len(job["prefill_prompts"][0]) / statistics.median(prefill),
            "greedy": greedy}


class _LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level API: one context with a sequence per
    prompt, every decode step one ``llama_decode`` over all sequences, greedy argmax on the
    logits it returns."""

    def __init__(self, gguf_path: str, threads: int, n_seq: int, n_ctx: int, n_batch: int,
                 extra_bufts: bool = True) -> None:
        import llama_cpp as lc

        self.lc = lc
        self.limit = n_batch
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        if not extra_bufts:  # llama.cpp's repacked weight layouts (AMX, CPU_REPACK) off
            mparams.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = True  # one cache all sequences share, as pagoda's pool
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence, wants_logits) items."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax_rows(self, rows: int) -> list[int]:
        import numpy as np

        ptr = self.lc.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Each prompt's first greedy token; whole prompts packed into calls of <= ``limit`` tokens."""
        firsts: list[int] = []
        group: list[int] = []
        used = 0
        for s, p in enumerate(prompts + [[]]):
            if group and (not p or used + len(p) > self.limit):
                items = [(t, pos, g, pos == len(prompts[g]) - 1) for g in group
                         for pos, t in enumerate(prompts[g])]
                self.decode(items)
                firsts += self.argmax_rows(len(group))
                group, used = [], 0
            if p:
                group.append(s)
                used += len(p)
        return firsts

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, float, list[list[int]]]:
        """(prefill seconds, decode seconds for the other n - 1 tokens, tokens per prompt)."""
        self.clear()
        start = time.perf_counter()
        last = self.prefill(prompts)
        mid = time.perf_counter()
        out = [[t] for t in last]
        for step in range(n - 1):
            self.decode([(last[s], len(p) + step, s, True) for s, p in enumerate(prompts)])
            last = self.argmax_rows(len(prompts))
            for s, t in enumerate(last):
                out[s].append(t)
        return mid - start, time.perf_counter() - mid, out

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def run_llama_cpp(job: dict[str, Any]) -> dict[str, Any]:
    batches = job["batches"]
    n = job["output_len"]
    longest = max(len(p) for p in job["prefill_prompts"])
    tokens = max(sum(len(p) + n for p in prompts) for prompts in batches.values())
    n_seq = max(len(prompts) for prompts in batches.values())
    eng = _LlamaCpp(job["gguf"], job["threads"], n_seq, max(tokens, longest) + 256, max(512, longest),
                    job.get("extra_bufts", True))
    try:
        eng.generate(batches[min(batches, key=int)], 2)  # warm-up on the smallest batch (--batch-sizes may lack 1)
        decode, greedy = {}, []
        for size, prompts in batches.items():
            _, seconds, out = eng.generate(prompts, n)
            decode[size] = len(prompts) * (n - 1) / seconds
            if size == "1":
                greedy = out[0]
        prefill = []
        for p in job["prefill_prompts"]:
            eng.clear()
            start = time.perf_counter()
            eng.prefill([p])
            prefill.append(time.perf_counter() - start)
    finally:
        eng.close()
    return {"decode_tok_s": decode, "prefill_tok_s": longest / statistics.median(prefill), "greedy": greedy}


def quantize_llama_cpp(job: dict[str, Any]) -> dict[str, Any]:
    """``llama_model_quantize`` with its default parameters and ``LLAMA_FTYPE_MOSTLY_<ftype>``:
    the file llama.cpp's ``llama-quantize`` tool writes (its per-tensor type choices included)."""
    import ctypes

    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{job['ftype']}")
    params.nthread = os.cpu_count() or 1
    if lc.llama_model_quantize(job["source"].encode(), job["out"].encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {job['source']} to {job['ftype']}")
    return {"out": job["out"]}


def main() -> None:
    job = json.load(sys.stdin)
    run = {"hf": run_hf, "llama.cpp": run_llama_cpp, "llama.cpp-quantize": quantize_llama_cpp}[job["engine"]]
    result = run(job)
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
