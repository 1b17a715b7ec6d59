"""``pagoda bench peers``: pagoda, Hugging Face ``generate`` and llama.cpp on the same checkpoint
and the same token-id prompts, side by side in one run, in each matching precision.

For every precision (fp32, bf16, and int8 / int4 where pagoda has ``--quantization``; with
``{"lm_head": true}``, since llama.cpp's Q8_0 / Q4_0 files quantize the output matrix too; on
request ``q8_0-gguf`` / ``q4_0-gguf`` / ``q4_k_m-gguf`` / ``q6_k-gguf``, pagoda loading the very
GGUF file llama.cpp runs; the K-quant files are made by llama.cpp's own quantizer, so those need
llama-cpp-python even with ``--engines pagoda``, unless the file is already cached) and batch
size it prints decode tokens/s (all sequences together; greedy, EOS ignored), prefill tokens/s
of one long prompt, the ratios of pagoda to each peer, and the batch-1 roofline: the bytes one
decode token must read (the weights in that engine's storage format) over a streaming-read
bandwidth measured here, with each engine's share of it. Also the share of a batch-1 pagoda step
spent outside the model (scheduling, input tensors, sampling, output processing). Writes JSON
and, with matplotlib, a plot of tokens/s against batch size.

The peers run in child processes (``peers_child.py``) with their own threading defaults.
llama.cpp is optional: ``llama-cpp-python`` when importable (its GGUF written from the same
checkpoint by ``gguf_export``, and its greedy tokens checked against ``transformers``'); when it
is absent the command says how to install it and runs the rest.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.bench.common import FIRST_ORDINARY_ID, write_json
from pagoda.bench.peers_report import Row, check_greedy, merge_rounds, plot, report
from pagoda.kernels import select

LLAMA_CPP_INSTALL = ('llama.cpp not found: install its Python binding, built for this CPU, into this '
                     'environment:\n    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python\n'
                     '(it compiles llama.cpp; ~10 minutes on 2 cores), then run this command again.')


@dataclass(frozen=True)
class Precision:
    """One matching precision: pagoda's engine arguments, Hugging Face's dtype (None: no
    matching ``transformers`` CPU path) and llama.cpp's GGUF file type."""

    name: str
    pagoda: dict[str, Any]
    hf_dtype: str | None
    gguf: str
    # Bytes per weight as each engine stores the matrices a decode token reads.
    pagoda_bytes: float
    gguf_bytes: float
    extra_gguf: tuple[str, ...] = ()  # further llama.cpp types reported beside this precision
    # pagoda loads the very GGUF file llama.cpp runs (not the checkpoint it was written from).
    pagoda_reads_gguf: bool = False


