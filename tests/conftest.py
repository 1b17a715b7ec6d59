"""Shared fixtures: small random-weight checkpoints made once per test session."""
from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import NamedTuple

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the Triton kernels are tested under the interpreter, which must be switched on
# before anything imports triton (pagoda's layer modules do, at import).
if not os.path.exists("/dev/nvidia0") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
# Under pytest-xdist (the README's test command runs two workers) the workers share the cores:
# each worker, and the servers and ranks it starts, gets its share of them as torch's threads.
# OpenMP threads of two processes competing for the same cores wait at every op's barrier for a
# descheduled peer (a forward pass of tiny ops then runs several times slower than alone).
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    from pagoda.cpu_quota import usable_cpus

    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // _workers))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the C++ CPU kernels once, up front. On a cold cache (CI) each takes tens of
    seconds; compiled lazily they would be built by whichever test first runs a model, possibly
    inside a tensor-parallel worker while its peers wait on a gloo receive with a timeout."""
    from pagoda.kernels import build as cpu_build

    cpu_build.build_all()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Thawed for the interpreter's exit, so that its last collection finds everything (extension
    modules' leak checks report what it did not)."""
    gc.unfreeze()


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_earlier_modules_left():
    """At each test file's start, leave every object alive (torch, transformers, the test
    modules, the session's engines: half a million) out of the cyclic collector's sweeps: an
    engine's shutdown collects (``ModelRunner._release_memory``) and each full sweep over them
    cost a worker a third of a second, a quarter of its time in the engine and model tests.
    The previous file's fixtures are gone by then, their garbage collected first; refcounting
    still frees what is frozen."""
    gc.collect()
    gc.freeze()
    yield


# Test files (or folders) marked ``slow``: servers, Ray, several processes or ranks, benchmarks.
SLOW_PATHS = ("tests/entrypoints/", "tests/distributed/", "tests/bench/", "tests/kvcache/test_tiers_server.py",
              "tests/models/test_hub.py", "tests/models/test_gguf.py")
