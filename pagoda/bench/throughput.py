"""``pagoda bench throughput``: offline throughput of pagoda against Hugging Face ``generate``
on the same model and the same seeded random-token workload, in one run. With ``--images N``
(a vision-language model) every prompt starts with ``N`` seeded noise images of
``--image-size``, given to both engines as images: each preprocesses them in its timed run.
``--compare text-twin`` (a vision-language model, text prompts) runs the same text workload on
the model and on its text-only twin (``pagoda.tools.text_twin``: the same decoder as a plain text
checkpoint), alternately ``--rounds`` times, and prints the ratio of the best runs: what a text
request costs on the vision model."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.async_sched import compare_throughput
from pagoda.bench.common import (FIRST_ORDINARY_ID, Workload, add_engine_args, engine_kwargs, print_table,
                                 random_workload, write_json)
from pagoda.bench.hf_peer import noise_image
from pagoda.entrypoints.argtypes import positive_int
from pagoda.bench.stages import print_stages, stage_rows
from pagoda.multimodal.inputs import image_token_id


def image_spec(args: argparse.Namespace) -> dict[str, int] | None:
    """``--images`` and ``--image-size`` as the HF peer reads them (None: text prompts)."""
    if not args.images:
        return None
    height, _, width = args.image_size.partition("x")
    return {"per_prompt": args.images, "height": int(height), "width": int(width or height), "seed": args.seed}


def _vision_tokens(hf_config: dict) -> set[int]:
    """Every token id a vision-language checkpoint gives an image meaning."""
    keys = ("vision_start_token_id", "image_token_id", "image_token_index", "vision_end_token_id", "video_token_id")
    return {int(hf_config[k]) for k in keys if hf_config.get(k) is not None}


def text_only(work: Workload, hf_config: dict) -> Workload:
    """The workload with every vision token of the model's vocabulary replaced by an ordinary one
    (a random prompt must not name an image it does not carry)."""
    special = _vision_tokens(hf_config)
    return Workload([[FIRST_ORDINARY_ID if t in special else t for t in p] for p in work.prompts], work.output_lens)


def with_images(work: Workload, hf_config: dict, per_prompt: int) -> Workload:
    """Each prompt opened by ``per_prompt`` image placeholders (Qwen's vision start, image, vision
    end tokens; LLaVA's image token, then an ordinary token so adjacent images stay apart); the
    random text keeps clear of every vision token."""
    if hf_config.get("vision_start_token_id") is not None:
        vision = [hf_config["vision_start_token_id"], hf_config["image_token_id"], hf_config["vision_end_token_id"]]
    else:
        vision = [image_token_id(hf_config), FIRST_ORDINARY_ID]
    return Workload([vision * per_prompt + p for p in text_only(work, hf_config).prompts], work.output_lens)


def _prompt_images(spec: dict[str, int] | None, index: int) -> list:
    if spec is None:
        return []
    n = spec["per_prompt"]
    return [noise_image(spec["seed"] + index * n + j, spec["height"], spec["width"]) for j in range(n)]


def run_pagoda(kwargs: dict[str, Any], work: Workload, images: dict[str, int] | None = None) -> dict[str, Any]:
    from pagoda import LLM, SamplingParams

    llm = LLM(**kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    prompts: list[dict] = [{"prompt_token_ids": p} for p in work.prompts]
    for i, prompt in enumerate(prompts):
        if images is not None:
            prompt["multi_modal_data"] = {"image": _prompt_images(images, i)}
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    stage_rows(llm, reset=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == work.num_output_tokens, (produced, work.num_output_tokens)
    stages = stage_rows(llm)
    llm.shutdown()
    rates: dict[str, Any] = _rates(elapsed, len(work.prompts), produced, work.num_prompt_tokens)
    if stages:
        rates["pipeline_stages"] = stages
    return rates


def run_hf(model: str, dtype: torch.dtype, work: Workload, batch_size: int,
           images: dict[str, int] | None = None) -> dict[str, float]:
    """Hugging Face ``generate`` on the same workload, in a child process that does not import
    pagoda, so its OpenMP threads wait the way torch's defaults make them (pagoda's own
    ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` choice is not imposed on the peer)."""
    import pagoda

    env = {k: v for k, v in os.environ.items() if k not in pagoda.OMP_DEFAULTS_SET}
    job = {"model": model, "dtype": str(dtype).removeprefix("torch."), "prompts": work.prompts,
           "output_lens": work.output_lens, "batch_size": batch_size, "images": images}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("hf_peer.py"))], input=json.dumps(job),
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the Hugging Face peer failed:\n{proc.stderr[-4000:]}")
    elapsed = json.loads(proc.stdout.strip().splitlines()[-1])["elapsed_s"]
    return _rates(elapsed, len(work.prompts), work.num_output_tokens, work.num_prompt_tokens)


def run_with_text_twin(args: argparse.Namespace, model: str, work: Workload) -> dict[str, Any]:
    """pagoda on the model and on its text-only twin (written to a temporary directory), same
    workload, alternately ``--rounds`` times each; each keeps its fastest round (on a shared
    machine a neighbour's load can slow any one run)."""
    import tempfile

    from pagoda.tools.text_twin import write_text_twin

    best: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pagoda-text-twin-") as tmp:
        twin = str(write_text_twin(model, tmp))
        for _ in range(args.rounds):
            for name, path in (("pagoda", model), ("text-twin", twin)):
                r = run_pagoda(engine_kwargs(args, model=path, tokenizer=args.tokenizer or path), work)
                if name not in best or r["output_tokens_per_s"] > best[name]["output_tokens_per_s"]:
                    best[name] = r
    return best


def _rates(elapsed: float, requests: int, out_tokens: int, prompt_tokens: int) -> dict[str, float]:
    return {"elapsed_s": elapsed, "requests_per_s": requests / elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / elapsed}


def run(args: argparse.Namespace) -> int:
    from pagoda.config import EngineConfig, EngineArgs

    config = EngineConfig.from_args(EngineArgs.from_namespace(args))
    work = random_workload(args.num_prompts, args.input_len, args.output_len, config.model.vocab_size, args.seed)
    images = image_spec(args)
    if (images is not None or args.compare == "text-twin") and not config.model.is_multimodal:
        raise SystemExit(f"--images and --compare text-twin need a vision-language model; "
                         f"{config.model.architecture} takes no images")
    if images is not None:
        if args.compare == "text-twin":
            raise SystemExit("--compare text-twin runs text prompts; leave out --images")
        work = with_images(work, config.model.hf_config, args.images)
    elif config.model.is_multimodal:
        work = text_only(work, config.model.hf_config)
    kwargs = engine_kwargs(args, model=config.model.path)
    if args.compare == "text-twin":
        results = run_with_text_twin(args, config.model.path, work)
    elif args.compare == "async-scheduling":
        if images is not None:
            raise SystemExit("--compare async-scheduling runs text prompts (an engine with images schedules "
                             "synchronously)")
        results = compare_throughput(kwargs, work, args.rounds)
    else:
        results = {"pagoda": run_pagoda(kwargs, work, images)}
    if args.compare == "hf":
        results["hf"] = run_hf(config.model.path, config.model.dtype, work, args.hf_batch_size, images)
    rows = [("engine", "req/s", "output tok/s", "total tok/s", "seconds")]
    for name, r in results.items():
        rows.append((name, f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                     f"{r['total_tokens_per_s']:.1f}", f"{r['elapsed_s']:.1f}"))
    shown = f", {args.images} images of {args.image_size} each" if images else ""
    print_table(f"throughput: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}{shown}",
                rows)
    print_stages(results.get("pagoda", {}).get("pipeline_stages"), "pagoda pipeline stages (per engine step)")
    payload: dict[str, Any] = {"workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len",
                                                                            "seed", "images", "image_size")},
                               "results": results}
    if "hf" in results:
        ratio = results["pagoda"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
        payload["output_tokens_per_s_ratio_vs_hf"] = ratio
        print(f"pagoda / hf output tok/s: {ratio:.2f}x (hf batch size {args.hf_batch_size})")
    if "text-twin" in results:
        ratio = results["pagoda"]["output_tokens_per_s"] / results["text-twin"]["output_tokens_per_s"]
        payload["output_tokens_per_s_ratio_vs_text_twin"] = ratio
        print(f"vision model / its text twin, text prompts, output tok/s: {ratio:.3f}x")
    if "async" in results:
        ratio = results["async"]["output_tokens_per_s"] / results["sync"]["output_tokens_per_s"]
        payload["output_tokens_per_s_ratio_async_vs_sync"] = ratio
        print(f"async / sync scheduling output tok/s: {ratio:.3f}x (one decode step per schedule in both; "
              f"max_num_seqs {kwargs.get('max_num_seqs')}; median of {args.rounds} alternating runs; "
              f"runs sync {_runs(results['sync'])}, async {_runs(results['async'])})")
    write_json(args.output_json, payload)
    return 0


def _runs(result: dict[str, Any]) -> str:
    return "/".join(f"{t:.2f}" for t in result["runs_s"]) + " s"


def add_cli(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("throughput", help="offline throughput, optionally against HF generate")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="32:512", help="MIN:MAX prompt tokens")
    p.add_argument("--output-len", default="16:256", help="MIN:MAX output tokens")
    p.add_argument("--compare", choices=["hf", "text-twin", "async-scheduling"], default=None,
                   help="hf: also run Hugging Face generate; text-twin (a vision-language model): also run "
                        "its language model as a plain text checkpoint on the same text prompts; "
                        "async-scheduling: run pagoda with async scheduling off and on (num_scheduler_steps 1 "
                        "both) and print the ratio")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="--compare text-twin / async-scheduling: alternating runs of each engine (text-twin "
                        "keeps each one's fastest, async-scheduling the median)")
    p.add_argument("--images", type=int, default=0, help="images per prompt (a vision-language model)")
    p.add_argument("--image-size", default="224x224", help="HEIGHTxWIDTH of each image, in pixels")
    p.add_argument("--output-json", default=None)
    p.add_argument("--seed-workload", dest="seed", type=int, default=0, help="workload seed")
    add_engine_args(p)
    p.set_defaults(func=run)