_HEAD = '{"lm_head": true}'  # pagoda's --quantization-config for the quantized precisions
PRECISIONS = {
    "fp32": Precision("fp32", {"dtype": "float32"}, "float32", "f32", 4.0, 4.0),
    "bf16": Precision("bf16", {"dtype": "bfloat16"}, "bfloat16", "bf16", 2.0, 2.0, extra_gguf=("f16",)),
    # int8 weight-only, one float32 scale per output row; Q8_0: 32 int8 + one fp16 scale. Both
    # quantize the LM head too (llama.cpp's files quantize their output matrix; pagoda when asked).
    "int8": Precision("int8", {"dtype": "float32", "quantization": "int8", "quantization_config": _HEAD},
                      None, "q8_0", 1.0, 34 / 32),
    # int4, symmetric in groups of 128, a float16 scale each; Q4_0: 32 4-bit + one fp16 scale.
    "int4": Precision("int4", {"dtype": "float32", "quantization": "int4", "quantization_config": _HEAD},
                      None, "q4_0", 0.5 + 2 / 128, 18 / 32),
    # pagoda on the GGUF itself (docs/quantization.md, "GGUF files"): Q8_0 as int8 in groups of 32
    # and Q4_0 as symmetric int4, a float16 scale per 32 each (the file's own bytes); the output
    # matrix too. The roofline of these precisions counts the file's tensors
    # (gguf_bytes_per_token), not these figures.
    "q8_0-gguf": Precision("q8_0-gguf", {"dtype": "float32"}, None, "q8_0", 1.0 + 2 / 32, 34 / 32,
                           pagoda_reads_gguf=True),
    "q4_0-gguf": Precision("q4_0-gguf", {"dtype": "float32"}, None, "q4_0", 0.5 + 2 / 32, 18 / 32,
                           pagoda_reads_gguf=True),
    # llama.cpp's most used file type: Q4_K, with Q6_K for the output and some layers' attn_v and
    # ffn_down. Mixed, so both engines' bytes per token come from the file (gguf_bytes_per_token).
    "q4_k_m-gguf": Precision("q4_k_m-gguf", {"dtype": "float32"}, None, "q4_k_m", 0.0, 0.0,
                             pagoda_reads_gguf=True),
    # Q6_K throughout (llama.cpp's Q6_K file type): pagoda's int8 in groups of 16.
    "q6_k-gguf": Precision("q6_k-gguf", {"dtype": "float32"}, None, "q6_k", 0.0, 0.0, pagoda_reads_gguf=True),
}
# Run unless --precisions names others (the GGUF ones on request).
DEFAULT_PRECISIONS = [name for name, p in PRECISIONS.items() if not p.pagoda_reads_gguf]
GGUF_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# File types only llama.cpp's own quantizer writes (gguf-py cannot write the K-quants): the F32
# file gguf_export writes, quantized by ``llama_model_quantize`` into this ``LLAMA_FTYPE_MOSTLY_*``.
LLAMA_QUANTIZED = {"q4_k_m": "Q4_K_M", "q6_k": "Q6_K"}


# ---- the model's bytes per decode token and the machine's bandwidth ----------------------------
def weight_counts(model_dir: str) -> dict[str, int]:
    """Parameters a decode token reads: the layers' matrices (``body``; of a mixture of experts
    only the token's top-k experts), the LM head (``head``) and the 1-D norms and biases
    (``vectors``, float32 everywhere). The input embedding is one row per token and is left out."""
    from pagoda.config import ModelConfig
    from pagoda.models.param_count import count_params

    c = count_params(ModelConfig.from_pretrained(model_dir, None, "float32", None, "cpu"))
    layer_vectors = c.vectors - c.final_norm
    return {"body": c.layers_active - layer_vectors, "head": c.lm_head or c.embedding, "vectors": c.vectors}


def bytes_per_token(counts: dict[str, int], body_bytes: float, head_bytes: float) -> float:
    return counts["body"] * body_bytes + counts["head"] * head_bytes + counts["vectors"] * 4


# Bytes pagoda's CPU kernels read per weight of each GGUF kind (kernels/woq.py layouts): int4 in
# groups of 32 is half a byte of code plus a float16 scale and a float16 offset per group (no
# offset for Q4_0's symmetric codes); Q8_0 a byte plus a float16 scale per group of 32;
# int8-channel a byte plus a float32 scale and an int32 code sum per row; a dequantized matrix is
# float32 (the bench runs pagoda in float32).
_PAGODA_GGUF_BYTES = {"int4": 0.5 + 4 / 32, "int8": 1.0 + 2 / 32, "int8-g16": 1.0 + 2 / 16, None: 4.0}
_SYMMETRIC_INT4 = 0.5 + 2 / 32  # Q4_0 on the int4 kernel


