"""The stages of ``pagoda bench gpu all`` (gpu_all.py runs them inside the budget).

Each stage is a function ``(ctx, out)`` that fills the dict ``out`` with its figures as it
measures them (so a stage stopped at its allotment keeps what it had), may raise
``NotAvailable`` where the card or pagoda lacks what it measures (or ``Skipped`` where the time
left is too short for it), and has a one-line summary for the table. ``Plan`` holds the sizes:
the real ones on a GPU, tiny ones in the dry run, which walks through the same code on CPU.
The fp8 W8A8 stage lives in ``gpu_fp8.py``, the PDL and 8B kernel-gap stages in
``gpu_decode_gaps.py``, the kernel measurements in ``gpu_layers.py``,
``gpu_gemm.py``, ``gpu_attention.py`` and ``gpu_sync.py``.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from pagoda.bench import async_sched, gpu, gpu_kernels, step_profile
from pagoda.bench.common import random_workload
from pagoda.bench.gpu_model import SHAPES, Shape, bench_shape_dir, write_random_model


@contextlib.contextmanager
def env_set(name: str, value: str | None) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` inside (None: left as it is), as it was
    after: a stage's switch for the engines it builds."""
    if value is None:
        yield
        return
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


# What issue 41 asks of an H100 / H200 (quoted in the table beside each figure).
BARS = {"qwen3-0.6b": 0.60, "llama3-8b": 0.85, "throughput_tok_s": 20000.0, "hf_ratio": 10.0,
        "fp8_ratio": 1.5, "fp8_agreement": 0.95}
# The throughput stage's synchronous run starts only with this much time left: its estimate from
# the async run (a factor of its time, plus an engine's start and CUDA graph capture).
SYNC_RUN_FACTOR, SYNC_RUN_START_S = 1.6, 25.0

SMOKE_SHAPE = Shape("llama", 256, 4, 4, 2, 64, 512, 2048, False, 2048, 500000.0,
                    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 512})
TINY_SHAPES = {
    "llama3-8b": Shape("llama", 64, 2, 4, 2, 16, 128, 300, False, 256, 10000.0,
                       {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}),
    "qwen3-0.6b": Shape("qwen3", 64, 2, 4, 2, 32, 96, 300, True, 256, 1000000.0),
}


# A small random Qwen3-MoE checkpoint (make_model): 16 experts, 4 per token, sparse every layer.
MOE_MODEL = dict(arch="qwen3_moe", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                 vocab_size=2048, intermediate_size=512, dtype="bfloat16",
                 extra_config=dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                                   norm_topk_prob=True))
TINY_MOE_MODEL = dict(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      vocab_size=512, intermediate_size=64, dtype="bfloat16",
                      extra_config=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True))


class NotAvailable(Exception):
    """The stage cannot measure here (the card or pagoda lacks the path); not a failure."""


class Skipped(Exception):
    """The stage found too little time left for its smallest measurement; not a failure."""

# A small dense model whose decode step is launch-bound on a GPU: where graphs show.
LORA_MODEL = dict(arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                  vocab_size=2048, intermediate_size=1024, dtype="bfloat16")
TINY_LORA_MODEL = dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=512, intermediate_size=128, dtype="bfloat16")
LORA_TARGETS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"),
                ("q_proj", "v_proj", "down_proj"))


@dataclass(frozen=True)
class Plan:
    """Sizes of every stage; ``GPU_PLAN`` is the real run, ``DRY_PLAN`` the CPU walk-through."""

    dry_run: bool
    shapes: dict[str, Shape] = field(default_factory=lambda: dict(SHAPES))
    smoke_shape: Shape = SMOKE_SHAPE
    smoke_prompts: int = 4
    smoke_tokens: int = 32
    roofline_input_len: int = 128
    roofline_output_len: int = 256
    num_seqs: int = 256
    input_len: str = gpu.NANO_VLLM_LEN
    output_len: str = gpu.NANO_VLLM_LEN
    hf_batch_size: int = 64
    hf_probe_tokens: int = gpu.PROBE_TOKENS
    attention: tuple[int, int, int, int, int] = (64, 2047, 4, 1024, 20)  # decode seqs x context, prefill, iters
    mla: tuple[int, int, int, int, int, int] = (32, 2047, 128, 512, 64, 20)  # seqs x context, heads, dims, iters
    kernel_profile_steps: int = 64
    async_batches: tuple[int, ...] = (1, 32)  # async scheduling off and on, decode at these batches
    async_output_len: int = 128
    fp8_batch: int = 32  # fp8 W8A8 against bf16: decode at this batch on the Llama-3-8B shape
    fp8_gemm: tuple[int, int] = (32, 20)  # rows x iterations of the fp8 GEMMs beside bf16
    qkv_prepare: tuple[tuple[int, ...], int] = ((1, 32), 50)  # rows, iterations (``gpu_layers.py``)
    skinny: tuple[tuple[int, ...], int] = ((1, 4, 16), 50)  # rows, iterations (``gpu_layers.py``)
    sync_watch: tuple[int, int, int] = (4, 32, 32)  # batch, prompt, tokens (``gpu_sync.py``)
    # decode attention at batch 1: contexts, split counts, layers, iterations (``gpu_layers.py``)
    decode_splits: tuple[tuple[int, ...], tuple[int, ...], int, int] = ((384, 2048), (1, 4, 16), 32, 50)
    fp8_output_len: int = 128
    fp8_agree: tuple[int, int] = (8, 64)  # greedy agreement on this many sequences x tokens
    fp8_trained: tuple[int, int, int] = (16, 64, 64)  # the trained model's agreement: seqs, prompt, tokens
    moe_model: dict[str, Any] = field(default_factory=lambda: dict(MOE_MODEL))  # make_model arguments
    moe_batch: int = 8  # a captured size: graphs and eager run the same shapes
    moe_tokens: int = 32
    lora_model: dict[str, Any] = field(default_factory=lambda: dict(LORA_MODEL))  # make_model arguments
    lora_batch: int = 8  # rows of the adapters and the base model, in turn
    lora_adapters: int = 3  # of LORA_TARGETS
    lora_tokens: int = 64
    pdl_greedy: tuple[int, int] = (4, 64)  # the PDL stage's greedy check: prompts, tokens
    seed: int = 0

    def hf_subsets(self) -> list[int]:
        """Heads of the workload pagoda also runs, so that the whole batches transformers reaches
        in the time left have a pagoda figure on the same requests."""
        return list(range(self.hf_batch_size, self.num_seqs, self.hf_batch_size))


