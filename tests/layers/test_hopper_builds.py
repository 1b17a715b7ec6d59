"""Every Triton kernel of the GPU path, at the launch settings its launcher uses, builds for an
H100/H200 (sm_90) without register spills. No GPU needed: Triton lowers to PTX and its bundled
ptxas assembles it (``conftest.compile_for_hopper``, a child process without the interpreter).
It catches what the interpreter lets through but the compiler rejects, and spills. The kernels
are split over two children that run side by side (each pays Python's and Triton's start once).
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

# Attention (triton_kernels.py): decode, prefill, split merge and cache writes.
_ATTENTION_PRELUDE = r"""
import torch
import triton
from pagoda.layers.attention import triton_kernels as tk

meta_ptrs = dict(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_ptr="*i32",
                 context_lens_ptr="*i32", work_ptr="*i32", part_lse_ptr="*fp32",
                 part_acc_ptr="*fp32", slot_ptr="*i64", qk_scale="fp32", softcap_l2="fp32",
                 sinks_ptr="*fp32")

def split_launch(opts):
    opts = dict(opts)
    return opts, opts.pop("num_warps"), opts.pop("num_stages")

"""

# Float and 16-bit caches over every head size and group the launchers plan for.
_ATTENTION_FLOAT = r"""
for dtype, name, shapes in ((torch.bfloat16, "bf16", [(64, 1), (80, 4), (128, 8), (256, 6)]),
                            (torch.float16, "fp16", [(96, 2)])):  # fp16 takes bf16's registers
    types = dict(meta_ptrs, **{n: "*" + name for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr",
                                                       "out_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr")})
    for head_dim, group in shapes:
        consts, warps, stages = split_launch(tk.decode_launch_options(group, head_dim, 16, dtype, True))
        compile_kernel(tk._decode_kernel, types, dict(consts, QUANT=False), warps, stages)
        consts, warps, stages = split_launch(tk.prefill_launch_options(group, head_dim, 16, dtype))
        compile_kernel(tk._prefill_kernel, types, consts, warps, stages)
    for sinks in (False, True):
        compile_kernel(tk._merge_splits_kernel, types, dict(HEAD_DIM=80, D_PAD=128, SPLITS_PAD=16, SINKS=sinks), 4, 1)
    compile_kernel(tk._write_kv_kernel, types, dict(HEAD_DIM=80, D_PAD=128, BLOCK_H=8, PAGE=16,
                                                    **tk.write_kv_quant_options(dtype)), 4, 1)

"""

# Quantized caches, soft-capped scores and attention sinks.
_ATTENTION_OPTIONS = r"""
# Quantized caches (int8 / fp8 values, bf16 scales) under bf16 queries; e5m2 at the larger shape
# only (its conversion differs from e4m3's, its tiles do not).
for cache, cache_dtype in (("i8", torch.int8), ("fp8e4nv", torch.float8_e4m3fn), ("fp8e5", torch.float8_e5m2)):
    types = dict(meta_ptrs, q_ptr="*bf16", out_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16",
                 k_cache_ptr="*" + cache, v_cache_ptr="*" + cache, ks_ptr="*bf16", vs_ptr="*bf16")
    for head_dim, group in ((64, 1), (128, 8))[1 if cache == "fp8e5" else 0:]:
        consts, warps, stages = split_launch(
            tk.decode_launch_options(group, head_dim, 16, torch.bfloat16, True))
        compile_kernel(tk._decode_kernel, types, dict(consts, QUANT=True), warps, stages)
        consts, warps, stages = split_launch(
            tk.prefill_launch_options(group, head_dim, 16, torch.bfloat16, quant=True))
        compile_kernel(tk._prefill_kernel, types, consts, warps, stages)
    compile_kernel(tk._write_kv_kernel, types, dict(HEAD_DIM=128, D_PAD=128, BLOCK_H=8, PAGE=16,
                                                    **tk.write_kv_quant_options(cache_dtype)), 4, 1)