def gguf_bytes_per_token(path: str | Path) -> dict[str, float]:
    """Bytes one decode token reads from the GGUF ``path``, per engine, from its tensor types:
    ``llama.cpp`` (each tensor's size in the file) and ``pagoda`` (each layer in the storage of
    the kernel ``GGUFConfig`` gives its type, float32 where it dequantizes). Every tensor but the
    token embedding (one row per token; the output matrix where the file ties them), 1-D ones
    (norms, biases) at 4 bytes per value in both."""
    import gguf

    from pagoda.layers.quantization.gguf_quant import CHANNEL, GGUFConfig
    from pagoda.models.gguf_loader import hf_name, read_config

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    quant = GGUFConfig.from_config(read_config(Path(path))["quantization_config"], True)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    out = {"llama.cpp": 0.0, "pagoda": 0.0}
    for name, t in tensors.items():
        if name == "token_embd.weight" and head != name:
            continue
        out["llama.cpp"] += int(t.n_bytes)
        if len(t.shape) != 2:
            out["pagoda"] += 4 * int(t.n_elements)
            continue
        cols, rows = int(t.shape[0]), int(t.shape[1])
        kind = quant.head_kind() if name == head else quant.kept_kind(hf_name(name)[: -len(".weight")])
        if kind == CHANNEL:  # a byte a weight and a float32 scale and int32 code sum per row
            out["pagoda"] += rows * cols + 8 * rows
            continue
        symmetric = kind == "int4" and t.tensor_type == gguf.GGMLQuantizationType.Q4_0
        out["pagoda"] += rows * cols * (_SYMMETRIC_INT4 if symmetric else _PAGODA_GGUF_BYTES[kind])
    return out


def pagoda_bytes_per_token(counts: dict[str, int], p: Precision) -> float:
    # Quantized pagoda keeps the LM head in the model dtype (vLLM's default, and issue 15's)
    # unless its options quantize the head too.
    head_quantized = json.loads(p.pagoda.get("quantization_config", "{}")).get("lm_head", False)
    head = 4.0 if "quantization" in p.pagoda and not head_quantized else p.pagoda_bytes
    return bytes_per_token(counts, p.pagoda_bytes, head)


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (Linux sysfs), 0 when unknown."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]]
                         if text[-1] in "KMG" else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


def default_bandwidth_mib() -> int:
    """A buffer well past the last-level cache: 256 MiB, or twice the cache where that is more
    (some server CPUs have hundreds of MiB of L3, enough to hold a small model whole)."""
    return max(256, 2 * last_level_cache_bytes() >> 20)