GPU_PLAN = Plan(dry_run=False)
DRY_PLAN = Plan(dry_run=True, shapes=dict(TINY_SHAPES), smoke_shape=TINY_SHAPES["llama3-8b"], smoke_prompts=2,
                smoke_tokens=8, roofline_input_len=12, roofline_output_len=10, num_seqs=6, input_len="5:20",
                output_len="3:12", hf_batch_size=2, hf_probe_tokens=2, attention=(2, 19, 1, 9, 1),
                mla=(2, 19, 16, 32, 16, 1),
                kernel_profile_steps=4, async_batches=(1, 2), async_output_len=6, fp8_batch=2, fp8_output_len=6,
                fp8_gemm=(3, 1), qkv_prepare=((2,), 1), skinny=((2,), 1), decode_splits=((40,), (1, 2), 2, 1),
                sync_watch=(2, 8, 6),
                fp8_agree=(2, 6), fp8_trained=(8, 32, 32),
                moe_model=dict(TINY_MOE_MODEL), moe_batch=2, moe_tokens=6,
                lora_model=dict(TINY_LORA_MODEL), lora_batch=4, lora_tokens=6, lora_adapters=1, pdl_greedy=(2, 6))

Out = dict[str, Any]


@dataclass
class Ctx:
    """What a stage gets: the sizes, the figures of the stages before it (by name) and the
    ``time.monotonic()`` at which it is stopped."""

    plan: Plan
    results: dict[str, Out]
    deadline: float


# --------------------------------------------------------------------------------------
# device
# --------------------------------------------------------------------------------------


def host_copy_bandwidth(nbytes: int = 64 << 20, iters: int = 5) -> float:
    """Bytes/s of a host memory copy (the dry run's stand-in for the device copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    return 2 * nbytes * iters / (time.perf_counter() - start)


def stage_device(ctx: Ctx, out: Out) -> None:
    out.update(torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"),
               device=gpu.DEVICE)
    if gpu.DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(name=props.name, capability=list(torch.cuda.get_device_capability()),
                   memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    out["copy_bandwidth_bytes_per_s"] = gpu.copy_bandwidth() if gpu.DEVICE == "cuda" else host_copy_bandwidth()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def summary_device(out: Out) -> str:
    name = out.get("name", "CPU (dry run)")
    cap = "sm_{}{}, ".format(*out["capability"]) if "capability" in out else ""
    bw = out.get("copy_bandwidth_bytes_per_s")
    return f"{name}, {cap}torch {out.get('torch')}, Triton {out.get('triton')}" + (
        f", copy {bw / 1e9:,.0f} GB/s" if bw else "")


def bandwidth_of(results: dict[str, Out]) -> float:
    """The device stage's copy bandwidth, measured again if that stage did not get to it."""
    measured = results.get("device", {}).get("copy_bandwidth_bytes_per_s")
    if measured:
        return measured
    return gpu.copy_bandwidth() if gpu.DEVICE == "cuda" else host_copy_bandwidth()


# --------------------------------------------------------------------------------------
# smoke: bf16 greedy decoding against transformers on the same device
# --------------------------------------------------------------------------------------


