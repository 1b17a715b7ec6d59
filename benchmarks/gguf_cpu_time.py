"""CPU time of a decode step of pagoda and of llama.cpp on the same GGUF, one thread each: a
load-robust estimate of the batch-1 / batch-8 ratio where ``pagoda bench peers`` (wall clock,
all threads) is swamped by other processes on a shared machine. ``time.thread_time`` counts only
the time the thread ran, so a descheduled thread costs nothing (cache pollution by the other
processes still does).

pagoda runs through its engine (``LLM``: scheduling and sampling included); llama.cpp through
``peers_child``'s batched engine (one ``llama_decode`` over all sequences per step). Each: 64-token
prompts, ``--tokens`` greedy tokens, ``--runs`` times; printed as ms of CPU per decode step of the
whole batch.

    PYTHONPATH=$PWD:/tmp/llamabuild/site PAGODA_CPU_ISA=avx2 OMP_NUM_THREADS=1 \\
      python benchmarks/gguf_cpu_time.py /tmp/q4km-peers/bench-model-*-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import time


def _prompts(batch: int) -> list[list[int]]:
    return [list(range(100 + i, 164 + i)) for i in range(batch)]


def pagoda_ms(path: str, batch: int, tokens: int, runs: int) -> float:
    """pagoda's CPU ms per decode step of ``batch`` sequences (the prefill step left out)."""
    import torch

    from pagoda import LLM, SamplingParams

    llm = LLM(path, kv_cache_memory=64 << 20, max_model_len=512, dtype="float32", enable_prefix_caching=False,
              max_num_seqs=batch)
    torch.set_num_threads(1)
    try:
        eng, total = llm.engine, 0.0
        params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
        for r in range(runs + 1):  # the first run warms up
            for i, p in enumerate(_prompts(batch)):
                eng.add_request(f"cpu-{r}-{i}", {"prompt_token_ids": p}, params)
            eng.step()  # the prefill (and the first token)
            start = time.thread_time()
            while eng.has_unfinished_requests():
                eng.step()
            total += (time.thread_time() - start) if r else 0.0
    finally:
        llm.shutdown()
    return total / (runs * tokens) * 1e3


def llama_cpp_ms(path: str, batch: int, tokens: int, runs: int) -> float:
    """llama.cpp's CPU ms per decode step of ``batch`` sequences (a prefill-only call subtracted)."""
    from pagoda.bench.peers_child import _LlamaCpp

    eng = _LlamaCpp(path, 1, batch, 2048, 512, True)
    try:
        eng.generate(_prompts(batch), 2)  # warm-up
        cpu = {}
        for n in (1, tokens + 1):
            start = time.thread_time()
            for _ in range(runs):
                eng.generate(_prompts(batch), n)
            cpu[n] = (time.thread_time() - start) / runs
    finally:
        eng.close()
    return (cpu[tokens + 1] - cpu[1]) / tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--engines", default="pagoda,llama.cpp")
    args = ap.parse_args()
    for engine in args.engines.split(","):
        run = {"pagoda": pagoda_ms, "llama.cpp": llama_cpp_ms}[engine]
        for b in (int(v) for v in args.batch_sizes.split(",")):
            print(f"{engine} batch {b}: {run(args.gguf, b, args.tokens, args.runs):.2f} ms of CPU per decode step")


if __name__ == "__main__":
    main()