def measure_bandwidth(mib: int | None = None, repeats: int = 5) -> dict[str, float]:
    """Streaming-read bytes/s of a ``mib`` MiB float32 buffer (default: well past the last-level
    cache, ``default_bandwidth_mib``) through
    read-bound kernels: torch's sum and one-row matrix-vector product, and pagoda's own one-row
    kernel where it is built (the fastest reader on most CPUs, so the roofline is not set by a
    slow reader); best of ``repeats``. Returns each kernel's figure and ``best``."""
    import torch

    from pagoda.kernels import gemv as cpu_gemv

    n = (mib or default_bandwidth_mib()) * (1 << 20) // 4
    buf = torch.ones(n)
    cols = 4096
    mat = buf[: n // cols * cols].view(-1, cols)
    vec = torch.ones(cols)
    readers = [("sum", lambda: buf.sum(), buf.numel() * 4),
               ("matvec", lambda: torch.mv(mat, vec), mat.numel() * 4)]
    if cpu_gemv.supports(mat):
        row = vec.view(1, cols)
        readers.append(("gemv", lambda: cpu_gemv.gemv(row, mat, None), mat.numel() * 4))
    out = {}
    for name, fn, nbytes in readers:
        fn()
        best = min(_timed(fn) for _ in range(repeats))
        out[name] = nbytes / best
    out["best"] = max(out.values())
    return out


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- workloads --------------------------------------------------------------------------------
def make_prompts(batch_sizes: list[int], input_len: int, prefill_len: int, prefill_reps: int, vocab: int,
                 seed: int) -> tuple[dict[int, list[list[int]]], list[list[int]]]:
    """Seeded random token-id prompts: ``batch_sizes[i]`` prompts of ``input_len`` per batch
    size, and ``prefill_reps`` prompts of ``prefill_len``; every prompt distinct."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]

    return ({b: [prompt(input_len) for _ in range(b)] for b in batch_sizes},
            [prompt(prefill_len) for _ in range(prefill_reps)])


# ---- pagoda -------------------------------------------------------------------------------------
class _StepClock:
    """Time spent in the model (forward + LM head, or the runner's lean decode step that runs
    both) during the steps it watches."""

    def __init__(self, runner: Any) -> None:
        self.model_s = 0.0
        self.on = False
        forward, logits = runner.forward, runner.model.compute_logits

        def timed(fn: Any) -> Any:
            def call(*a: Any, **k: Any) -> Any:
                if not self.on:
                    return fn(*a, **k)
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.model_s += time.perf_counter() - start
            return call

        runner.forward = timed(forward)
        runner.model.compute_logits = timed(logits)
        if getattr(runner, "decode_step", None) is not None:  # the multi-step greedy loop's forward
            runner.decode_step = timed(runner.decode_step)


def _pagoda_generate(llm: Any, prompts: list[list[int]], n: int, clock: _StepClock | None = None
                     ) -> tuple[float, float, list[list[int]], float]:
    """(prefill seconds: until every prompt has its first token; decode seconds after that;
    tokens per prompt; wall seconds of the decode steps spent in the model)."""
    from pagoda.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    tag = f"peers-{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    mid = None
    while engine.has_unfinished_requests():
        if clock is not None and mid is not None:
            clock.on = True
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        if clock is not None:
            clock.on = False
        if mid is None and len(tokens) == len(prompts) and all(tokens.values()):
            mid = time.perf_counter()
    end = time.perf_counter()
    ordered = [tokens[f"{tag}-{i}"] for i in range(len(prompts))]
    return mid - start, end - mid, ordered, clock.model_s if clock else 0.0


def run_pagoda(model: str, p: Precision, batches: dict[int, list[list[int]]], prefill: list[list[int]],
               n: int, checkpoint: str | None = None) -> Row:
    """``model``: what pagoda loads (a GGUF file for the ``-gguf`` precisions); ``checkpoint``:
    the Hugging Face directory its shape is read from (default ``model``)."""
    from pagoda import LLM

    row = Row("pagoda", p.name)
    longest = max(len(x) for x in prefill)
    tokens = max(sum(len(x) + n for x in b) for b in batches.values())
    llm = LLM(model=model, enable_prefix_caching=False, max_num_seqs=max(len(b) for b in batches.values()),
              max_num_batched_tokens=max(512, longest), max_model_len=max(longest + n, 2 * n + 256),
              kv_cache_memory=_kv_bytes(checkpoint or model, p, max(tokens, longest)), **p.pagoda)
    try:
        runner = llm.engine.core.executor
        clock = _StepClock(runner)
        _pagoda_generate(llm, batches[min(batches)], 4)  # warm-up
        for size, prompts in batches.items():
            if size == 1:
                clock.model_s = 0.0
            _, seconds, out, model_s = _pagoda_generate(llm, prompts, n, clock if size == 1 else None)
            row.decode_tok_s[size] = len(prompts) * (n - 1) / seconds
            if size == 1:
                row.greedy = out[0]
                row.engine_overhead = 1 - model_s / seconds
        times = [_pagoda_generate(llm, [x], 1)[0] for x in prefill]
        row.prefill_tok_s = longest / statistics.median(times)
    finally:
        llm.shutdown()
    return row


# pagoda itself under a forced kernel variant (``PAGODA_CPU_ISA``), run as a peer in its own process
# (the variant is chosen once per process): where llama.cpp is absent, or to see what a variant
# gains, e.g. ``PAGODA_CPU_ISA=avx2 pagoda bench peers --engines pagoda,pagoda@scalar,pagoda@avx512``.
ISA_ENGINES = tuple(f"pagoda@{level}" for level in select.LEVELS)
# pagoda with one torch thread per CPU of its affinity mask, a cgroup CPU quota ignored (torch's
# own default; ``omp.configure_openmp`` sizes the threads by the quota): run inside a container
# with a CPU limit to see what sizing by the quota gains.
VISIBLE_CPUS_ENGINE = "pagoda@visible-cpus"
CHILD_ENGINES = (*ISA_ENGINES, VISIBLE_CPUS_ENGINE)
_ISA_CHILD = "from pagoda.bench.peers import isa_child; isa_child()"


def child_engine_env(engine: str) -> dict[str, str]:
    """The environment of a ``CHILD_ENGINES`` peer: ``PAGODA_CPU_ISA`` for ``pagoda@<level>``,
    ``OMP_NUM_THREADS`` = the affinity mask's CPUs for ``pagoda@visible-cpus``."""
    from pagoda.cpu_quota import affinity_cpus

    if engine == VISIBLE_CPUS_ENGINE:
        return dict(os.environ, OMP_NUM_THREADS=str(affinity_cpus()))
    return dict(os.environ, PAGODA_CPU_ISA=engine.split("@")[1])


def run_pagoda_isa(engine: str, model: str, p: Precision, batches: dict[int, list[list[int]]],
                   prefill: list[list[int]], n: int, checkpoint: str) -> Row:
    """``run_pagoda`` in a child process with ``child_engine_env(engine)``; its row is named
    ``engine``."""
    job = {"model": model, "precision": p.name, "batches": {str(k): v for k, v in batches.items()},
           "prefill": prefill, "n": n, "checkpoint": checkpoint}
    proc = subprocess.run([sys.executable, "-c", _ISA_CHILD], input=json.dumps(job), capture_output=True, text=True,
                          env=child_engine_env(engine))
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return Row(engine, p.name, {int(k): v for k, v in got["decode_tok_s"].items()}, got["prefill_tok_s"],
               greedy=got["greedy"])


def isa_child() -> None:
    """The child of ``run_pagoda_isa``: a job as JSON on stdin, its row as one JSON line."""
    job = json.loads(sys.stdin.read())
    row = run_pagoda(job["model"], PRECISIONS[job["precision"]], {int(k): v for k, v in job["batches"].items()},
                     job["prefill"], job["n"], checkpoint=job["checkpoint"])
    print(json.dumps(dataclasses.asdict(row)))


def _kv_bytes(model: str, p: Precision, tokens: int) -> int:
    cfg = json.loads(Path(model, "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = 2 if p.pagoda.get("dtype") == "bfloat16" else 4
    per_token = 2 * cfg["num_hidden_layers"] * heads * d * elem
    return int((tokens + 64 * 16) * per_token * 1.25)


def pagoda_supports(p: Precision) -> str | None:
    """None when pagoda can run ``p``, else why not."""
    from pagoda.config import EngineArgs

    if "quantization" in p.pagoda and "quantization" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return f"pagoda has no --quantization yet, so no {p.name} rows"
    return None


# ---- peers --------------------------------------------------------------------------------------
def run_child(job: dict[str, Any]) -> dict[str, Any]:
    """Run a peer job in its own process, without the OpenMP settings pagoda chose for itself."""
    import pagoda

    env = {k: v for k, v in os.environ.items() if k not in pagoda.OMP_DEFAULTS_SET}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("peers_child.py"))],
                          input=json.dumps(job), capture_output=True, text=True, env=env)
    if proc.returncode < 0:
        raise PeerCrashed(job["engine"], -proc.returncode, proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the {job['engine']} peer failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class PeerCrashed(RuntimeError):
    """A peer's process killed by a signal (llama.cpp's AMX kernels raise SIGILL on some VMs)."""

    def __init__(self, engine: str, signum: int, stderr: str) -> None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        super().__init__(f"the {engine} peer was killed by {name}; its last output:\n" + "\n".join(lines[-5:]))
        self.signum = signum


LLAMA_CPP_SIGILL = ("llama.cpp's process hit an illegal instruction: typically its AMX kernels on a "
                    "CPU or VM that lists AMX but does not run it. Running it again without its "
                    "repacked weight layouts (use_extra_bufts off; AMX and CPU_REPACK both). For "
                    "llama.cpp at its best here, rebuild it without AMX:\n    CMAKE_ARGS=\""
                    + " ".join(f"-DGGML_{o}" for o in (
                        "NATIVE=OFF", "AVX=ON", "AVX2=ON", "FMA=ON", "F16C=ON", "BMI2=ON", "AVX512=ON",
                        "AVX512_VNNI=ON", "AVX512_BF16=ON", "AVX512_VBMI=ON", "AVX_VNNI=ON",
                        "AMX_TILE=OFF", "AMX_INT8=OFF", "AMX_BF16=OFF"))
                    + "\" pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python")


def _peer(job: dict[str, Any], skipped: list[str]) -> dict[str, Any] | None:
    """A peer's result, or None (the failure printed and recorded) so the others still run. A
    llama.cpp process killed by SIGILL runs once more without its extra buffer types; its result
    then says so (``extra_bufts`` False)."""
    try:
        return run_child(job)
    except PeerCrashed as exc:
        print(exc)
        if job["engine"] != "llama.cpp" or exc.signum != signal.SIGILL or job.get("extra_bufts") is False:
            skipped.append(str(exc).splitlines()[0])
            return None
        print(LLAMA_CPP_SIGILL)
        result = _peer({**job, "extra_bufts": False}, skipped)
        if result is not None:
            result["extra_bufts"] = False
        return result
    except RuntimeError as exc:
        print(exc)
        skipped.append(str(exc).splitlines()[0])
        return None


def _job(engine: str, model: str, threads: int, batches: dict[int, list[list[int]]], prefill: list[list[int]],
         n: int, **extra: Any) -> dict[str, Any]:
    return {"engine": engine, "model": model, "threads": threads, "output_len": n, "prefill_prompts": prefill,
            "batches": {str(k): v for k, v in batches.items()}, **extra}


def _row_from(engine: str, precision: str, result: dict[str, Any]) -> Row:
    return Row(engine, precision, {int(k): v for k, v in result["decode_tok_s"].items()},
               result["prefill_tok_s"], greedy=result.get("greedy", []))


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class QuantizerMissing(RuntimeError):
    """A file type only llama.cpp's quantizer writes was asked for where llama-cpp-python is not
    importable (and the file is not cached)."""


def gguf_path(gguf_dir: Path, model: str, ftype: str) -> Path:
    """The GGUF of ``model`` in ``ftype``, written once per checkpoint content (cached): by
    ``gguf_export``, or for ``LLAMA_QUANTIZED`` types by llama.cpp's quantizer (in a child
    process) from the F32 file; ``QuantizerMissing`` when that needs llama-cpp-python and it is
    absent."""
    from pagoda.bench.gguf_export import write_gguf

    st = sorted(Path(model).glob("*.safetensors"))
    key = hashlib.sha1("".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in st).encode())
    path = gguf_dir / f"{Path(model).name}-{key.hexdigest()[:10]}-{ftype}.gguf"
    if path.exists():
        return path
    if ftype in LLAMA_QUANTIZED and not llama_cpp_available():
        raise QuantizerMissing(
            f"{ftype} needs llama.cpp's own quantizer to write the file both engines run (gguf-py cannot "
            f"write K-quants) and llama-cpp-python is not importable here; install it (see below) or put "
            f"a build on PYTHONPATH, or place the file at {path}")
    print(f"writing {path}")
    tmp = path.with_suffix(".tmp")
    if ftype in LLAMA_QUANTIZED:
        source = gguf_path(gguf_dir, model, "f32")
        run_child({"engine": "llama.cpp-quantize", "source": str(source), "out": str(tmp),
                   "ftype": LLAMA_QUANTIZED[ftype]})
    else:
        write_gguf(model, tmp, ftype)
    tmp.rename(path)
    return path