def stage_smoke(ctx: Ctx, out: Out) -> None:
    """A tiny random checkpoint (written: a few MB) through pagoda in bf16 on the device (CUDA
    graphs on), teacher-forced through transformers in float32 (exact) and bf16 (how far one
    correct bf16 implementation lands on this model: the level). pagoda's logprobs must lie
    within 1.5 x the level (+ 0.05 nats) of float32's and each greedy token within 2 x the level
    (+ 0.05) of float32's best: the bf16 check of the GPU tests."""
    from pagoda import LLM, SamplingParams

    plan = ctx.plan
    rng = random.Random(plan.seed)
    prompts = [[rng.randrange(16, plan.smoke_shape.vocab_size) for _ in range(rng.randint(5, 40))]
               for _ in range(plan.smoke_prompts)]
    with tempfile.TemporaryDirectory(prefix="pagoda-smoke-") as tmp:
        model_dir = write_random_model(Path(tmp) / "m", plan.smoke_shape, torch.device(gpu.DEVICE))
        max_len = min(512, plan.smoke_shape.max_position_embeddings)
        llm = LLM(**gpu.engine_kwargs(model_dir, max_len, False, 0.9, load_format="auto", max_num_seqs=8,
                                      kv_cache_memory=gpu.CPU_KV_CACHE_BYTES))  # a small cache: quick to set up
        try:
            params = SamplingParams(temperature=0, max_tokens=plan.smoke_tokens, ignore_eos=True, logprobs=5)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            out["cuda_graphs"] = llm.engine.core.executor.decode_graphs is not None
        finally:
            llm.shutdown()
        out.update(_distance_from_float32(model_dir, prompts, outs))
    level, ours, gap = out["bf16_level_nats"], out["logprob_distance_nats"], out["greedy_gap_nats"]
    if level >= 1.0 or ours > 1.5 * level + 0.05 or gap > 2 * level + 0.05:
        raise AssertionError(f"pagoda bf16 is off transformers: logprobs {ours:.3f} nats from float32 "
                             f"(bound {1.5 * level + 0.05:.3f}), greedy gap {gap:.3f} (bound {2 * level + 0.05:.3f})")
    out["passed"] = True


def _distance_from_float32(model_dir: Path, prompts: list[list[int]], outs: list[Any]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    refs = {dt: AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dt).to(gpu.DEVICE).eval()
            for dt in (torch.float32, torch.bfloat16)}
    level = ours = gap = 0.0
    for prompt, result in zip(prompts, outs):
        sample = result.outputs[0]
        ids = torch.tensor([prompt + sample.token_ids], device=gpu.DEVICE)
        with torch.no_grad():
            exact, hf16 = (refs[dt](ids).logits[0].float().log_softmax(-1) for dt in (torch.float32, torch.bfloat16))
        for j, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            pos = len(prompt) - 1 + j
            gap = max(gap, exact[pos].max().item() - exact[pos, token].item())
            for t, value in entry.items():
                ours = max(ours, abs(value - exact[pos, t].item()))
                level = max(level, abs(hf16[pos, t].item() - exact[pos, t].item()))
    return {"bf16_level_nats": level, "logprob_distance_nats": ours, "greedy_gap_nats": gap,
            "tokens_checked": sum(len(o.outputs[0].token_ids) for o in outs)}


def summary_smoke(out: Out) -> str:
    if "logprob_distance_nats" not in out:
        return ""
    return (f"{'pass' if out.get('passed') else 'FAIL'}: {out['tokens_checked']} greedy tokens, logprobs "
            f"{out['logprob_distance_nats']:.3f} nats from float32 (bf16 level {out['bf16_level_nats']:.3f}), "
            f"CUDA graphs {'on' if out.get('cuda_graphs') else 'off'}")


# --------------------------------------------------------------------------------------
# attention, roofline
# --------------------------------------------------------------------------------------


def stage_attention(ctx: Ctx, out: Out) -> None:
    from pagoda.bench.gpu_attention import measure_attention

    plan = ctx.plan
    device = _kernel_device()
    decode_seqs, decode_context, prefill_seqs, prefill_len, iters = plan.attention
    out.update(decode_seqs=decode_seqs, decode_context=decode_context, prefill_seqs=prefill_seqs,
               prefill_len=prefill_len)
    out["results"] = measure_attention(decode_seqs, decode_context, prefill_seqs, prefill_len, iters, plan.seed,
                                       device)


def stage_mla_decode(ctx: Ctx, out: Out) -> None:
    from pagoda.bench.gpu_attention import MLA_TILES, measure_mla_decode

    device = _kernel_device()
    seqs, context, heads, value_dim, rope_dim, iters = ctx.plan.mla
    out.update(seqs=seqs, context=context, heads=heads, value_dim=value_dim, rope_dim=rope_dim)
    tiles = MLA_TILES if device == "cuda" else ((16, 16),)  # the interpreter: one small tile
    # Into ``out`` tile by tile: a stop at the allotment keeps the tiles measured (the engine's first).
    measure_mla_decode(seqs, context, iters, ctx.plan.seed, device, heads, value_dim, rope_dim, tiles, into=out)
    bandwidth = ctx.results.get("device", {}).get("copy_bandwidth_bytes_per_s")
    if bandwidth:
        out["fraction_of_copy"] = out["latent_bytes_per_s"] / bandwidth


