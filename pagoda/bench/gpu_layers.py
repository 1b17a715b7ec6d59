"""A decoder layer's small kernels fused and apart (``pagoda bench gpu all``'s ``qkv-prepare``
stage): the layers' four launches from the qkv projection to the cache (q norm, k norm, rotary,
``write_kv``) against ``triton_qkv.prepare_qkv``'s one.

For each attention shape at each row count, both ways run once for every layer of the model, as a
decode step runs them; on a GPU inside a CUDA graph (a captured decode step's cost: device time,
no launch overhead), elsewhere eagerly. The result gives microseconds a step for each, their
ratio, and the largest difference of the rotated q and of the written cache between the two.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from pagoda.bench.gpu_attention import time_ms

# (name, q heads, KV heads, head dim, q/k norms, layers): the shapes of the roofline stages.
QKV_SHAPES = (("qwen3-0.6b", 16, 8, 128, True, 28), ("llama3-8b", 32, 8, 128, False, 32))
PAGE = 16


def _step(fn: Callable[[], Any], device: str) -> Callable[[], Any]:
    """``fn`` as what a step replays: a CUDA graph on a GPU (after one eager warm-up run that
    also compiles the kernels), ``fn`` itself elsewhere."""
    if device != "cuda":
        return fn
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_qkv_prepare(rows: tuple[int, ...], shapes: tuple[tuple[str, int, int, int, bool, int], ...], iters: int,
                        device: str, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per ``<shape>/<rows>``: ``unfused_us`` and ``fused_us`` a step (every layer once),
    ``unfused_over_fused``, and ``max_q_diff`` / ``max_cache_diff`` between the two ways."""
    from pagoda.layers import fused_ops
    from pagoda.layers.attention.triton_kernels import write_kv
    from pagoda.layers.attention.triton_qkv import prepare_qkv

    gen = torch.Generator().manual_seed(seed)
    dtype, eps = torch.bfloat16, 1e-6
    out: dict[str, dict[str, float]] = {}
    for name, heads, kv_heads, d, norm, layers in shapes:
        for n in rows:
            qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(device=device, dtype=dtype)
            positions = torch.randint(0, 4096, (n,), generator=gen).to(device)
            freqs = torch.outer(torch.arange(4096).float(), 1e6 ** (-torch.arange(d // 2).float() / (d // 2)))
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)
            qw = kw = None
            if norm:
                qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
                kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
            blocks = -(-n // PAGE) + 1
            caches = {way: [torch.zeros(blocks, PAGE, kv_heads, d, dtype=dtype, device=device) for _ in range(2)]
                      for way in ("unfused", "fused")}
            slots = torch.arange(n, device=device)

            def unfused(caches=caches["unfused"], qkv=qkv, qw=qw, kw=kw, table=table, positions=positions,
                        slots=slots, heads=heads, kv_heads=kv_heads, d=d) -> torch.Tensor:
                """Every layer's four launches; the rotated q (the same each layer)."""
                for _ in range(layers):
                    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
                    q, k, v = q.view(-1, heads, d), k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
                    if qw is not None:
                        q, k = fused_ops.rms_norm(q, qw, eps), fused_ops.rms_norm(k, kw, eps)
                    q, k = fused_ops.apply_rotary(q, k, positions, table)
                    write_kv(k, v, *caches, slots)
                return q

            buf = qkv.clone()

            def fused(caches=caches["fused"], buf=buf, qw=qw, kw=kw, table=table, positions=positions, slots=slots,
                      heads=heads, kv_heads=kv_heads, d=d) -> None:
                # Each layer rotates the last one's output again: other values, the same work.
                for _ in range(layers):
                    prepare_qkv(buf, heads, kv_heads, d, positions, table, qw, kw, eps, *caches, slots)

            r: dict[str, float] = {}
            r["unfused_us"] = time_ms(_step(unfused, device), iters) * 1e3
            r["fused_us"] = time_ms(_step(fused, device), iters) * 1e3
            r["unfused_over_fused"] = r["unfused_us"] / r["fused_us"]
            q_unfused = unfused()
            buf.copy_(qkv)
            q_fused = prepare_qkv(buf, heads, kv_heads, d, positions, table, qw, kw, eps, *caches["fused"], slots)[0]
            r["max_q_diff"] = (q_unfused.float() - q_fused.float()).abs().max().item()
            r["max_cache_diff"] = max((a.float() - b.float()).abs().max().item()
                                      for a, b in zip(caches["unfused"], caches["fused"]))
            out[f"{name}/{n}"] = r
    return out


def summary(results: dict[str, Any]) -> str:
    cases = results.get("cases")
    if not cases:
        return ""
    parts = [f"{key} {r['unfused_us']:.0f} -> {r['fused_us']:.0f} us ({r['unfused_over_fused']:.2f}x)"
             for key, r in cases.items()]
    worst = max(max(r["max_q_diff"], r["max_cache_diff"]) for r in cases.values())
    return "4 launches -> 1 a layer, a step's worth: " + "; ".join(parts) + f"; max diff {worst:.1e}"


# (name, N, K) of the Qwen3-0.6B shape's projections (q/k/v fused, o, gate/up fused, down).
QWEN3_06B_GEMMS = (("0.6b-qkv", 4096, 1024), ("0.6b-o", 1024, 2048), ("0.6b-gate_up", 6144, 1024),
                   ("0.6b-down", 1024, 3072))


def measure_skinny_gemm(rows: tuple[int, ...], shapes: tuple[tuple[str, int, int], ...], iters: int, device: str,
                        seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per ``<shape>/<rows>``: cuBLAS (``F.linear``) and each ``skinny_gemm.configs`` entry in
    microseconds, the best config, ``cublas_over_best``, the weight bytes a second of the faster,
    the config's largest difference from cuBLAS relative to the output's scale, and which
    ``SkinnyChoice`` kept in ``auto`` mode. On CUDA every run starts from a cold L2 (as a decode
    step's weights do: ``skinny_gemm.cold_ms``)."""
    import torch.nn.functional as F

    from pagoda.layers import skinny_gemm

    time_ms = cold_timer(device)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, Any]] = {}
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device=device, dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            ref = F.linear(x, w)
            r: dict[str, Any] = {"cublas_us": time_ms(lambda x=x, w=w: F.linear(x, w), iters) * 1e3}
            configs = {}
            for config in skinny_gemm.configs(False, m):
                got = skinny_gemm.skinny_matmul(x, w, None, config)
                err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                us = time_ms(lambda x=x, w=w, c=config: skinny_gemm.skinny_matmul(x, w, None, c), iters) * 1e3
                configs[config.label()] = {"us": us, "rel_err": err}
            best = min(configs, key=lambda c: configs[c]["us"])
            r.update(configs=configs, best=best, best_us=configs[best]["us"],
                     cublas_over_best=r["cublas_us"] / configs[best]["us"],
                     max_rel_err=max(c["rel_err"] for c in configs.values()))
            r["weight_bytes_per_s"] = 2 * n * k / (min(r["cublas_us"], r["best_us"]) / 1e6)
            if device == "cuda":
                choice = skinny_gemm.SkinnyChoice()
                choice.mode = "auto"
                choice.linear(x, w, None)
                kept = next(iter(choice.winners.values()))
                r["chosen"] = "cublas" if kept < 0 else skinny_gemm.configs(False, m)[kept].label()
            if name.endswith("down"):  # the MLP's activation folded into the down projection
                r["silu_mul"] = _silu_mul_case(x, w, iters, time_ms)
            out[f"{name}/{m}"] = r
    return out


def cold_timer(device: str) -> Callable[[Callable[[], Any], int], float]:
    """Milliseconds of a call: from a cold L2 on CUDA, the plain loop elsewhere (dry run)."""
    from pagoda.layers import skinny_gemm

    return skinny_gemm.cold_ms if device == "cuda" else time_ms


def _silu_mul_case(x: torch.Tensor, w: torch.Tensor, iters: int,
                   time_ms: Callable[[Callable[[], Any], int], float]) -> dict[str, Any]:
    """The SiLU-and-mul kernel then cuBLAS against the folded kernel's configs, on gate | up rows
    ``[M, 2K]`` made from ``x``."""
    from pagoda.layers import skinny_gemm
    from pagoda.layers.fused_ops import silu_and_mul

    gate_up = torch.cat([x, x.flip(-1)], dim=-1)
    ref = torch.nn.functional.linear(silu_and_mul(gate_up), w)
    r: dict[str, Any] = {"apart_us": time_ms(lambda: skinny_gemm._peer(gate_up, w, None, True), iters) * 1e3}
    folded = {}
    for config in skinny_gemm.configs(True, x.shape[0]):
        got = skinny_gemm.skinny_matmul(gate_up, w, None, config, silu_mul=True)
        folded[config.label()] = {
            "us": time_ms(lambda c=config: skinny_gemm.skinny_matmul(gate_up, w, None, c, True), iters) * 1e3,
            "rel_err": ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()}
    best = min(folded, key=lambda c: folded[c]["us"])
    r.update(configs=folded, best=best, apart_over_folded=r["apart_us"] / folded[best]["us"])
    return r


def summary_skinny(results: dict[str, Any]) -> str:
    cases = results.get("cases")
    if not cases:
        return ""
    parts = [f"{key} {r['cublas_over_best']:.2f}x ({r['weight_bytes_per_s'] / 1e12:.2f} TB/s)"
             + (f", silu+down apart/folded {r['silu_mul']['apart_over_folded']:.2f}x" if "silu_mul" in r else "")
             for key, r in cases.items()]
    return "cuBLAS / best kernel: " + "; ".join(parts) + f"; max rel err {max(r['max_rel_err'] for r in cases.values()):.1e}"


def measure_decode_splits(contexts: tuple[int, ...], splits: tuple[int, ...], layers: int, iters: int, device: str,
                          seed: int = 0) -> dict[str, dict[str, Any]]:
    """Batch-1 decode attention (the Llama-3-8B heads: 32 query, 8 KV of 128), a step's worth
    (``layers`` calls; in a CUDA graph on a GPU) at each context length and split count: a decode
    graph pins the split count from ``max_model_len`` (16 at 4,096), while one split needs no
    merge launch. Per ``<context>``: microseconds per split count, the fastest, and what the
    eager planner would choose (``choose_num_splits``)."""
    from pagoda.bench.gpu_attention import KV_HEADS, paged_step
    from pagoda.layers.attention import triton_kernels as tk

    out: dict[str, dict[str, Any]] = {}
    for context in contexts:
        (q, _, _, k_cache, v_cache, meta, scale), _ = paged_step([1], [context - 1], torch.bfloat16, device, seed)
        r: dict[str, Any] = {"us": {}}
        for n in splits:
            def step(n=n, q=q, k_cache=k_cache, v_cache=v_cache, meta=meta, scale=scale) -> None:
                for _ in range(layers):
                    tk.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                              num_splits=n)
            r["us"][str(n)] = time_ms(_step(step, device), iters) * 1e3
        r["fastest"] = min(r["us"], key=r["us"].get)
        r["eager_choice"] = tk.choose_num_splits(1, KV_HEADS, context, tk._device_sm_count(q.device))
        out[str(context)] = r
    return out


def summary_splits(results: dict[str, Any]) -> str:
    cases = results.get("cases")
    if not cases:
        return ""
    parts = [f"{ctx}: " + ", ".join(f"{n} split{'s' if n != '1' else ''} {us:.0f}" for n, us in r["us"].items())
             + f" us (fastest {r['fastest']}, eager plans {r['eager_choice']})" for ctx, r in cases.items()]
    return f"batch-1 decode attention x {results['layers']} layers: " + "; ".join(parts)