KERNEL_PATHS = ("tests/kernels/", "tests/layers/test_cpu_")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test ``slow``, ``kernels`` or ``gpu`` (registered in pyproject.toml) from where
    it lives and what it skips for, so that ``-m 'not slow'`` gives a quick inner loop."""
    root = Path(str(config.rootpath))
    for item in items:
        full = Path(str(item.path))
        path = full.relative_to(root).as_posix() if full.is_relative_to(root) else ""
        if path.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
        if path.startswith(KERNEL_PATHS):
            item.add_marker(pytest.mark.kernels)
        reasons = " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        if "CUDA" in reasons or "cuda" in path or "gpu" in Path(path).name:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session", autouse=True)
def _engines_default_to_cpu():
    """The suite checks CPU semantics (float32 by default, outputs bitwise equal across batch
    shapes, preemption and chunking), which is what CI runs. On a machine with CUDA, an engine
    that names no device would land on the GPU in bfloat16, where those exact checks do not hold,
    so it stays on the CPU there too; the GPU tests name ``device="cuda"`` themselves, and
    ``PAGODA_TEST_DEVICE=auto`` lets every engine take the GPU."""
    import torch

    if not torch.cuda.is_available() or os.environ.get("PAGODA_TEST_DEVICE") == "auto":
        yield
        return
    from pagoda import config

    real = config.resolve_device
    patch = pytest.MonkeyPatch()
    patch.setattr(config, "resolve_device", lambda device: real("cpu" if device == "auto" else device))
    yield
    patch.undo()


# Shapes chosen to exercise GQA, MQA, explicit head_dim, biases, q/k norm and tied embeddings.
MODEL_SPECS: dict[str, dict] = {
    "llama": dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512),
    "mistral": dict(arch="mistral", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, vocab_size=512),
    "qwen2": dict(arch="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512),
    "qwen3": dict(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                  vocab_size=512, tie_embeddings=True),
    # Mixture of experts and MLA: odd expert counts and sizes, dense and sparse layers mixed.
    "mixtral": dict(arch="mixtral", hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
                    intermediate_size=40, extra_config=dict(num_local_experts=5, num_experts_per_tok=2)),
    "qwen2_moe": dict(arch="qwen2_moe", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=512,
                      intermediate_size=80, extra_config=dict(
                          num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                          shared_expert_intermediate_size=56, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": dict(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
                      vocab_size=512, intermediate_size=72, extra_config=dict(
                          num_experts=5, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
                          decoder_sparse_step=2)),
    "deepseek_v3": dict(arch="deepseek_v3", hidden_size=64, num_layers=3, num_heads=4, vocab_size=512,
                        intermediate_size=72, extra_config=dict(
                            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                            moe_intermediate_size=24, n_shared_experts=2, first_k_dense_replace=1,
                            q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                            v_head_dim=20, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # Dense families with their own options (tests/models/test_dense_families.py): windows of 16
    # so the test prompts run past them, soft-caps that bend the scores and logits without
    # squashing the top logits into near-ties, a scores scale other than head_dim, different local
    # and global RoPE bases, partial rotary. Gemma's embeddings are scaled by sqrt(hidden) and tied
    # to the LM head: at the default init the input token's own row dominates the logits and
    # greedy runs only repeat the prompt's last token, so they are drawn smaller.
    "gemma2": dict(arch="gemma2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                   vocab_size=512, tie_embeddings=True, sliding_window=16, init_std=0.05, extra_config=dict(
                       attn_logit_softcapping=2.0, final_logit_softcapping=4.0, query_pre_attn_scalar=24)),
    "gemma3": dict(arch="gemma3", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=1, head_dim=32,
                   vocab_size=512, tie_embeddings=True, sliding_window=16, rope_theta=1e6, init_std=0.05,
                   rope_scaling=dict(rope_type="linear", factor=8.0), extra_config=dict(
                       sliding_window_pattern=2, rope_local_base_freq=100.0, final_logit_softcapping=4.0,
                       query_pre_attn_scalar=24)),
    "phi3": dict(arch="phi3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
                 extra_config=dict(partial_rotary_factor=0.5)),
    "olmo2": dict(arch="olmo2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512),
    "glm4": dict(arch="glm4", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512),
    # gpt-oss: a window of 8 (sliding layer first), YaRN over an original context of 64, a SwiGLU
    # clamp low enough to bite, sizes that are multiples of 32 (MXFP4 blocks).
    "gpt_oss": dict(arch="gpt_oss", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    vocab_size=512, intermediate_size=32, sliding_window=8, rope_theta=150000.0,
                    max_position_embeddings=256,
                    rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                      original_max_position_embeddings=64),
                    extra_config=dict(num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.5)),
    # Llama 4: RoPE and NoPE layers alternating, experts in every other layer, chunks of 8 (the
    # test prompts run past them), a temperature floor of 4 so NoPE queries are scaled early.
    "llama4": dict(arch="llama4", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                   vocab_size=512, intermediate_size=48, rope_theta=500000.0, extra_config=dict(
                       num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96,
                       interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=8,
                       floor_scale=4, attn_scale=0.5)),
}


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory):
    from pagoda.tools.make_model import make_model

    made: dict[str, Path] = {}

    def get(name: str, **overrides) -> Path:
        key = name + repr(sorted(overrides.items()))
        if key not in made:
            spec = {**MODEL_SPECS[name], **overrides}
            made[key] = make_model(tmp_path_factory.mktemp(name), **spec)
        return made[key]

    return get


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> Path:
    return model_factory("llama")


@pytest.fixture(scope="session")
def llama_llm(llama_dir):
    """One shared engine for tests that only submit requests (each test leaves it idle)."""
    from pagoda import LLM

    llm = LLM(str(llama_dir), kv_cache_memory=32 << 20, max_model_len=1024)
    yield llm
    llm.shutdown()


# Random PEFT adapters for the llama checkpoint (made by the peft package): ranks 8 and 16,
# different targets, one rsLoRA; their weights are large enough to change greedy outputs.
LORA_SPECS: dict[str, dict] = {
    "attn8": dict(r=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), lora_alpha=16, seed=1),
    "mlp16rs": dict(r=16, target_modules=("gate_proj", "up_proj", "down_proj"), lora_alpha=16, use_rslora=True,
                    seed=2),
    "qvdown16": dict(r=16, target_modules=("q_proj", "v_proj", "down_proj"), lora_alpha=32, seed=3),
}


@pytest.fixture(scope="session")
def lora_adapters(llama_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pagoda.tools.make_lora import make_lora

    root = tmp_path_factory.mktemp("lora")
    return {name: make_lora(llama_dir, root / name, **spec) for name, spec in LORA_SPECS.items()}


class ThinkModel(NamedTuple):
    """A scripted checkpoint (pagoda.tools.scripted_model): after a ChatML generation prompt its
    greedy output is ``"<think>" + reasoning + "</think>" + answer``, then EOS."""

    path: Path
    reasoning: str
    answer: str


@pytest.fixture(scope="session")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> ThinkModel:
    from pagoda.tools.scripted_model import make_scripted_model

    reasoning, answer = "Let me think", " The answer"
    path = make_scripted_model(tmp_path_factory.mktemp("think"), ["<think>", reasoning, "</think>", answer])
    return ThinkModel(path, reasoning, answer)


class ToolCallModel(NamedTuple):
    """A scripted checkpoint whose greedy output after a ChatML generation prompt is a forced-call
    array holding one ``get_weather`` call that invents an undeclared key, with no closing
    ``]``: ``script`` is that text, written in ``pieces`` (each one token), then EOS."""

    path: Path
    pieces: tuple[str, ...]

    @property
    def script(self) -> str:
        return "".join(self.pieces)


@pytest.fixture(scope="session")
def tool_call_model(tmp_path_factory: pytest.TempPathFactory) -> ToolCallModel:
    from pagoda.tools.scripted_model import THINK_TOKENS, THINKING_CHAT_TEMPLATE, make_scripted_model

    # Shows the model hermes-style calls, so --tool-call-parser auto (the default) picks hermes.
    TOOL_CALL_TEMPLATE = ("{% if tools %}<|im_start|>system\nCall a tool as <tool_call>{\"name\": ..., "
                          "\"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}" + THINKING_CHAT_TEMPLATE)

    pieces = ('[{"name":"get_weather",', '"parameters":{"city":', '"Paris"', ',"units":"C"', '}}')
    path = make_scripted_model(tmp_path_factory.mktemp("toolcall"), pieces, added_tokens=(*THINK_TOKENS, *pieces),
                               chat_template=TOOL_CALL_TEMPLATE)
    return ToolCallModel(path, pieces)