# Soft-capped scores (Gemma 2: heads of 256, groups of 2) under bf16.
types = dict(meta_ptrs, **{n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "ks_ptr", "vs_ptr")})
for head_dim, group in ((256, 2),):
    consts, warps, stages = split_launch(
        tk.decode_launch_options(group, head_dim, 16, torch.bfloat16, True, softcap=True))
    compile_kernel(tk._decode_kernel, types, dict(consts, QUANT=False), warps, stages)
    consts, warps, stages = split_launch(
        tk.prefill_launch_options(group, head_dim, 16, torch.bfloat16, softcap=True))
    compile_kernel(tk._prefill_kernel, types, consts, warps, stages)

# Attention sinks (gpt-oss: heads of 64, groups of 8) under bf16.
for split in (False, True):
    consts, warps, stages = split_launch(tk.decode_launch_options(8, 64, 16, torch.bfloat16, split, sinks=True))
    compile_kernel(tk._decode_kernel, types, dict(consts, QUANT=False), warps, stages)
consts, warps, stages = split_launch(tk.prefill_launch_options(8, 64, 16, torch.bfloat16, sinks=True))
compile_kernel(tk._prefill_kernel, types, consts, warps, stages)
"""

# Fused RMSNorm (with and without the residual add), SiLU-and-mul and rotary (fused_ops.py).
_FUSED_OPS = r"""
from pagoda.layers import fused_ops as fo

for dt in ("bf16", "fp16", "fp32"):
    io = {n: "*" + dt for n in ("x_ptr", "res_ptr", "w_ptr", "y_ptr", "new_res_ptr", "q_ptr",
                                "k_ptr", "q_out_ptr", "k_out_ptr")}
    types = dict(io, pos_ptr="*i64", cache_ptr="*" + dt, eps="fp32")
    compile_kernel(fo._rms_norm_kernel, types, dict(ADD_RESIDUAL=True, BLOCK=8192), 16, 1)
    compile_kernel(fo._rms_norm_kernel, types, dict(ADD_RESIDUAL=False, BLOCK=128), 1, 1)
    compile_kernel(fo._silu_and_mul_kernel, types, dict(BLOCK=1024), 4, 1)
    compile_kernel(fo._rotary_kernel, types, dict(HALF=40, HALF_PAD=64, HEAD_DIM=80, QH_PAD=64,
                                                  KH_PAD=8, PASS_PAD=0), 4, 1)

# The qkv prepare (triton_qkv.py: qk norm, rotary, KV write in one): Qwen3's heads of 128 with the
# norms into bf16, int8 and fp8 caches; a partial rotary without norms into an fp16 cache.
from pagoda.layers.attention import triton_qkv
for dt, cache, cache_dtype, d, half, pass_pad, norm in (
        ("bf16", "bf16", torch.bfloat16, 128, 64, 0, True), ("bf16", "i8", torch.int8, 128, 64, 0, True),
        ("bf16", "fp8e4nv", torch.float8_e4m3fn, 128, 64, 0, True), ("fp16", "fp16", torch.float16, 128, 32, 64, False)):
    types = dict(qkv_ptr="*" + dt, pos_ptr="*i64", cos_sin_ptr="*" + dt, qw_ptr="*" + dt, kw_ptr="*" + dt,
                 k_cache_ptr="*" + cache, v_cache_ptr="*" + cache, slot_ptr="*i64", ks_ptr="*bf16",
                 vs_ptr="*bf16", eps="fp32")
    compile_kernel(triton_qkv._prepare_qkv_kernel, types,
                   dict(HEAD_DIM=d, D_PAD=d, HALF=half, HALF_PAD=half, PASS_PAD=pass_pad, NORM=norm, PAGE=16,
                        **tk.write_kv_quant_options(cache_dtype)), 1, 1)