def summary_mla_decode(out: Out) -> str:
    if "mla_ms" not in out:
        return ""
    share = f", {out['fraction_of_copy']:.2f} of the copy rate" if "fraction_of_copy" in out else ""
    against = (f"{out['ratio']:.2f}x the generic decode" if "ratio" in out
               else f"{out['mla_ms']:.3f} ms (generic decode: {out.get('generic_error', 'not run')[:60]})")
    return (f"latent kernel {against} ({out['seqs']} x {out['context']}, {out['heads']} heads; tile "
            f"{out['best_tile']}, {out['latent_bytes_per_s'] / 1e9:.0f} GB/s{share}); max diff from float32 "
            f"{out['max_abs_diff']:.1e}")


def _kernel_device() -> str:
    """Where kernel stages run: the GPU where there is one (the dry run keeps the engines on the
    CPU), else the CPU under Triton's interpreter."""
    device = "cuda" if torch.cuda.is_available() else gpu.DEVICE
    if device == "cpu" and not _triton_interpreted():
        raise NotAvailable("no GPU, and Triton was imported without its interpreter: run the dry run with "
                           "TRITON_INTERPRET=1 in the environment")
    return device


def _triton_interpreted() -> bool:
    """Whether Triton kernels run under the interpreter in this process (decided when Triton was
    first imported: its own library functions are wrapped then)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


def summary_attention(out: Out) -> str:
    r = out.get("results")
    if not r:
        return ""
    pre = r["prefill"]
    flash = (f", flash varlen / Triton kernel {pre['flash_over_triton']:.2f} (chose {'+'.join(pre['chosen'])})"
             if "flash_over_triton" in pre else "")
    return (f"torch / Triton: decode {r['decode']['ratio']:.2f}x ({out['decode_seqs']} x {out['decode_context']}), "
            f"prefill {pre['ratio']:.2f}x{flash}; max diff {max(x['max_abs_diff'] for x in r.values()):.1e}")


def stage_fp8_gemms(ctx: Ctx, out: Out) -> None:
    """The Llama-3-8B projections at ``plan.fp8_gemm`` rows: bf16, per-channel W8A8 and
    block-scaled W8A8; at decode's few rows also the kernel reading the fp8 weight as stored
    (``gpu_gemm.py``); one tiny shape in the dry run."""
    from pagoda.bench.gpu_gemm import FEW_ROWS, LLAMA3_8B_GEMMS, measure_fp8_few_rows, measure_fp8_gemms

    refusal = fp8_unavailable()
    if refusal is not None:
        raise NotAvailable(refusal)
    rows, iters = ctx.plan.fp8_gemm
    shapes = (("tiny", 64, 256),) if ctx.plan.dry_run else LLAMA3_8B_GEMMS
    out["rows"] = rows
    out["gemms"] = measure_fp8_gemms(rows, shapes, iters, gpu.DEVICE)
    out["few_rows"] = measure_fp8_few_rows(FEW_ROWS if not ctx.plan.dry_run else (2,), shapes, iters, gpu.DEVICE)


def stage_qkv_prepare(ctx: Ctx, out: Out) -> None:
    """A layer's norms, rotary and KV write as four launches and as one (``gpu_layers.py``), a
    step's worth for the Qwen3-0.6B and Llama-3-8B attention shapes; tiny shapes in the dry run."""
    from pagoda.bench.gpu_layers import QKV_SHAPES, measure_qkv_prepare

    device = _kernel_device()
    rows, iters = ctx.plan.qkv_prepare
    shapes = (("tiny", 4, 2, 32, True, 2),) if ctx.plan.dry_run else QKV_SHAPES
    out["cases"] = measure_qkv_prepare(rows, shapes, iters, device, ctx.plan.seed)


def stage_skinny_gemm(ctx: Ctx, out: Out) -> None:
    """The few-rows GEMM's configs against cuBLAS on the Qwen3-0.6B and Llama-3-8B projections
    (``gpu_layers.py``); one tiny shape in the dry run."""
    from pagoda.bench.gpu_gemm import LLAMA3_8B_GEMMS
    from pagoda.bench.gpu_layers import QWEN3_06B_GEMMS, measure_skinny_gemm

    device = _kernel_device()
    rows, iters = ctx.plan.skinny
    shapes = (("tiny-down", 48, 160),) if ctx.plan.dry_run else QWEN3_06B_GEMMS + LLAMA3_8B_GEMMS
    out["cases"] = measure_skinny_gemm(rows, shapes, iters, device, ctx.plan.seed)


def stage_decode_splits(ctx: Ctx, out: Out) -> None:
    """Batch-1 decode attention at short and long contexts with one split and with the counts a
    decode graph pins (``gpu_layers.py``)."""
    from pagoda.bench.gpu_layers import measure_decode_splits

    device = _kernel_device()
    contexts, splits, layers, iters = ctx.plan.decode_splits
    out["layers"] = layers
    out["cases"] = measure_decode_splits(contexts, splits, layers, iters, device, ctx.plan.seed)