def _one_round(args: argparse.Namespace, engines: set[str], has_llama: bool, gguf_dir: Path,
               counts: dict[str, int], threads: int, batches: dict[int, list[list[int]]],
               prefill: list[list[int]], skipped: list[str], buffer_mib: int) -> list[Row]:
    """Every precision's engines once, in order (pagoda, transformers, llama.cpp); the streaming
    read is measured between every two engines' runs, and each row keeps the higher of the two
    around its own (``Row.run_bandwidth``)."""
    rows: list[Row] = []
    done = stamped = 0
    before = measure_bandwidth(buffer_mib, repeats=3)["best"]

    def stamp() -> None:  # the rows since the last stamp: the bandwidth around their run
        nonlocal before, stamped
        if len(rows) > stamped:
            after = measure_bandwidth(buffer_mib, repeats=3)["best"]
            for row in rows[stamped:]:
                row.run_bandwidth = max(before, after)
            before, stamped = after, len(rows)

    for name in args.precisions:
        p = PRECISIONS[name]
        why = pagoda_supports(p)
        file_bytes: dict[str, float] = {}
        if not why and p.pagoda_reads_gguf:
            try:
                file_bytes = gguf_bytes_per_token(gguf_path(gguf_dir, args.model, p.gguf))
            except QuantizerMissing as exc:
                why = str(exc)
                print(LLAMA_CPP_INSTALL)
        if why:
            print(f"skipping {name}: {why}")
            skipped.append(why)
            continue
        if "pagoda" in engines:
            print(f"-- pagoda {name}")
            source = str(gguf_path(gguf_dir, args.model, p.gguf)) if p.pagoda_reads_gguf else args.model
            row = run_pagoda(source, p, batches, prefill, args.output_len, checkpoint=args.model)
            row.bytes_per_token = file_bytes.get("pagoda") or pagoda_bytes_per_token(counts, p)
            rows.append(row)
            stamp()
        for engine in (e for e in CHILD_ENGINES if e in engines):
            level = engine.split("@")[1]
            if engine in ISA_ENGINES and level not in select.supported_levels():
                skipped.append(f"{engine}: this CPU does not run the {level} kernels")
                continue
            print(f"-- {engine} {name}")
            source = str(gguf_path(gguf_dir, args.model, p.gguf)) if p.pagoda_reads_gguf else args.model
            row = run_pagoda_isa(engine, source, p, batches, prefill, args.output_len, args.model)
            row.bytes_per_token = file_bytes.get("pagoda") or pagoda_bytes_per_token(counts, p)
            rows.append(row)
            stamp()
        if "hf" in engines and not p.hf_dtype:
            skipped.append(f"transformers has no {name} CPU path here")
        if "hf" in engines and p.hf_dtype:
            print(f"-- transformers {name}")
            result = _peer(_job("hf", args.model, threads, batches, prefill, args.output_len, dtype=p.hf_dtype),
                           skipped)
            if result:
                row = _row_from("hf", name, result)
                row.bytes_per_token = bytes_per_token(counts, p.pagoda_bytes, p.pagoda_bytes)
                rows.append(row)
                stamp()
        if has_llama:
            for ftype in (p.gguf, *p.extra_gguf):
                print(f"-- llama.cpp {ftype}")
                path = gguf_path(gguf_dir, args.model, ftype)
                result = _peer(_job("llama.cpp", args.model, threads, batches, prefill, args.output_len,
                                    gguf=str(path)), skipped)
                if result:
                    row = _row_from("llama.cpp", name if ftype == p.gguf else ftype, result)
                    if result.get("extra_bufts") is False:
                        row.note = ("ran without its extra buffer types (killed by SIGILL with them), "
                                    "so without its repacked kernels")
                    row.bytes_per_token = (file_bytes["llama.cpp"] if file_bytes and ftype == p.gguf
                                           else bytes_per_token(counts, GGUF_BYTES[ftype], GGUF_BYTES[ftype]))
                    rows.append(row)
                    stamp()
        for row in rows[done:]:
            print(f"   {row.engine} {row.precision}: decode " + ", ".join(
                f"b{b} {v:.1f}" for b, v in row.decode_tok_s.items()) + f" tok/s; prefill {row.prefill_tok_s:.1f} tok/s")
        done = len(rows)
    return rows