"""

# The grouped-GEMM experts (moe_triton.py).
_MOE = r"""
from pagoda.layers import moe_triton as mt
for dtype in ("bf16", "fp16"):
    types = dict(a_ptr="*" + dtype, w_ptr="*" + dtype, out_ptr="*" + dtype, sorted_ptr="*i64",
                 block_expert_ptr="*i64", pair_weight_ptr="*fp32", bias_ptr="*" + dtype)
    # gpt-oss's experts add biases (bf16 checkpoints): both products with them there
    for weighted, bias in ((False, False), (True, False)) + (((False, True), (True, True)) if dtype == "bf16" else ()):
        consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, WEIGHTED=weighted, BIAS=bias, PRECISION="tf32",
                      UPCAST=False)
        compile_kernel(mt._grouped_gemm_kernel, types, consts, 8, 2)
"""

# MLA decode (triton_mla.py).
_MLA = r"""
import torch
from pagoda.layers.attention import triton_mla

ptrs = dict(block_tables_ptr="*i32", seq_lens_ptr="*i32", part_lse_ptr="*fp32", part_acc_ptr="*fp32",
            qk_scale="fp32", q_ptr="*bf16", out_ptr="*bf16", scale_ptr="*bf16")
# DeepSeek-V3: 128 heads (16 a rank under TP 8), kv_lora_rank 512, rope 64; pages of 16.
for heads, cache, split in ((128, "bf16", True), (128, "fp8e4nv", True), (16, "bf16", False)):
    opts = triton_mla.mla_decode_launch_options(heads, 512, 64, 16, torch.bfloat16, split)
    warps, stages = opts.pop("num_warps"), opts.pop("num_stages")
    compile_kernel(triton_mla._mla_decode_kernel, dict(ptrs, cache_ptr="*" + cache),
                   dict(opts, QUANT=cache != "bf16"), warps, stages)
"""

# The fp8 per-token quantizer (triton_fp8.py).
_FP8_QUANTIZER = r"""
from pagoda.layers.quantization import triton_fp8 as tf
for dtype in ("bf16", "fp16", "fp32"):
    types = dict(x_ptr="*" + dtype, q_ptr="*fp8e4nv", s_ptr="*fp32")
    for block in (128, 2048):
        compile_kernel(tf._per_token_fp8_kernel, types,
                       dict(FP8_MAX_C=tf.FP8_MAX, MIN_AMAX_C=tf.MIN_AMAX, BLOCK=block), 4, 3)
"""

# The block-scaled fp8 GEMM at decode and prefill tile sizes, and its per-group quantizer.
_FP8_BLOCK = r"""
from pagoda.layers.quantization import triton_fp8 as tf
types = dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", as_ptr="*fp32", ws_ptr="*fp32", out_ptr="*bf16")
for m in (1, 32, 256):
    opts = tf.block_matmul_options(m, 128)
    warps, stages = opts.pop("num_warps"), opts.pop("num_stages")
    compile_kernel(tf._block_fp8_matmul_kernel, types, dict(opts, UPCAST=False), warps, stages)
compile_kernel(tf._per_token_group_fp8_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
               dict(FP8_MAX_C=448.0, MIN_AMAX_C=1e-12, GROUP=128, GROUP_PAD=128), 4, 1)
"""

# The few-rows GEMM (skinny_gemm.py): every config it may choose in bf16, the first of each in fp16
# (16-bit rows and weights either way: the same registers), and its split-K reduce.
_SKINNY = r"""
from pagoda.layers import skinny_gemm as sg
def one_row(types, config, silu_mul, w_scale):
    compile_kernel(sg._gemv_kernel, types, dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                                SPLIT_K=config.split_k, BIAS=config.split_k == 1 and not w_scale,
                                                SILU_MUL=silu_mul, W_SCALE=w_scale), config.warps, config.stages)