def stage_sync_watch(ctx: Ctx, out: Out) -> None:
    """Greedy decode of the Qwen3-0.6B shape with async scheduling under torch's CUDA sync debug
    mode: synchronizing calls a step and the pagoda lines that make them (``gpu_sync.py``)."""
    from pagoda.bench.gpu_sync import measure_decode_syncs

    plan = ctx.plan
    batch, input_len, tokens = plan.sync_watch
    model_dir = bench_shape_dir("qwen3-0.6b", plan.shapes["qwen3-0.6b"])
    out.update(shape="qwen3-0.6b", **measure_decode_syncs(model_dir, batch, input_len, tokens, plan.seed))


def fp8_unavailable() -> str | None:
    """Why the fp8 roofline cannot run on this card with pagoda's kernels (None when it can)."""
    if gpu.DEVICE != "cuda":
        return None  # the dry run walks through the stage on CPU
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"the card (sm_{major}{minor}) has no fp8 (Ada or Hopper, sm_89+)"
    from pagoda.layers.quantization.fp8_w8a8 import ENV, Fp8ScaledMM
    from pagoda.layers.quantization.online import Fp8LinearMethod

    probe = Fp8LinearMethod().quantize(None, torch.randn(256, 256, device="cuda", dtype=torch.bfloat16))
    if probe.kernel != Fp8ScaledMM.kernel:
        return f"pagoda's fp8 layers run weight-only here ({probe.kernel} kernel; {ENV}={os.environ.get(ENV, 'auto')})"
    return None


def roofline_stage(shape: str, quantization: str | None) -> Callable[[Ctx, Out], None]:
    def stage(ctx: Ctx, out: Out) -> None:
        plan = ctx.plan
        if quantization == "fp8":
            reason = fp8_unavailable()
            if reason is not None:
                raise NotAvailable(reason)
        model_dir = bench_shape_dir(shape, plan.shapes[shape])
        bandwidth = bandwidth_of(ctx.results)

        def measure(ahead: bool) -> dict[str, Any]:
            return gpu.measure_roofline(model_dir, bandwidth, 1, plan.roofline_input_len, plan.roofline_output_len,
                                        seed=plan.seed, quantization=quantization, async_scheduling=ahead)

        # With async scheduling (the host's work for the next step beside this one's forward);
        # should that fail here, the synchronous engine's figure, with the error kept.
        try:
            result = measure(True)
        except Exception as exc:  # noqa: BLE001 - reported, and the bar still gets a figure
            out["async_error"] = f"{type(exc).__name__}: {exc}"
            gpu.free_device_memory()
            result = measure(False)
        out.update(shape=shape, **result)

    return stage


def stage_decode_kernels(ctx: Ctx, out: Out) -> None:
    """Per-kernel device time of batch-1 decode steps on the Qwen3-0.6B shape, and the host gap,
    with async scheduling off and then on (``async``: as the roofline runs)."""
    plan = ctx.plan
    model_dir = bench_shape_dir("qwen3-0.6b", plan.shapes["qwen3-0.6b"])
    out.update(shape="qwen3-0.6b", **gpu_kernels.profile_decode(model_dir, 1, plan.roofline_input_len,
                                                                 plan.kernel_profile_steps, seed=plan.seed))
    gpu.free_device_memory()
    out["async"] = gpu_kernels.profile_decode(model_dir, 1, plan.roofline_input_len, plan.kernel_profile_steps,
                                              seed=plan.seed, async_scheduling=True)


