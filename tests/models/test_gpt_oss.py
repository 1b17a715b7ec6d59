"""gpt-oss against transformers on random checkpoints (float32, CPU): prompt and decode logprobs
and greedy tokens with prompts past the 8-token window of the sliding layers, the same through
chunked prefill, small blocks, multi-step decode rounds, the prefix cache and preemption; the
options that must be real (sinks, the SwiGLU clamp, the window) checked to matter; the MXFP4
checkpoint format (the dequantizer against transformers' on random data, and a whole MXFP4
checkpoint against transformers loading it); attention sinks in the torch backend against the
formula."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM
from pagoda.layers.quantization.mxfp4 import FP4_VALUES, Mxfp4Experts, dequantize_mxfp4
from tests.models.parity_helpers import LONG_PROMPTS, check_engine_paths, check_greedy, check_logprobs, hf_logprobs, hf_model

PROMPTS = LONG_PROMPTS


@pytest.fixture(scope="module")
def gpt_oss(model_factory):
    model_dir = model_factory("gpt_oss")
    return model_dir, hf_model(model_dir)


def test_gpt_oss_matches_transformers(gpt_oss):
    model_dir, hf = gpt_oss
    llm = check_engine_paths(model_dir, hf, PROMPTS)
    assert llm.config.model.sliding_windows == (8, None)


def _copy(model_dir, tmp_path, name="changed"):
    out = tmp_path / name
    shutil.copytree(model_dir, out)
    return out


@pytest.mark.parametrize("change", ["sinks", "swiglu_limit", "sliding_window"])
def test_gpt_oss_options_change_the_reference(gpt_oss, tmp_path, change):
    """Each feature the parity test covers moves transformers' logprobs far past its tolerance."""
    model_dir, hf = gpt_oss
    changed = _copy(model_dir, tmp_path)
    if change == "sinks":  # sinks so low they take no weight
        tensors = load_file(str(changed / "model.safetensors"))
        for name in tensors:
            if name.endswith(".sinks"):
                tensors[name] = torch.full_like(tensors[name], -1e4)
        save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    else:
        cfg = json.loads((changed / "config.json").read_text())
        cfg.update({"swiglu_limit": 1e4} if change == "swiglu_limit" else {"sliding_window": 4096})
        (changed / "config.json").write_text(json.dumps(cfg))
    ids = PROMPTS[0]
    assert (hf_logprobs(hf, ids) - hf_logprobs(hf_model(changed), ids)).abs().max().item() > 1e-2


def test_mxfp4_dequantization_matches_transformers():
    """The dequantizer against transformers' on random blocks and scales, in the stacked
    ``[E, in, out]`` layout the model loads (and only the experts asked for)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(112, 140, (3, 24, 4), generator=gen, dtype=torch.uint8)
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    lazy = Mxfp4Experts(blocks, scales)
    assert lazy.get_shape() == list(reference.shape) == [3, 128, 24]
    assert torch.equal(lazy[0:3], reference)
    assert torch.equal(lazy[1:2], reference[1:2])
    # Every code's value: code c in the low nibble of element 0, scale 2 ** (130 - 127).
    codes = torch.arange(16, dtype=torch.uint8)
    one_block = torch.zeros(16, 1, 16, dtype=torch.uint8)
    one_block[:, 0, 0] = codes
    values = dequantize_mxfp4(one_block, torch.full((16, 1), 130, dtype=torch.uint8))[:, 0]
    assert values.tolist() == [v * 8 for v in FP4_VALUES]


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, out, in]`` to MXFP4 blocks and scales (a block's scale: the power of two putting
    its largest magnitude at or under 6; values rounded to the nearest E2M1 value)."""
    e, o, i = w.shape
    b = w.reshape(e, o, i // 32, 32)
    exp = torch.ceil(torch.log2(b.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    x = b / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (x.abs()[..., None] - magnitudes).abs().argmin(-1) | ((x < 0).long() << 3)
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def test_mxfp4_checkpoint_matches_transformers(gpt_oss, tmp_path):
    """The experts stored as the published checkpoints store them (``*_blocks`` + ``*_scales``,
    ``quant_method: mxfp4``): pagoda's logprobs and greedy tokens equal transformers' on the same
    files (which it dequantizes on a CPU)."""
    model_dir, _ = gpt_oss
    out = _copy(model_dir, tmp_path, "mxfp4")
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    hf = hf_model(out)
    llm = LLM(str(out), kv_cache_memory=8 << 20, max_model_len=256)
    assert llm.config.model.quantization == "mxfp4"
    check_logprobs(llm, hf, PROMPTS[:2], max_tokens=8)
    check_greedy(llm, hf, PROMPTS[:3], 16)


def test_mxfp4_blocks_without_scales_are_refused():
    from pagoda.layers.quantization.mxfp4 import Mxfp4Config

    stream = iter([("f", "model.layers.0.mlp.experts.down_proj_blocks", torch.zeros(1, 1, 1, 16))])
    with pytest.raises(ValueError, match="down_proj has blocks without its scales"):
        list(Mxfp4Config.from_config({}, True).checkpoint_tensors(stream))


def test_torch_backend_sinks_and_chunks_match_the_formula():
    """Decode rows of two sequences and a prefill chunk after a cached prefix, with per-head
    sinks and chunked local attention, against the plain formula."""
    from pagoda.layers.attention.backend import AttentionMetadata
    from pagoda.layers.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(0)
    heads, kv_heads, dim, block, chunk = 4, 2, 16, 4, 5
    lens, new = [11, 3, 9], [1, 1, 4]
    k_cache = torch.zeros(12, block, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    keys = [torch.randn(n, kv_heads, dim) * 2 for n in lens]
    values = [torch.randn(n, kv_heads, dim) for n in lens]
    tables = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 6]], dtype=torch.int32)
    slots, qk, qv = [], [], []
    for b, (n, m) in enumerate(zip(lens, new)):
        for p in range(n):
            slot = int(tables[b, p // block]) * block + p % block
            if p < n - m:
                k_cache.view(-1, kv_heads, dim)[slot], v_cache.view(-1, kv_heads, dim)[slot] = keys[b][p], values[b][p]
            else:
                slots.append(slot)
                qk.append(keys[b][p])
                qv.append(values[b][p])
    starts = [0, 1, 2, 6]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             context_lens=torch.tensor([n - m for n, m in zip(lens, new)], dtype=torch.int32),
                             block_tables=tables, max_query_len=4, max_seq_len=max(lens),
                             query_lens_cpu=new, seq_lens_cpu=lens)
    q = torch.randn(sum(new), heads, dim) * 2
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = TorchAttentionBackend().forward(q, torch.stack(qk), torch.stack(qv), k_cache, v_cache, meta, 0.25,
                                          sinks=sinks, attention_chunk_size=chunk)
    for b, (n, m) in enumerate(zip(lens, new)):
        for j in range(m):
            pos, row = n - m + j, starts[b] + j
            lo = pos - pos % chunk
            k = keys[b][lo:pos + 1].repeat_interleave(heads // kv_heads, dim=1)
            v = values[b][lo:pos + 1].repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[row], k) * 0.25
            probs = torch.cat([scores, sinks[:, None]], dim=1).softmax(-1)[:, :-1]
            torch.testing.assert_close(out[row], torch.einsum("hl,lhd->hd", probs, v), atol=1e-5, rtol=1e-5)