for dt in ("bf16", "fp16"):
    types = dict(x_ptr="*" + dt, w_ptr="*" + dt, scale_ptr="*" + dt, bias_ptr="*" + dt, y_ptr="*" + dt,
                 part_ptr="*fp32")
    some = slice(None) if dt == "bf16" else slice(1)
    for silu_mul in (False, True):
        for block_n, block_k, split_k, warps, stages, _ in sg.configs(silu_mul, 2)[some]:
            compile_kernel(sg._skinny_kernel, types, dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                                                         BIAS=split_k == 1, PRECISION="tf32", UPCAST=False,
                                                         SILU_MUL=silu_mul, W_SCALE=False, BLOCK_M=16), warps,
                           stages)
        for config in (sg.SILU_GEMV_CONFIGS if silu_mul else sg.GEMV_CONFIGS)[some]:
            one_row(types, config, silu_mul, False)
    compile_kernel(sg._reduce_kernel, types, dict(SPLIT_K=4, BLOCK=1024, BIAS=True), 4, 1)
# fp8 weights read as stored, bf16 rows (fp8_w8a8.Fp8ScaledMM at a few rows).
types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", scale_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16", part_ptr="*fp32")
for block_m in (16, 32):
    for block_n, block_k, split_k, warps, stages, _ in sg.configs(False, block_m):
        compile_kernel(sg._skinny_kernel, types, dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, BIAS=False,
                                                     PRECISION="tf32", UPCAST=False, SILU_MUL=False, W_SCALE=True,
                                                     BLOCK_M=block_m), warps, stages)
for config in sg.GEMV_CONFIGS:
    one_row(types, config, False, True)

# The decode graphs' input loader (graph_inputs_kernel.py).
from pagoda.executor import graph_inputs_kernel as gik
types = {n: "*i64" for n in ("ids_ptr", "pos_ptr", "slot_ptr", "d_ids_ptr", "d_pos_ptr", "d_slot_ptr")}
types.update({n: "*i32" for n in ("lens_ptr", "ctx_ptr", "bt_ptr", "d_lens_ptr", "d_ctx_ptr", "d_bt_ptr")})
compile_kernel(gik._load_rows_kernel, types, dict(BLOCK_R=gik.BLOCK_R, BLOCK_C=gik.BLOCK_C), 4, 1)

# A greedy round's step (greedy_step_kernel.py): the chunked argmax of bf16 logits, the move on.
from pagoda.executor import greedy_step_kernel as gsk
compile_kernel(gsk._chunk_argmax_kernel, dict(logits_ptr="*bf16", val_ptr="*fp32", idx_ptr="*i32", pos_max="fp32"),
               dict(CHUNK=gsk.CHUNK), 4, 1)
types = {n: "*i64" for n in ("tokens_ptr", "ids_ptr", "pos_ptr", "slot_ptr")}
types.update(val_ptr="*fp32", idx_ptr="*i32", lens_ptr="*i32", ctx_ptr="*i32", bt_ptr="*i32")
compile_kernel(gsk._advance_kernel, types, dict(CHUNKS_PAD=128), 1, 1)
"""

# The one-row GEMV with the (residual add +) RMSNorm folded into its loads (skinny_gemm.norm_linear):
# every config at the widest row it takes in bf16 (the first in fp16), and once without the residual.
_NORM_GEMV = r"""
from pagoda.layers import skinny_gemm as sg
for dt in ("bf16", "fp16"):
    types = dict(x_ptr="*" + dt, res_ptr="*" + dt, nw_ptr="*" + dt, w_ptr="*" + dt, bias_ptr="*" + dt,
                 y_ptr="*" + dt, part_ptr="*fp32", new_res_ptr="*" + dt, eps="fp32")
    for c in sg.NORM_CONFIGS[slice(None) if dt == "bf16" else slice(1)]:
        compile_kernel(sg._norm_gemv_kernel, types, dict(BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
                                                        BIAS=c.split_k == 1, RESIDUAL=True,
                                                        ROW_BLOCK=sg.NORM_MAX_K), c.warps, c.stages)
    c = sg.NORM_CONFIGS[0]
    compile_kernel(sg._norm_gemv_kernel, types, dict(BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
                                                    BIAS=False, RESIDUAL=False, ROW_BLOCK=1024), c.warps, c.stages)
