"""``pagoda bench spec``: decoding speed with speculative decoding off and on, per batch size,
in one run, with acceptance rates. ``--workload natural`` runs the trained built-in model (and,
for ``draft_model``, its shipped draft) on held-out English instead of the copy model below.

Random-weight models never quote their input, so an n-gram proposer gets nothing accepted on
them. To measure speculation on an input-grounded workload honestly, the default target is a
*copy model* (``make_copy_model``): a Llama checkpoint whose weights implement an induction
circuit, so its greedy continuation of a prompt made of a repeated random token sequence keeps
repeating that sequence, as a model quoting its context would. Its first two layers do the
copying; the remaining layers compute at full cost but write nothing into the residual stream,
so a forward pass costs what an ordinary model of that shape costs.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

# RoPE base of the copy model: high enough that the lowest-frequency pairs barely rotate over a
# few thousand positions (they compare token identities), while the highest-frequency pairs
# still tell neighbouring positions apart (they find the previous token).
COPY_ROPE_THETA = 1e7
COPY_HEAD_DIM = 128
POSITION_PAIRS = 8  # RoPE pairs 0..7 locate the previous position
CONTENT_PAIRS = 24  # RoPE pairs 40..63 compare token codes
PREV_TOKEN_LOGIT_GAP = 25.0  # attention-logit margin of position i-1 over any other position
MATCH_SCALE = 30.0  # query/key gain of the induction head
OUTPUT_SCALE = 30.0  # logit of a token per unit of cosine similarity with the copied code


def make_copy_model(out: str | Path, hidden_size: int = 768, num_layers: int = 8, num_heads: int = 6,
                    intermediate_size: int | None = None, vocab_size: int = 8192, seed: int = 0) -> Path:
    """Write a Llama checkpoint that continues its input by induction: at a token ``t`` it
    predicts the token that followed the previous occurrence of ``t``.

    Residual stream layout: dim 0 a constant; ``A`` the current token's code; ``B`` the previous
    token's code (written by layer 0, head 0, which attends to position ``i - 1``); ``C`` the
    copied code (written by layer 1, head 0, which attends where ``B`` matches the current ``A``
    and reads that position's ``A``). The LM head scores tokens against ``C``. All MLPs and all
    other heads and layers have zero output projections."""
    from safetensors.torch import save_file

    from pagoda.tools.make_model import make_model, read_checkpoint

    dim = 2 * CONTENT_PAIRS
    if hidden_size < 1 + 3 * dim or num_layers < 2:
        raise ValueError(f"a copy model needs hidden_size >= {1 + 3 * dim} and at least 2 layers")
    out = make_model(out, arch="llama", hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_heads, head_dim=COPY_HEAD_DIM, intermediate_size=intermediate_size,
                     vocab_size=vocab_size, seed=seed, rope_theta=COPY_ROPE_THETA)
    weights = read_checkpoint(out)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randn(vocab_size, dim, generator=gen)
    codes /= codes.norm(dim=1, keepdim=True)
    _CopyCircuit(weights, codes, hidden_size, num_layers).write()
    for stale in out.glob("model*.safetensors"):
        stale.unlink()
    tensors = {k: v.contiguous() for k, v in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def truncate_layers(src: str | Path, out: str | Path, num_layers: int) -> Path:
    """A draft for ``src``: its first ``num_layers`` decoder layers with the same embeddings,
    final norm and LM head (and tokenizer), so it tends to agree with ``src``."""
    import shutil

    from safetensors.torch import save_file

    from pagoda.tools.make_model import read_checkpoint

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):  # weights are rewritten below
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {cfg['num_hidden_layers']}]")
    cfg["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    kept = {k: v.contiguous() for k, v in read_checkpoint(src).items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class _CopyCircuit:
    """Sets the weights described in ``make_copy_model`` (in place, fp32)."""

    def __init__(self, weights: dict[str, torch.Tensor], codes: torch.Tensor, hidden: int, layers: int) -> None:
        self.w, self.codes, self.hidden, self.layers = weights, codes, hidden, layers
        self.dim = codes.shape[1]
        self.a, self.b, self.c = (1 + i * self.dim for i in range(3))  # subspace offsets
        self.half = COPY_HEAD_DIM // 2
        inv_freq = COPY_ROPE_THETA ** (-torch.arange(0, COPY_HEAD_DIM, 2).double() / COPY_HEAD_DIM)
        self.theta = inv_freq.float()

    def write(self) -> None:
        for name, tensor in self.w.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()
            elif name.endswith("norm.weight"):
                tensor.fill_(1.0)
        self._embeddings()
        self._previous_token_head()
        self._induction_head()

    def _layer(self, i: int, proj: str) -> torch.Tensor:
        return self.w[f"model.layers.{i}.self_attn.{proj}.weight"]

    def _embeddings(self) -> None:
        embed = self.w["model.embed_tokens.weight"]
        embed.zero_()
        embed[:, 0] = 1.0
        embed[:, self.a:self.a + self.dim] = self.codes
        head = self.w["lm_head.weight"]
        head.zero_()
        gain = math.sqrt(self.hidden / 4)  # the final RMSNorm of [1, A, B, C]
        head[:, self.c:self.c + self.dim] = OUTPUT_SCALE / gain * self.codes
        head[:6] = 0.0  # special tokens are never predicted

    def _previous_token_head(self) -> None:
        """Layer 0, head 0: constant queries and keys whose RoPE phases peak at distance 1;
        the value is the token code, written to ``B``."""
        gain = math.sqrt(self.hidden / 2)  # RMSNorm of [1, code] scales it by this
        pairs = self.theta[:POSITION_PAIRS]
        gap = (1 - torch.cos(pairs)).sum().item()  # score(d=1) - score(d=0 or 2), per unit amplitude
        amp = math.sqrt(PREV_TOKEN_LOGIT_GAP * math.sqrt(COPY_HEAD_DIM) / gap)
        q, k, v, o = (self._layer(0, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        for w in (q, k, v):
            w[:COPY_HEAD_DIM].zero_()
        idx = torch.arange(POSITION_PAIRS)
        # q = amp * e^{-i theta}: the score amp^2 * sum cos((d - 1) theta) peaks at d = 1.
        q[idx, 0] = amp * torch.cos(pairs) / gain
        q[idx + self.half, 0] = -amp * torch.sin(pairs) / gain
        k[idx, 0] = amp / gain
        v[torch.arange(self.dim), self.a + torch.arange(self.dim)] = 1.0 / gain
        o[self.b + torch.arange(self.dim), torch.arange(self.dim)] = 1.0

    def _induction_head(self) -> None:
        """Layer 1, head 0: query = current code, key = previous-token code, both in the RoPE
        pairs that barely rotate; the value (that position's own code) is written to ``C``."""
        gain = math.sqrt(self.hidden / 3)  # RMSNorm of [1, code, code]
        q, k, v, o = (self._layer(1, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        for w in (q, k, v):
            w[:COPY_HEAD_DIM].zero_()
        first = self.half - CONTENT_PAIRS
        rows = torch.cat([torch.arange(first, self.half), torch.arange(first, self.half) + self.half])
        cols = torch.arange(self.dim)
        q[rows, self.a + cols] = MATCH_SCALE / gain
        k[rows, self.b + cols] = MATCH_SCALE / gain
        v[cols, self.a + cols] = 1.0 / gain
        o[self.c + cols, cols] = 1.0


# ---- the benchmark -----------------------------------------------------------------------

COPY_MODEL_SHAPE = dict(hidden_size=768, num_layers=8, num_heads=6, intermediate_size=2048, vocab_size=8192)


def default_models(method: str) -> tuple[Path, Path | None]:
    """The cached copy model (~70M parameters) and, for ``draft_model``, its first two layers
    (where the whole copy circuit lives: the draft agrees with the target at a quarter of the
    layers)."""
    from pagoda.tools.make_model import cache_dir, version_tag

    root = cache_dir() / f"spec-copy-{version_tag()}"
    target = root / "target"
    if not (target / "model.safetensors").is_file():
        make_copy_model(target, **COPY_MODEL_SHAPE)
    if method != "draft_model":
        return target, None
    draft = root / "draft-2-layers"
    if not (draft / "model.safetensors").is_file():
        truncate_layers(target, draft, 2)
    return target, draft


def copy_workload(batch: int, prompt_len: int, period: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts made of a random unit of ``period`` tokens repeated to ``prompt_len``: the
    continuation that quotes them is the unit again."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        unit = [rng.randrange(16, vocab_size) for _ in range(period)]
        prompts.append((unit * (prompt_len // period + 1))[:prompt_len])
    return prompts


def builtin_models(method: str) -> tuple[Path, Path | None]:
    """The trained built-in model and, for ``draft_model``, its shipped draft (docs/demo-model.md)."""
    from pagoda.tools.make_model import builtin_model_path

    target, draft = builtin_model_path("main"), builtin_model_path("draft")
    if target is None or (method == "draft_model" and draft is None):
        raise SystemExit("--workload natural needs the built-in demo models (pagoda/demo_model)")
    return target, draft if method == "draft_model" else None


def natural_workload(batch: int, prompt_len: int, tokenizer: Any, seed: int) -> list[list[int]]:
    """Prompts cut from the built-in model's held-out English sample (text it never trained on),
    each from its own offset: greedy continuations of natural text, where the drafts must guess
    what the target writes next rather than what it quotes."""
    from pagoda.tools.make_model import builtin_model_path

    sample = json.loads((builtin_model_path("main") / "demo_eval.json").read_text())["sample_text"]
    ids = tokenizer.encode(sample, add_special_tokens=False)
    if len(ids) <= prompt_len:
        raise SystemExit(f"--prompt-len must be below {len(ids)} for the natural workload")
    rng = random.Random(seed)
    return [ids[o:o + prompt_len] for o in (rng.randrange(len(ids) - prompt_len) for _ in range(batch))]


def spec_config(args: argparse.Namespace, draft: Path | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
                           "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if draft is not None:
        cfg["model"] = str(draft)
    if args.disable_by_batch_size is not None:
        cfg["disable_by_batch_size"] = args.disable_by_batch_size
    return cfg


def _timed(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return elapsed


def _measure(llms: dict[str, Any], prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Output tokens/s of each engine on the same prompts, best of ``repeats`` runs (runs
    alternate between the engines, so drift on a shared machine hits both alike)."""
    tokens = len(prompts) * args.output_len
    best = {name: math.inf for name in llms}
    proposer = llms["on"].engine.core.proposer
    before = (proposer.num_proposed, proposer.num_accepted, proposer.num_verify_steps)
    for _ in range(args.repeats):
        for name, llm in llms.items():
            best[name] = min(best[name], _timed(llm, prompts, args.output_len))
    proposed, accepted, steps = (now - then for now, then in
                                 zip((proposer.num_proposed, proposer.num_accepted, proposer.num_verify_steps), before))
    return {"off_tokens_per_s": tokens / best["off"], "on_tokens_per_s": tokens / best["on"],
            "speedup": best["off"] / best["on"], "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": (accepted + steps) / steps if steps else None}


def run_spec_bench(args: argparse.Namespace) -> dict[str, Any]:
    from pagoda import LLM
    from pagoda.bench.common import engine_kwargs

    natural = args.workload == "natural"
    target, draft = (Path(args.model), Path(args.draft_model) if args.draft_model else None) if args.model \
        else builtin_models(args.method) if natural else default_models(args.method)
    if natural and args.draft_model:
        draft = Path(args.draft_model)
    if args.method == "draft_model" and draft is None:
        raise SystemExit("--method draft_model needs --draft-model (or no --model, for the built-in pair)")
    cfg = spec_config(args, draft)
    kwargs = engine_kwargs(args, model=str(target), speculative_config=None)
    llms = {"off": LLM(**kwargs), "on": LLM(**{**kwargs, "speculative_config": cfg})}
    vocab = llms["off"].config.model.vocab_size
    tokenizer = llms["off"].get_tokenizer()

    def workload(batch: int, seed: int) -> list[list[int]]:
        if natural:
            return natural_workload(batch, args.prompt_len, tokenizer, seed)
        return copy_workload(batch, args.prompt_len, args.period, vocab, seed)

    for llm in llms.values():  # warm-up
        _timed(llm, workload(2, seed=999), 8)
    results = {}
    for batch in args.batch_sizes:
        prompts = workload(batch, seed=batch)
        results[batch] = _measure(llms, prompts, args)
        _print_row(batch, results[batch])
    return {"model": str(target), "speculative_config": cfg, "torch_threads": torch.get_num_threads(),
            "workload": args.workload, "prompt_len": args.prompt_len,
            "period": args.period, "output_len": args.output_len, "repeats": args.repeats,
            "results": {str(b): r for b, r in results.items()}}


def _print_row(batch: int, r: dict[str, Any]) -> None:
    rate = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
    length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
    print(f"batch {batch:>3}: off {r['off_tokens_per_s']:8.1f} tok/s  on {r['on_tokens_per_s']:8.1f} tok/s  "
          f"speedup {r['speedup']:.2f}x  acceptance {rate}  tokens/step {length}", flush=True)


def spec_main(args: argparse.Namespace) -> int:
    from pagoda.bench.common import write_json

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    payload = run_spec_bench(args)
    write_json(args.output_json, payload)
    return 0


def _batch_sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"bad batch sizes {text!r}")
    return sizes


def add_spec_cli(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``spec`` under the ``pagoda bench`` subcommands."""
    from pagoda.bench.common import add_engine_args

    p = bench_subparsers.add_parser("spec", help="speculative decoding off vs on, per batch size",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    p.add_argument("--workload", choices=["copy", "natural"], default="copy",
                   help="copy: the copy model on repeated random tokens; natural: the trained built-in "
                        "model (and its shipped draft) continuing held-out English text")
    p.add_argument("--draft-model", default=None, help="draft model directory (method draft_model)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="propose nothing while more sequences than this are running")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=_batch_sizes("1,8,32"))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--period", type=int, default=32, help="length of the repeated unit of each prompt")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs per engine and batch size; the best counts")
    p.add_argument("--output-json", default=None)
    p.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads for torch (one thread avoids thread oversubscription on a shared machine)")
    add_engine_args(p)
    p.set_defaults(func=spec_main)
    return p
