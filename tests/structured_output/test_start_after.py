"""A constraint that starts after a token (``start_after_token_id``, a reasoning model's
``</think>``): the tokens up to it are free, the grammar shapes everything after it. On a scripted
checkpoint whose greedy output is ``<think>Let me think</think> The answer``, so both halves
are known in advance."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pagoda import LLM, SamplingParams
from pagoda.structured_output import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def think_llm(think_model):
    # Several decode steps per round: a round must not run past the start token unmasked.
    llm = LLM(str(think_model.path), kv_cache_memory=16 << 20, max_model_len=256, num_scheduler_steps=8)
    yield llm
    llm.shutdown()


def prompt(llm: LLM) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Well?"}], tokenize=False,
                                                   add_generation_prompt=True)


def end_id(llm: LLM) -> int:
    return llm.get_tokenizer().convert_tokens_to_ids("</think>")


def generate(llm: LLM, **kw) -> list:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 40, **kw})
    return llm.generate([prompt(llm)], params, use_tqdm=False)[0].outputs


def test_unconstrained_output_is_the_script(think_llm, think_model) -> None:
    out = generate(think_llm)[0]
    assert out.text == f"<think>{think_model.reasoning}</think>{think_model.answer}"
    assert out.finish_reason == "stop"


def test_grammar_applies_after_the_start_token_only(think_llm, think_model) -> None:
    samples = generate(think_llm, n=2, structured_outputs=SO(json=SCHEMA, start_after_token_id=end_id(think_llm)))
    for out in samples:  # n = 2: each sample starts its own matcher after the fork
        head = f"<think>{think_model.reasoning}</think>"
        assert out.text.startswith(head), out.text  # the reasoning was free
        jsonschema.validate(json.loads(out.text[len(head):]), SCHEMA)  # the answer was not
        assert out.finish_reason == "stop"  # the grammar ended it


def test_without_start_token_the_grammar_applies_from_the_first_token(think_llm) -> None:
    out = generate(think_llm, structured_outputs=SO(json=SCHEMA))[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_output_cut_off_before_the_start_token(think_llm) -> None:
    out = generate(think_llm, max_tokens=3, structured_outputs=SO(json=SCHEMA, start_after_token_id=end_id(think_llm)))
    assert out[0].text.startswith("<think>") and out[0].finish_reason == "length"


def test_start_after_token_id_is_checked() -> None:
    for bad in (-1, "5", 1.5, True):
        with pytest.raises(ValueError, match="start_after_token_id"):
            SO(json=SCHEMA, start_after_token_id=bad)
    # The grammar is the same with or without a start: one compile serves both.
    assert SO(json=SCHEMA, start_after_token_id=7).key() == SO(json=SCHEMA).key()


def test_tokens_after_the_start_in_the_same_step_are_checked(think_llm) -> None:
    """Accepted drafts may follow the start token in the step that generated it, unmasked: the
    matcher made at the next step takes them, or refuses the sequence (it ends alone)."""
    from types import SimpleNamespace

    from pagoda.request import Request, Sequence
    from pagoda.structured_output.manager import StructuredOutputManager

    tok = think_llm.get_tokenizer()
    config = SimpleNamespace(structured_outputs_backend="auto",
                             model=SimpleNamespace(vocab_size=len(tok), eos_token_ids=(tok.eos_token_id,)))
    manager = StructuredOutputManager(config, tok)
    end, brace, letter = end_id(think_llm), tok.convert_tokens_to_ids("{"), tok.convert_tokens_to_ids("L")
    params = SamplingParams(structured_outputs=SO(json=SCHEMA, start_after_token_id=end))
    try:
        def seq_with(output: list[int]) -> Sequence:
            request = Request("r", [5, 6], params, (tok.eos_token_id,))
            manager.add(request)
            request.grammar.future.result(timeout=60)
            return Sequence("r", request, [5, 6, *output])

        assert manager._start_matcher(seq_with([letter])) is None  # still reasoning
        matcher = manager._start_matcher(seq_with([letter, end, brace]))
        assert not matcher.allows(brace) and not matcher.is_terminated()  # "{" was taken
        # A refused token ends the sequence as the constraint's failure (a GrammarLimitError: the
        # request's 400), naming the token.
        with pytest.raises(ValueError, match="cannot be followed.*\"L\""):
            manager._start_matcher(seq_with([end, letter]))
    finally:
        manager.shutdown()


def test_start_skip_after_lets_marked_occurrences_pass() -> None:
    so = SO(json=SCHEMA, start_after_token_id=5, start_skip_after=[[1, 2]])
    assert so.grammar_start([3, 5, 4]) == 2  # not after [1, 2]: starts
    assert so.grammar_start([1, 2, 5, 4]) is None  # after [1, 2]: passes
    assert so.grammar_start([1, 2, 5, 4, 1, 5, 6]) == 6
    assert so.grammar_start([5]) == 1 and SO(json=SCHEMA).grammar_start([9]) == 0
    assert so.key() == SO(json=SCHEMA).key()
    for bad in ([[]], [[-1]], [["a"]], 3, [[1]] * 17):
        with pytest.raises(ValueError, match="start_skip_after"):
            SO(json=SCHEMA, start_skip_after=bad)