"""


# The dequantizing weight-only matmul (quantization/triton_woq.py: GGUF and int8/int4 checkpoints on a
# GPU): int8 in groups of 32 (Q8_0) and 16 (Q6_K), int4 with zero points in groups of 32, at both
# row tiles its launcher picks.
_WOQ = r"""
from pagoda.layers.quantization import triton_woq as tw
for bits, group, zero in ((8, 32, False), (8, 16, False), (4, 32, True)):
    types = dict(x_ptr="*bf16", q_ptr="*i8" if bits == 8 else "*u8", s_ptr="*fp32", z_ptr="*fp32", y_ptr="*fp32")
    for block_m in (16, 64):
        compile_kernel(tw._woq_kernel, types, dict(GROUP=group, BITS=bits, HAS_ZERO=zero, BLOCK_M=block_m,
                                                   BLOCK_N=64, BLOCK_K=32), 4, 3)  # Triton's default launch
"""


# Two children of about equal work (about 30 s each on one core of the development VM).
_CHILDREN = (_ATTENTION_PRELUDE + _ATTENTION_FLOAT + _FUSED_OPS + _FP8_QUANTIZER + _FP8_BLOCK + _SKINNY,
             _ATTENTION_PRELUDE + _ATTENTION_OPTIONS + _MOE + _MLA + _NORM_GEMV + _WOQ)


def test_every_kernel_builds_for_hopper_without_spills(compile_for_hopper):
    with ThreadPoolExecutor(len(_CHILDREN)) as pool:
        printed = "".join(pool.map(compile_for_hopper, _CHILDREN))
    counts = {name: len(re.findall(rf"^{name} REG:", printed, re.M)) for name in (
        "_decode_kernel", "_prefill_kernel", "_merge_splits_kernel", "_write_kv_kernel", "_rms_norm_kernel",
        "_silu_and_mul_kernel", "_rotary_kernel", "_grouped_gemm_kernel", "_mla_decode_kernel",
        "_per_token_fp8_kernel", "_per_token_group_fp8_kernel", "_block_fp8_matmul_kernel", "_prepare_qkv_kernel",
        "_skinny_kernel", "_gemv_kernel", "_norm_gemv_kernel", "_reduce_kernel", "_load_rows_kernel", "_woq_kernel",
        "_chunk_argmax_kernel", "_advance_kernel")}
    assert counts == {"_decode_kernel": 13, "_prefill_kernel": 12, "_merge_splits_kernel": 4, "_write_kv_kernel": 5,
                      "_rms_norm_kernel": 6, "_silu_and_mul_kernel": 3, "_rotary_kernel": 3,
                      "_grouped_gemm_kernel": 6, "_mla_decode_kernel": 3, "_per_token_fp8_kernel": 6,
                      "_per_token_group_fp8_kernel": 1, "_block_fp8_matmul_kernel": 3,
                      "_prepare_qkv_kernel": 4, "_skinny_kernel": 23, "_gemv_kernel": 17, "_norm_gemv_kernel": 9,
                      "_reduce_kernel": 2,
                      "_load_rows_kernel": 1, "_woq_kernel": 6, "_chunk_argmax_kernel": 1, "_advance_kernel": 1}, counts


# Every kernel that takes ``PDL`` (layers/pdl.py), once launched with programmatic dependent launch:
# its PTX lets the next kernel start and waits for the ones before it (checked in compile_kernel).
_PDL = _ATTENTION_PRELUDE + r"""
from pagoda.layers import fused_ops as fo, skinny_gemm as sg
from pagoda.layers.attention import triton_qkv