def stage_host_profile(ctx: Ctx, out: Out) -> None:
    """The host side of batch-1 decode steps of the Qwen3-0.6B shape under cProfile
    (``gpu_kernels.profile_host``): the functions the step's host time goes to; then the same at
    the largest async-scheduling batch (``batch_<n>``)."""
    plan = ctx.plan
    model_dir = bench_shape_dir("qwen3-0.6b", plan.shapes["qwen3-0.6b"])
    out.update(shape="qwen3-0.6b", **gpu_kernels.profile_host(model_dir, 1, plan.roofline_input_len,
                                                               plan.kernel_profile_steps, seed=plan.seed))
    gpu.free_device_memory()
    # A batch whose step is host-bound with async scheduling too (2.9 ms a step at 32, H200):
    # the per-sequence share of the host's work.
    batch = plan.async_batches[-1]
    out[f"batch_{batch}"] = gpu_kernels.profile_host(model_dir, batch, plan.roofline_input_len,
                                                     plan.kernel_profile_steps // 2, seed=plan.seed)


def decode_on_off(model_dir: Path, batch: int, input_len: int, output_len: int, out: dict[str, Any],
                  seed: int = 0) -> None:
    """Decode tok/s of ``batch`` sequences of the model in ``model_dir`` (random weights) with
    async scheduling off and on, into ``out`` as each is measured (``sync``, ``async``, then
    ``ratio``)."""
    from pagoda import LLM

    rng = random.Random(seed)
    vocab = gpu._vocab_size(model_dir)
    prompts = [[rng.randrange(16, vocab) for _ in range(input_len)] for _ in range(batch)]
    base = gpu.engine_kwargs(model_dir, input_len + output_len, False, 0.9, max_num_seqs=batch)
    for name, kwargs in async_sched.engine_modes(base).items():
        llm = LLM(**kwargs)
        try:
            gpu.time_decode(llm, prompts, min(output_len, 16))  # warm-up
            seconds, tokens = gpu.time_decode(llm, prompts, output_len)
        finally:
            llm.shutdown()
        out[name] = {"decode_tokens_per_s": tokens / seconds, "step_ms": 1000 * seconds * batch / tokens}
    out["ratio"] = out["async"]["decode_tokens_per_s"] / out["sync"]["decode_tokens_per_s"]


def stage_async_scheduling(ctx: Ctx, out: Out) -> None:
    """Decode tok/s of the Qwen3-0.6B shape with async scheduling off and on (one decode step per
    schedule both) at each of the plan's batches, and their ratio."""
    plan = ctx.plan
    model_dir = bench_shape_dir("qwen3-0.6b", plan.shapes["qwen3-0.6b"])
    out.update(shape="qwen3-0.6b", input_len=plan.roofline_input_len, output_len=plan.async_output_len)
    for batch in plan.async_batches:
        decode_on_off(model_dir, batch, plan.roofline_input_len, plan.async_output_len,
                                  out.setdefault(f"batch_{batch}", {}), seed=plan.seed)


def summary_async_scheduling(out: Out) -> str:
    parts = [f"batch {key.removeprefix('batch_')}: {r['async']['decode_tokens_per_s']:,.0f} against "
             f"{r['sync']['decode_tokens_per_s']:,.0f} tok/s ({r['ratio']:.2f}x)"
             for key, r in out.items() if key.startswith("batch_") and "ratio" in r]
    return "async / sync scheduling, decode: " + "; ".join(parts) if parts else ""


def summary_roofline(out: Out) -> str:
    if "fraction" not in out:
        return ""
    bar = BARS.get(out["shape"]) if out.get("quantization") is None else None
    ahead = "async scheduling" if out.get("async_scheduling") else f"synchronous ({out.get('async_error', '')})"
    steps = out.get("steps") or {}
    spread = (f"; steps median {steps['median_ms']:.3f} ms, max {steps['max_ms']:.1f}, {steps['slow']} over 3x "
              f"(+{steps['slow_excess_ms']:.0f} ms)" if steps else "")
    return (f"{out['decode_tokens_per_s']:,.1f} tok/s at batch 1 = {out['fraction']:.3f} of the roofline "
            f"({out['roofline_tokens_per_s']:,.1f}; {out['weight_bytes_per_step'] / 1e9:.2f} GB a step; {ahead})"
            + (f"; bar {bar:.2f}" if bar else "") + spread)


# --------------------------------------------------------------------------------------
# MoE decode in CUDA graphs
# --------------------------------------------------------------------------------------


def stage_moe_graphs(ctx: Ctx, out: Out) -> None:
    """A small random Qwen3-MoE checkpoint (written: a few MB) decoded greedily at
    ``plan.moe_batch`` eagerly and with decode CUDA graphs: whether the graphs were captured, the
    fraction of sequences whose greedy tokens are the same, the largest difference of the chosen
    tokens' logprobs before any divergence, and decode tok/s of each (a check of the capture,
    not a speed claim: the model is tiny)."""
    from pagoda import LLM, SamplingParams
    from pagoda.tools.make_model import make_model

    plan = ctx.plan
    rng = random.Random(plan.seed)
    vocab = plan.moe_model["vocab_size"]
    prompts = [[rng.randrange(16, vocab) for _ in range(rng.randint(8, 48))] for _ in range(plan.moe_batch)]
    params = SamplingParams(temperature=0, max_tokens=plan.moe_tokens, ignore_eos=True, logprobs=1, detokenize=False)
    samples: dict[str, list[Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pagoda-moe-") as tmp:
        model_dir = make_model(Path(tmp) / "m", **plan.moe_model)
        for name, eager in (("eager", True), ("graphs", False)):
            llm = LLM(**gpu.engine_kwargs(model_dir, 256, eager, 0.5, load_format="auto",
                                          max_num_seqs=plan.moe_batch))
            try:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                samples[name] = [o.outputs[0] for o in outs]
                seconds, made = gpu.time_decode(llm, prompts, plan.moe_tokens)
                out[name] = {"cuda_graphs": llm.engine.core.executor.decode_graphs is not None,
                             "decode_tokens_per_s": made / seconds}
            finally:
                llm.shutdown()
    out.update(_same_greedy(samples["eager"], samples["graphs"]))


def stage_lora_graphs(ctx: Ctx, out: Out) -> None:
    """A small random Llama checkpoint with ``plan.lora_adapters`` random adapters (written: a few
    MB), decoded greedily at ``plan.lora_batch`` with the rows spread over them and the base model,
    eagerly and with decode CUDA graphs (which hold the LoRA delta in its dense way): captured,
    the same greedy tokens, and generation tok/s of each (a check of the capture with adapter
    rows in it; the model is small, so host overhead dominates and graphs show); then the same
    pair in float32 (``float32``), where rounding cannot tell the two ways apart."""
    from pagoda import LLM, SamplingParams
    from pagoda.lora.request import LoRARequest
    from pagoda.tools.make_lora import make_lora
    from pagoda.tools.make_model import make_model

    plan = ctx.plan
    rng = random.Random(plan.seed)
    vocab = plan.lora_model["vocab_size"]
    prompts = [{"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(rng.randint(8, 48))]}
               for _ in range(plan.lora_batch)]
    params = SamplingParams(temperature=0, max_tokens=plan.lora_tokens, ignore_eos=True, logprobs=1, detokenize=False)
    samples: dict[str, list[Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pagoda-lora-") as tmp:
        model_dir = make_model(Path(tmp) / "m", **plan.lora_model)
        adapters = [LoRARequest(f"a{i}", i + 1, str(make_lora(model_dir, Path(tmp) / f"a{i}", r=16,
                                                               target_modules=targets, seed=i)))
                    for i, targets in enumerate(LORA_TARGETS[:plan.lora_adapters])]
        turn = len(adapters) + 1  # each adapter, then the base model
        rows = [adapters[i % turn] if i % turn < len(adapters) else None for i in range(plan.lora_batch)]
        # bf16 gives the speed; float32 the check. Random adapters make bf16 decoding fragile:
        # on CPU either bf16 path kept none of 8 sequences' 64 greedy tokens equal to float32's,
        # while the dense delta and the per-row one agreed to 6e-5 in float32.
        for dtype, timed in (("bfloat16", True), ("float32", False)):
            for name, eager in (("eager", True), ("graphs", False)):
                llm = LLM(**gpu.engine_kwargs(model_dir, 256, eager, 0.5, load_format="auto",
                                              max_num_seqs=plan.lora_batch, enable_lora=True, max_loras=4,
                                              max_lora_rank=16, dtype=dtype))
                try:
                    samples[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False,
                                                                         lora_request=rows)]
                    if timed:
                        start = time.perf_counter()
                        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=rows)
                        gpu._sync()
                        made = sum(len(o.outputs[0].token_ids) for o in outs)
                        out[name] = {"cuda_graphs": llm.engine.core.executor.decode_graphs is not None,
                                     "tokens_per_s": made / (time.perf_counter() - start)}
                finally:
                    llm.shutdown()
            if timed:
                out.update(_same_greedy(samples["eager"], samples["graphs"]))
            else:
                out["float32"] = _same_greedy(samples["eager"], samples["graphs"])


def summary_lora_graphs(out: Out) -> str:
    line = _graphs_summary(out, "Llama (random, small) with adapter and base rows", "tokens_per_s")
    f32 = out.get("float32")
    return line + (f"; in float32 {f32['same_greedy_fraction']:.0%} (logprobs within {f32['max_logprob_diff']:.1e})"
                   if line and f32 else "")


def _graphs_summary(out: Out, model: str, rate: str) -> str:
    """The line of a stage that decoded eagerly and in graphs (``_same_greedy`` and tok/s)."""
    if "same_greedy_fraction" not in out:
        return ""
    graphs = out["graphs"]
    return (f"{model}: graphs {'captured' if graphs['cuda_graphs'] else 'NOT captured'}; greedy tokens as eager "
            f"on {out['same_greedy_fraction']:.0%} of sequences (logprobs within {out['max_logprob_diff']:.1e}); "
            f"{graphs[rate]:,.0f} against {out['eager'][rate]:,.0f} tok/s eager")


def _same_greedy(a: list[Any], b: list[Any]) -> dict[str, float]:
    same, worst = 0, 0.0
    for x, y in zip(a, b):
        same += x.token_ids == y.token_ids
        for tx, ty, lx, ly in zip(x.token_ids, y.token_ids, x.logprobs, y.logprobs):
            if tx != ty:
                break
            worst = max(worst, abs(lx[tx] - ly[ty]))
    return {"same_greedy_fraction": same / max(len(a), 1), "max_logprob_diff": worst}


def summary_moe_graphs(out: Out) -> str:
    return _graphs_summary(out, "Qwen3-MoE (random, small), decode", "decode_tokens_per_s")


# --------------------------------------------------------------------------------------
# throughput: pagoda, then transformers on the subset the time left allows
# --------------------------------------------------------------------------------------


def _workload(plan: Plan) -> tuple[Path, Any]:
    model_dir = bench_shape_dir("qwen3-0.6b", plan.shapes["qwen3-0.6b"])
    work = random_workload(plan.num_seqs, plan.input_len, plan.output_len, gpu._vocab_size(model_dir), plan.seed)
    return model_dir, work


def stage_throughput(ctx: Ctx, out: Out) -> None:
    """pagoda with async scheduling (the headline and the heads transformers' ratio uses), its
    steps profiled; then, when the time left allows, the synchronous engine on the whole workload
    (``sync``), for the ratio. Should async scheduling fail here, the synchronous figures stand,
    with the error kept."""
    plan = ctx.plan
    model_dir, work = _workload(plan)
    out.update(num_seqs=plan.num_seqs, input_len=plan.input_len, output_len=plan.output_len,
               output_tokens=work.num_output_tokens, prompt_tokens=work.num_prompt_tokens)
    bandwidth = bandwidth_of(ctx.results)
    runs = out.setdefault("pagoda", {})
    try:
        gpu.pagoda_throughput(model_dir, work, plan.hf_subsets(), False, 0.9, runs, async_scheduling=True,
                              bandwidth=bandwidth)
    except Exception as exc:  # noqa: BLE001 - reported, and the bar still gets a figure
        out["async_error"] = f"{type(exc).__name__}: {exc}"
        runs.clear()
        gpu.free_device_memory()
        gpu.pagoda_throughput(model_dir, work, plan.hf_subsets(), False, 0.9, runs, bandwidth=bandwidth)
        return
    gpu.free_device_memory()
    # The synchronous run takes longer than the async one (up to about 1.5x at batch 32) plus an
    # engine's start; it is left out rather than cut off by the stage's alarm.
    needed = SYNC_RUN_FACTOR * runs["all"]["elapsed_s"] + SYNC_RUN_START_S
    if ctx.deadline - time.monotonic() < needed:
        out["sync_skipped"] = f"{needed:.0f} s needed, {ctx.deadline - time.monotonic():.0f} s left"
        return
    sync = gpu.pagoda_throughput(model_dir, work, [], False, 0.9, out.setdefault("sync", {}))
    out["async_over_sync"] = runs["all"]["output_tokens_per_s"] / sync["all"]["output_tokens_per_s"]


def summary_throughput(out: Out) -> str:
    full = out.get("pagoda", {}).get("all")
    if not full:
        return ""
    mode = "async scheduling" if out["pagoda"].get("async_scheduling") else "synchronous"
    text = (f"{full['output_tokens_per_s']:,.0f} output tok/s ({mode}), {out['num_seqs']} seqs "
            f"({out['output_tokens']:,} tokens, {full['elapsed_s']:.1f} s); bar {BARS['throughput_tok_s']:,.0f} "
            "on an H100")
    if "async_over_sync" in out:
        text += (f"; synchronous {out['sync']['all']['output_tokens_per_s']:,.0f} "
                 f"({out['async_over_sync']:.2f}x)")
    if "step_profile" in out["pagoda"]:
        text += "; " + step_profile.describe(out["pagoda"]["step_profile"])
    return text


def stage_throughput_hf(ctx: Ctx, out: Out) -> None:
    plan = ctx.plan
    model_dir, work = _workload(plan)
    out["hf_batch_size"] = plan.hf_batch_size
    try:
        gpu.hf_throughput(model_dir, work, plan.hf_batch_size, ctx.deadline, out.setdefault("hf", {}),
                          plan.hf_probe_tokens)
    finally:  # also when stopped mid-batch: the batches done keep their ratio
        _ratio_on_same_requests(ctx, out)
    if not out["hf"].get("num_seqs"):
        raise Skipped(f"transformers did not finish one batch of {plan.hf_batch_size} in the time left "
                      f"({out['hf'].get('stopped', 'no batch ran')})")


def _ratio_on_same_requests(ctx: Ctx, out: Out) -> None:
    """pagoda's output tok/s over transformers' on the requests transformers finished, where the
    throughput stage measured pagoda on that head of the workload."""
    hf, done = out.get("hf", {}), out.get("hf", {}).get("num_seqs", 0)
    ours = ctx.results.get("throughput", {}).get("pagoda", {})
    same = ours.get("all") if done == ctx.plan.num_seqs else ours.get(str(done))
    if done and same is not None:
        out.update(num_seqs=done, pagoda=same,
                   output_tokens_per_s_ratio_vs_hf=same["output_tokens_per_s"] / hf["output_tokens_per_s"])


def summary_throughput_hf(out: Out) -> str:
    hf = out.get("hf", {})
    if "output_tokens_per_s" not in hf:
        return ""
    text = f"generate {hf['output_tokens_per_s']:,.0f} output tok/s on the first {hf['num_seqs']} seqs"
    if "output_tokens_per_s_ratio_vs_hf" in out:
        text += (f"; pagoda {out['pagoda']['output_tokens_per_s']:,.0f} on the same: "
                 f"{out['output_tokens_per_s_ratio_vs_hf']:.1f}x (bar {BARS['hf_ratio']:.0f}x)")
    if "stopped" in hf:
        text += f"; ended early: {hf['stopped']}"
    return text


