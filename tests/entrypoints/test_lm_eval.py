"""lm-eval against ``pagoda serve``: its ``local-completions`` backend pointed at the server and its
``hf`` backend on the same checkpoint directory score the same multiple-choice task and greedy
generation task. Every log-likelihood agrees to 1e-4 (float32 on both sides; this random model's
continuations score -20 to -280), accuracies are identical and the greedy
generations are the same text: pagoda's echo+logprobs scoring is what evaluation harnesses see.

The tasks are local JSON files (no dataset download), written by the test."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from server_helpers import ServerProcess

MODEL = "tiny"
QUESTIONS = [
    ("The capital of France is", [" Paris", " a river", " the number seven"], 0),
    ("def fibonacci(n):\n    return", [" n", " fibonacci(n - 1) + fibonacci(n - 2)", " None"], 1),
    ("Once upon a time there was", [" a king", " an import statement", " 42"], 0),
    ("import os\nimport", [" sys", " the", " os.path"], 0),
    ("for i in range(10):\n   ", [" print(i)", " pass", " return i"], 0),
    ("class Point:\n    def __init__(self,", [" x, y):", " other):", ")"], 0),
]


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server  # tests/entrypoints/conftest.py: float32, as the checkpoint is


def _write_tasks(root: Path) -> None:
    mc = root / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = root / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": c[a]}) + "\n" for q, c, a in QUESTIONS))
    (root / "pagoda_mc.yaml").write_text(f"""task: pagoda_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (root / "pagoda_gen.yaml").write_text(f"""task: pagoda_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
""")


def _evaluate(model: str, model_args: str, tasks_dir: Path) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["pagoda_mc", "pagoda_gen"],
                           task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                           batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                           fewshot_random_seed=0)


def _loglikelihoods(result: dict[str, Any]) -> list[list[float]]:
    return [[float(r[0][0]) for r in s["resps"]] for s in result["samples"]["pagoda_mc"]]


def _generations(result: dict[str, Any]) -> list[str]:
    return [s["resps"][0][0] for s in result["samples"]["pagoda_gen"]]


def test_local_completions_agree_with_the_hf_backend(server: ServerProcess, llama_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    _write_tasks(tmp_path)
    served = _evaluate("local-completions", f"model={MODEL},base_url={server.base_url}/v1/completions,"
                       f"tokenizer_backend=huggingface,tokenizer={llama_dir},tokenized_requests=True,"
                       "num_concurrent=1,max_retries=1", tmp_path)
    reference = _evaluate("hf", f"pretrained={llama_dir},dtype=float32,device=cpu", tmp_path)

    got, want = _loglikelihoods(served), _loglikelihoods(reference)
    assert len(got) == len(QUESTIONS) and [len(x) for x in got] == [len(x) for x in want]
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert worst <= 1e-4, (worst, got, want)  # measured 2.9e-5: float32 sums of -20 to -280
    assert served["results"]["pagoda_mc"]["acc,none"] == reference["results"]["pagoda_mc"]["acc,none"]
    assert _generations(served) == _generations(reference)
    assert any(_generations(served))  # the generations are text, not all empty