bf16 = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr",
                             "x_ptr", "res_ptr", "w_ptr", "y_ptr", "new_res_ptr", "q_out_ptr", "k_out_ptr",
                             "cache_ptr", "scale_ptr", "bias_ptr", "nw_ptr", "qkv_ptr", "cos_sin_ptr", "qw_ptr",
                             "kw_ptr")}
types = dict(meta_ptrs, **bf16, part_ptr="*fp32", pos_ptr="*i64", eps="fp32")
consts, warps, stages = split_launch(tk.decode_launch_options(2, 128, 16, torch.bfloat16, True))
compile_kernel(tk._decode_kernel, types, dict(consts, QUANT=False), warps, stages, launch_pdl=True)
compile_kernel(tk._merge_splits_kernel, types, dict(HEAD_DIM=128, D_PAD=128, SPLITS_PAD=16, SINKS=False), 4, 1,
               launch_pdl=True)
compile_kernel(tk._write_kv_kernel, types, dict(HEAD_DIM=128, D_PAD=128, BLOCK_H=8, PAGE=16,
                                                **tk.write_kv_quant_options(torch.bfloat16)), 4, 1, launch_pdl=True)
compile_kernel(triton_qkv._prepare_qkv_kernel, dict(types, slot_ptr="*i64"),
               dict(HEAD_DIM=128, D_PAD=128, HALF=64, HALF_PAD=64, PASS_PAD=0, NORM=True, PAGE=16,
                    **tk.write_kv_quant_options(torch.bfloat16)), 1, 1, launch_pdl=True)
compile_kernel(fo._rms_norm_kernel, types, dict(ADD_RESIDUAL=True, BLOCK=1024), 4, 1, launch_pdl=True)
compile_kernel(fo._silu_and_mul_kernel, types, dict(BLOCK=1024), 4, 1, launch_pdl=True)
compile_kernel(fo._rotary_kernel, types, dict(HALF=64, HALF_PAD=64, HEAD_DIM=128, QH_PAD=16, KH_PAD=8, PASS_PAD=0),
               4, 1, launch_pdl=True)
gemv = sg.GEMV_CONFIGS[0]
compile_kernel(sg._gemv_kernel, types, dict(BLOCK_N=gemv.block_n, BLOCK_K=gemv.block_k, SPLIT_K=2, BIAS=False,
                                            SILU_MUL=True, W_SCALE=False), gemv.warps, gemv.stages, launch_pdl=True)
compile_kernel(sg._norm_gemv_kernel, types, dict(BLOCK_N=gemv.block_n, BLOCK_K=gemv.block_k, SPLIT_K=1, BIAS=True,
                                                 RESIDUAL=True, ROW_BLOCK=1024), gemv.warps, gemv.stages,
               launch_pdl=True)
compile_kernel(sg._reduce_kernel, types, dict(SPLIT_K=2, BLOCK=1024, BIAS=False), 4, 1, launch_pdl=True)
block_n, block_k, split_k, warps, stages, _ = sg.configs(False, 4)[0]
compile_kernel(sg._skinny_kernel, types, dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, BIAS=split_k == 1,
                                              PRECISION="tf32", UPCAST=False, SILU_MUL=False, W_SCALE=False,
                                              BLOCK_M=16), warps, stages, launch_pdl=True)
"""

PDL_KERNELS = ("_decode_kernel", "_merge_splits_kernel", "_write_kv_kernel", "_prepare_qkv_kernel", "_rms_norm_kernel",
               "_silu_and_mul_kernel", "_rotary_kernel", "_gemv_kernel", "_norm_gemv_kernel", "_reduce_kernel",
               "_skinny_kernel")


def test_decode_path_kernels_build_with_programmatic_dependent_launch(compile_for_hopper):
    printed = compile_for_hopper(_PDL)
    assert sorted(re.findall(r"^(\w+) PDL REG:", printed, re.M)) == sorted(PDL_KERNELS), printed
