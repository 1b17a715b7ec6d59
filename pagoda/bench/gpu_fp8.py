"""``pagoda bench gpu all``'s fp8 stage: W8A8 decode against bf16 at batch 32 on the Llama-3-8B
shape, and how often the fp8 model's greedy tokens agree with bf16's, on those random weights and
on the trained built-in model (``gpu_stages.py`` holds the other stages and what they share)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pagoda.bench import gpu
from pagoda.bench.gpu_model import bench_shape_dir
from pagoda.bench.gpu_stages import BARS, Ctx, NotAvailable, Out, Plan, env_set, fp8_unavailable


def _fp8_matmul(mode: str | None):
    """``PAGODA_FP8_MATMUL=mode`` inside (None: left as it is); restored after."""
    from pagoda.layers.quantization.fp8_w8a8 import ENV

    return env_set(ENV, mode)


def _kernels(llm: Any) -> list[str]:
    model = llm.engine.core.executor.model
    return sorted({m.qlinear.kernel for m in model.modules() if getattr(m, "qlinear", None) is not None})


def _greedy(llm: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def teacher_forced_agreement(llm: Any, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of the ``reference`` continuations' positions at which ``llm``'s own greedy
    choice, given the reference's prefix, is the reference token (its top-1 prompt logprob)."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, reference)], params, use_tqdm=False)
    same = total = 0
    for prompt, ref, out in zip(prompts, reference, outs):
        for j, token in enumerate(ref):
            entry = out.prompt_logprobs[len(prompt) + j]
            same += max(entry, key=entry.get) == token
            total += 1
    return same / max(total, 1)


def stage_fp8_w8a8(ctx: Ctx, out: Out) -> None:
    """Decode tok/s at ``plan.fp8_batch`` on the Llama-3-8B shape in bf16, then with the same
    (seeded) weights quantized to fp8 online and multiplied W8A8; the ratio; and how often the
    fp8 model's greedy tokens agree with bf16's: teacher-forced (fp8's choice given bf16's
    prefix, the bar's measure) and free-running (position by position); and, as the level to
    read it against, the teacher-forced agreement of the same fp8 weights run weight-only."""
    plan = ctx.plan
    reason = fp8_unavailable()
    if reason is not None:
        raise NotAvailable(reason)
    model_dir = bench_shape_dir("llama3-8b", plan.shapes["llama3-8b"])
    rng = random.Random(plan.seed)
    vocab = gpu._vocab_size(model_dir)
    prompts = [[rng.randrange(16, vocab) for _ in range(plan.roofline_input_len)] for _ in range(plan.fp8_batch)]
    seqs, tokens = plan.fp8_agree
    out.update(shape="llama3-8b", batch=plan.fp8_batch, input_len=plan.roofline_input_len,
               output_len=plan.fp8_output_len, agreement_seqs=seqs, agreement_tokens=tokens)
    max_len = plan.roofline_input_len + max(plan.fp8_output_len, tokens) + 1
    # The dry run has no fp8 card: it forces W8A8 on CPU, to walk through the same kernels.
    with _fp8_matmul("w8a8" if plan.dry_run else None):
        reference = _decode_and_greedy(plan, model_dir, None, prompts, max_len, out)
        fp8_tokens = _decode_and_greedy(plan, model_dir, "fp8", prompts, max_len, out, reference)
    out["ratio"] = out["fp8"]["decode_tokens_per_s"] / out["bf16"]["decode_tokens_per_s"]
    out["agreement_free_running"] = (sum(a == b for f, r in zip(fp8_tokens, reference) for a, b in zip(f, r))
                                     / max(1, sum(len(r) for r in reference)))
    # The level: the same fp8 weights with activations unquantized (weight-only), which loses
    # only what rounding the weights to e4m3 loses.
    with _fp8_matmul("weight-only"):
        from pagoda import LLM

        llm = LLM(**gpu.engine_kwargs(model_dir, max_len, True, 0.9, max_num_seqs=seqs, quantization="fp8"))
        try:
            out["agreement_teacher_forced_weight_only"] = teacher_forced_agreement(llm, prompts[:seqs], reference)
        finally:
            llm.shutdown()
    with _fp8_matmul("w8a8" if plan.dry_run else None):
        out["trained"] = trained_fp8_agreement(*plan.fp8_trained)


def stage_fp8_kernels(ctx: Ctx, out: Out) -> None:
    """Where batch-``plan.fp8_batch`` decode steps of the Llama-3-8B shape spend their device
    time, bf16 then fp8 (``gpu_kernels.profile_decode``, async scheduling as the fp8 stage runs)."""
    from pagoda.bench import gpu_kernels

    plan = ctx.plan
    reason = fp8_unavailable()
    if reason is not None:
        raise NotAvailable(reason)
    model_dir = bench_shape_dir("llama3-8b", plan.shapes["llama3-8b"])
    out.update(shape="llama3-8b", batch=plan.fp8_batch)
    with _fp8_matmul("w8a8" if plan.dry_run else None):
        for key, quantization in (("bf16", None), ("fp8", "fp8")):
            out[key] = gpu_kernels.profile_decode(model_dir, plan.fp8_batch, plan.roofline_input_len,
                                                  plan.kernel_profile_steps // 2, gpu_memory_utilization=0.9,
                                                  seed=plan.seed, async_scheduling=True, quantization=quantization)
            gpu.free_device_memory()


def summary_fp8_kernels(out: Out) -> str:
    from pagoda.bench import gpu_kernels

    return " | ".join(f"{key}: {gpu_kernels.summary(out[key])}" for key in ("bf16", "fp8") if key in out)


def trained_fp8_agreement(seqs: int, prompt_len: int, tokens: int) -> dict[str, Any]:
    """The agreement on a trained model, whose peaked distributions the bar is meant for (random
    weights' flat logits flip under any rounding): the built-in model (docs/demo-model.md) in bf16
    continues ``seqs`` cuts of its held-out English text greedily; then the same checkpoint
    quantized to fp8 online (W8A8 where the card multiplies in fp8), teacher-forced on those
    continuations, and run weight-only as the level; and bf16 teacher-forced on its own tokens
    (the prompt-logprob path against generation: what agreement ties leave)."""
    from transformers import AutoTokenizer

    from pagoda import LLM
    from pagoda.bench.spec import natural_workload
    from pagoda.tools.make_model import builtin_model_path

    path = builtin_model_path("main")
    if path is None:
        raise NotAvailable("the built-in trained model is not installed (pagoda/demo_model)")
    prompts = natural_workload(seqs, prompt_len, AutoTokenizer.from_pretrained(path), 0)
    kwargs = dict(model=str(path), dtype="bfloat16", device=gpu.DEVICE, max_model_len=prompt_len + tokens + 1,
                  kv_cache_memory=64 << 20, max_num_seqs=seqs)
    result: dict[str, Any] = {"model": "built-in (pagoda/demo_model/main)", "seqs": seqs, "tokens": tokens}
    llm = LLM(**kwargs)
    try:
        reference = _greedy(llm, prompts, tokens)
        result["bf16_self"] = teacher_forced_agreement(llm, prompts, reference)
    finally:
        llm.shutdown()
    for key, mode in (("fp8", None), ("fp8_weight_only", "weight-only")):
        with _fp8_matmul(mode):
            llm = LLM(quantization="fp8", **kwargs)
            try:
                result[key] = teacher_forced_agreement(llm, prompts, reference)
                if key == "fp8":
                    result["fp8_kernels"] = _kernels(llm)
            finally:
                llm.shutdown()
    return result


def _decode_and_greedy(plan: Plan, model_dir: Path, quantization: str | None, prompts: list[list[int]],
                       max_len: int, out: Out, reference: list[list[int]] | None = None) -> list[list[int]]:
    """One engine (async scheduling, so that the ratio is of the device's work): its decode
    tok/s into ``out["bf16"]`` or ``out["fp8"]``, its teacher-forced
    agreement with ``reference`` (when given) into ``out``; returns its greedy continuations of
    the agreement prompts."""
    from pagoda import LLM

    seqs, tokens = plan.fp8_agree
    llm = LLM(**gpu.engine_kwargs(model_dir, max_len, False, 0.9, max_num_seqs=plan.fp8_batch,
                                  quantization=quantization, async_scheduling=True))
    try:
        gpu.time_decode(llm, prompts, min(plan.fp8_output_len, 16))  # warm-up
        seconds, made = gpu.time_decode(llm, prompts, plan.fp8_output_len)
        out[quantization or "bf16"] = {"decode_tokens_per_s": made / seconds, "kernels": _kernels(llm),
                                       "step_ms": 1000 * seconds * plan.fp8_batch / made}
        if reference is not None:
            out["agreement_teacher_forced"] = teacher_forced_agreement(llm, prompts[:seqs], reference)
        return _greedy(llm, prompts[:seqs], tokens)
    finally:
        llm.shutdown()


def summary_fp8_w8a8(out: Out) -> str:
    if "ratio" not in out:
        return ""
    text = (f"batch {out['batch']}: fp8 {out['fp8']['decode_tokens_per_s']:,.0f} against bf16 "
            f"{out['bf16']['decode_tokens_per_s']:,.0f} tok/s = {out['ratio']:.2f}x (bar {BARS['fp8_ratio']:.1f}x), "
            f"kernels {'/'.join(out['fp8']['kernels'])}")
    if "agreement_teacher_forced" in out:
        text += (f"; greedy agreement {out['agreement_teacher_forced']:.1%} teacher-forced "
                 f"(bar {BARS['fp8_agreement']:.0%}), {out.get('agreement_free_running', 0.0):.1%} free-running")
    if "agreement_teacher_forced_weight_only" in out:
        text += f"; weight-only fp8 {out['agreement_teacher_forced_weight_only']:.1%} teacher-forced"
    trained = out.get("trained")
    if trained:
        text += (f"; trained built-in model: {'/'.join(trained['fp8_kernels']) or 'fp8'} {trained['fp8']:.1%} "
                 f"teacher-forced (weight-only {trained['fp8_weight_only']:.1%}, bf16 itself "
                 f"{trained['bf16_self']:.1%})")
    return text