def _bandwidth_text(bw: dict[str, float]) -> str:
    return f"{bw['best'] / 1e9:.1f} GB/s (" + ", ".join(
        f"{k} {v / 1e9:.1f}" for k, v in bw.items() if k != "best") + ")"


# ---- the command ----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import torch

    from pagoda.config import ModelConfig

    cfg = ModelConfig.from_pretrained(args.model, None, "float32", None, "cpu")
    threads = args.threads or torch.get_num_threads()
    batch_sizes = sorted(set(args.batch_sizes))
    batches, prefill = make_prompts(batch_sizes, args.input_len, args.prefill_len, args.prefill_reps,
                                    cfg.vocab_size, args.seed)
    counts = weight_counts(args.model)
    buffer_mib = args.bandwidth_mib or default_bandwidth_mib()
    bw = measure_bandwidth(buffer_mib)
    print(f"streaming read bandwidth: {_bandwidth_text(bw)} over {buffer_mib} MiB "
          f"(last-level cache {last_level_cache_bytes() >> 20} MiB); {threads} threads")
    engines = set(args.engines)
    if "pagoda" in engines:
        choice = select.isa()
        print(f"pagoda runs the {choice.variant} kernel variant ({choice.level}: {choice.reason})")
    has_llama = "llama.cpp" in engines and llama_cpp_available()
    if "llama.cpp" in engines and not has_llama:
        print(LLAMA_CPP_INSTALL)
    gguf_dir = Path(args.gguf_dir or Path(tempfile.gettempdir()) / "pagoda-peers-gguf")
    skipped: list[str] = []
    rounds: list[list[Row]] = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"== round {r + 1} of {args.rounds} ==")
        rounds.append(_one_round(args, engines, has_llama, gguf_dir, counts, threads, batches, prefill,
                                 skipped if r == 0 else [], buffer_mib))
    rows = merge_rounds(rounds)
    if not rows:
        print("nothing ran")
        return 1
    # Measured again at the end: on a shared machine the bandwidth moves, and the roofline takes
    # the best the machine showed during the run (the stricter bar).
    after = measure_bandwidth(buffer_mib)
    print(f"streaming read bandwidth after the run: {_bandwidth_text(after)}")
    bw = {**{f"{k}_before": v for k, v in bw.items()}, **{f"{k}_after": v for k, v in after.items()},
          "best": max(bw["best"], after["best"])}
    results = report(rows, batch_sizes, bw["best"], rounds)
    mismatched = check_greedy(rows)
    if args.plot:
        plot(rows, batch_sizes, args.plot)
    write_json(args.output_json, {
        "model": args.model, "batch_sizes": batch_sizes, "input_len": args.input_len,
        "output_len": args.output_len, "prefill_len": args.prefill_len, "threads": threads, "rounds": args.rounds,
        "bandwidth_bytes_s": bw, "bandwidth_buffer_mib": buffer_mib, "skipped": skipped, "llama_cpp": has_llama,
        "greedy_mismatch_fp32": mismatched, **results})
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _names(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in names if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return names
    return parse


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("peers", help="pagoda beside llama.cpp and HF generate, same model and prompts")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (Llama/Mistral for llama.cpp)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the decode runs")
    p.add_argument("--output-len", type=int, default=64, help="greedy tokens per prompt (EOS ignored)")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the prefill prompt")
    p.add_argument("--prefill-reps", type=int, default=3, help="prefill prompts timed (median)")
    p.add_argument("--precisions", type=_names(tuple(PRECISIONS)), default=DEFAULT_PRECISIONS,
                   help="fp32, bf16, int8, int4 (default: these; pagoda on the checkpoint), and q8_0-gguf, "
                        "q4_0-gguf, q4_k_m-gguf, q6_k-gguf: pagoda on the very GGUF file llama.cpp runs (the "
                        "K-quants written by llama.cpp's quantizer: need llama-cpp-python)")
    p.add_argument("--engines", type=_names(("pagoda", "hf", "llama.cpp", *CHILD_ENGINES)),
                   default=["pagoda", "hf", "llama.cpp"],
                   help="pagoda, hf, llama.cpp; pagoda@scalar / @avx2 / @avx512 / @amx: pagoda under that "
                        "kernel variant (PAGODA_CPU_ISA) as a peer, in its own process; pagoda@visible-cpus: "
                        "pagoda with a thread per CPU of its affinity mask, a cgroup CPU quota ignored")
    p.add_argument("--threads", type=int, default=None, help="threads of the peers (default: torch's)")
    p.add_argument("--rounds", type=_positive, default=1,
                   help="measure every engine this many times, interleaved; report medians and the median "
                        "of the rounds' ratios (for machines whose speed drifts)")
    p.add_argument("--gguf-dir", default=None, help="where the GGUF files are written (cached)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-mib", type=int, default=None,
                   help="buffer the bandwidth is measured on (default: 256 MiB or twice the last-level cache)")
    p.add_argument("--plot", default=None, help="PNG of tokens/s against batch size (needs matplotlib)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
