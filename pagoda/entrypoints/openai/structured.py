"""Structured output and tool calling for the OpenAI routes: request fields -> the engine's
``StructuredOutputsParams``, and generated text -> ``tool_calls``.

``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and vLLM's
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (each the same as
that kind of ``structured_outputs``) become a grammar constraint. Tools: ``tool_choice``
``"none"`` generates text; ``"auto"`` (needs a server tool-call parser: ``--tool-call-parser``, by
default chosen from the chat template) lets the model write calls in its own format, found by it;
``"required"`` and a named function are forced through a grammar built from the functions'
parameter schemas, so the call always parses: a named function's output is its arguments
object, ``"required"``'s a JSON array of ``{"name", "parameters"}`` objects (one at most with
``parallel_tool_calls: false``). With llguidance the ``"required"`` grammar also lets the model
stop (EOS) right after any complete call, the closing ``]`` optional, so a model need not write
calls until ``max_tokens``; with xgrammar the array must close.

Tool-argument schemas are strict by default (``strict_schema``): an object schema that lists
``properties`` but says nothing of ``additionalProperties`` refuses undeclared keys, as
xgrammar's strict mode does (``--no-strict-tool-arguments`` turns it off).

A forced call cut off by ``max_tokens`` (finish_reason ``length``) comes back the same way
streamed and not: every call whose name was written is a tool call, the last one with the
arguments text generated so far (not valid JSON); output cut before any call's name is the
``content``.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from pagoda.entrypoints.openai.protocol import (ChatCompletionRequest, DeltaToolCall, ResponseFunctionCall,
                                                ResponseToolCall, SamplingRequest)
from pagoda.entrypoints.openai.tool_parsers import Call, ToolParser
from pagoda.entrypoints.openai.tool_parsers.partial import PartialCall, array_calls, skip_ws
from pagoda.sampling_params import check
from pagoda.structured_output import StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


# vLLM's older request fields -> the structured_outputs kind each one is.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def guided_field(req: SamplingRequest) -> str | None:
    """The first ``guided_*`` field the request sets, if any."""
    return next((name for name in GUIDED_FIELDS if getattr(req, name) is not None), None)


def structured_params(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The constraint ``response_format``, ``structured_outputs`` or the ``guided_*`` fields ask
    for (one of the three)."""
    fmt, ext, guided = req.response_format, req.structured_outputs, guided_field(req)
    check(ext is None or fmt is None or fmt.type == "text", "structured_outputs",
          "set response_format or structured_outputs, not both")
    if guided is not None:
        check(ext is None and (fmt is None or fmt.type == "text"), guided,
              f"set {guided} or response_format / structured_outputs, not both")
        kinds = {kind: getattr(req, name) for name, kind in GUIDED_FIELDS.items() if getattr(req, name) is not None}
        check(len(kinds) == 1, guided, f"set one of {', '.join(GUIDED_FIELDS)}, not several")
        return StructuredOutputsParams(**kinds)
    if ext is not None:
        fields = ext.model_dump(by_alias=True, exclude_none=True)
        return StructuredOutputsParams(**fields)
    if fmt is None or fmt.type == "text":
        check(fmt is None or fmt.json_schema is None, "response_format",
              "response_format.json_schema goes with type 'json_schema'")
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    check(fmt.json_schema is not None, "response_format",
          "response_format of type 'json_schema' needs response_format.json_schema with a schema")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)  # type: ignore[union-attr]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How one chat request handles tools: ``mode`` is none, auto, required or named."""

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool dicts, for the template
    named: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True
    strict: bool = True  # tool-argument schemas refuse undeclared properties (strict_schema)
    stop_at_boundary: bool = True  # "required": EOS allowed after each complete call (llguidance's Lark)

    @property
    def reads_markers(self) -> bool:
        """The tool parser reads calls in the reasoning format's markup (harmony), which the
        reasoning split then hands on in the content."""
        return self.mode == "auto" and self.parser is not None and self.parser.reads_special_tokens

    @property
    def forced(self) -> bool:
        """A grammar writes the call (``required`` or a named function): its output is the answer
        the forced-call result reads, whatever markup a reasoning format framed it in."""
        return self.mode in ("required", "named")

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        # Also with tool_choice "none" (as vLLM does): the model still sees what it may not call.
        return self.tools or None

    def constraint(self) -> StructuredOutputsParams | None:
        params = {t["function"]["name"]: t["function"].get("parameters") or EMPTY_PARAMETERS for t in self.tools}
        if self.strict:
            params = {name: strict_schema(schema) for name, schema in params.items()}
        if self.mode == "named":
            return StructuredOutputsParams(json=params[self.named])
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in params.items()]
        item = items[0] if len(items) == 1 else {"anyOf": items}
        if self.stop_at_boundary:
            return StructuredOutputsParams(grammar=_calls_lark(item, self.parallel))
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def scan(self, text: str, final: bool, cut: bool = False) -> tuple[int, list[Call]]:
        """(plain-content prefix length, complete calls) of the output so far; with ``cut`` (the
        output ended at ``max_tokens``) a forced call still being written counts too."""
        if self.mode == "named":
            return 0, [(self.named, text)] if final else []  # type: ignore[list-item]
        end, calls = self.scan_partial(text, final, cut)
        return end, [(c.name, c.arguments) for c in calls if c.complete or cut]  # type: ignore[misc]

    def scan_partial(self, text: str, final: bool, cut: bool = False) -> tuple[int, list[PartialCall]]:
        """(plain-content prefix length, calls) so far, the last maybe still being written
        (tool_parsers.partial); not for ``named``, whose whole output is the arguments. ``cut``
        (final output that ended at ``max_tokens``): a forced call whose name was written is kept,
        with its arguments so far."""
        if self.mode == "required":
            return 0, _forced_calls(text, final, cut)
        if self.mode == "auto" and self.parser is not None:
            return self.parser.scan_partial(text, final)
        return len(text), []

    def result(self, text: str, cut: bool = False) -> tuple[str | None, list[ResponseToolCall]]:
        """A finished choice's content and tool calls; ``cut``: it ended at ``max_tokens``."""
        # Cut by max_tokens: a forced call, or a harmony call (its arguments already streamed), with
        # the arguments written so far.
        end, calls = self.scan(text, final=True, cut=cut and (self.mode == "required" or self.reads_markers))
        content = text[:end] if end else None
        if not calls:
            # Markup never becomes content: a harmony call cut short leaves only the text before it.
            return (content if self.reads_markers else text), []
        return (content if content and content.strip() else None), [
            ResponseToolCall(id=new_call_id(), function=ResponseFunctionCall(name=n, arguments=a)) for n, a in calls]


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and does not say (xgrammar's strict mode, for tool arguments): the model may
    not invent keys. A bare ``{"type": "object"}`` stays any object."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (strict_schema(v) if k not in ("const", "enum", "default", "examples") else v)
           for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    if isinstance(schema.get("properties"), dict):  # property names are not schemas: keep them
        out["properties"] = {name: strict_schema(s) for name, s in schema["properties"].items()}
    return out


def _calls_lark(item: dict[str, Any], parallel: bool) -> str:
    """A Lark grammar (llguidance) for a JSON array of ``item`` objects that may end (EOS) after
    any complete item, its ``]`` optional; one item at most unless ``parallel``."""
    schema = dict(item, **{"x-guidance": {"whitespace_flexible": False}})
    more = ' ("," call)*' if parallel else ""
    return f'start: "[" call{more} "]"?\ncall: %json {json.dumps(schema)}\n'


def _forced_calls(text: str, final: bool, cut: bool = False) -> list[PartialCall]:
    """The ``{"name", "parameters"}`` objects of a (maybe partial) JSON array: the complete
    ones, and (while not ``final``, or when ``cut``) the one being written."""
    i = skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        return []
    return array_calls(text, i + 1, final, cut)[0]


def tool_plan(req: ChatCompletionRequest, auto_parser: Callable[[], ToolParser] | None) -> ToolPlan:
    """The request's ``ToolPlan``; ``ParamError`` (a 400) for a choice that cannot work.
    ``auto_parser`` is None when the server has no tool-call parser (``resolve_tool_parser``)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if not tools:
        check(choice in (None, "none"), "tool_choice", "tool_choice needs tools")
        return ToolPlan()
    names = [t["function"]["name"] for t in tools]
    check(len(set(names)) == len(names), "tools", "tools must have distinct function names")
    if choice is None or choice == "auto":
        param = "tool_choice" if choice == "auto" else "tools"
        check(auto_parser is not None, param, 'tools with tool_choice "auto" (the default when tools are given) '
              "need a tool-call parser: this model's chat template shows no call format pagoda knows, so start "
              'the server with --tool-call-parser NAME; or set tool_choice "required", "none" or a named function')
        parser = auto_parser()  # type: ignore[misc]
        parser.tools = tools
        return ToolPlan("auto", tools, parser=parser)
    if choice == "none":
        return ToolPlan("none", tools)
    fmt_set = req.response_format is not None and req.response_format.type != "text"
    check(not fmt_set and req.structured_outputs is None and guided_field(req) is None, "tool_choice",
          f"tool_choice {choice if isinstance(choice, str) else 'with a named function'} cannot be combined with "
          "response_format, structured_outputs or guided_*")
    if choice == "required":
        return ToolPlan("required", tools, parallel=req.parallel_tool_calls is not False)
    name = choice.function.name  # type: ignore[union-attr]
    check(name in names, "tool_choice", f"tool_choice names function {name!r}, which is not among the tools "
          f"({', '.join(names)})")
    return ToolPlan("named", tools, named=name)


class ToolStreamer:
    """Turns one choice's streamed text into content and ``tool_calls`` deltas. A call streams
    as it is written: a first delta with its id, name and the arguments so far, once the name
    is known and its arguments have started, then the arguments as they grow (a named
    function's arguments are the whole output). The deltas of a call concatenate to the call
    of the non-streamed answer (tool_parsers.partial)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent_content = 0
        self.sent_args: list[int] = []  # per started call: how much of its arguments went out
        self.named_id: str | None = None

    @property
    def made_calls(self) -> bool:
        return bool(self.sent_args) or self.named_id is not None

    def feed(self, delta: str, final: bool, cut: bool = False) -> tuple[str | None, list[DeltaToolCall]]:
        """``cut``: the last piece of output that ended at ``max_tokens`` (as ``ToolPlan.result``)."""
        self.text += delta
        if self.plan.mode == "named":
            return None, self._named(delta)
        cut = cut and final and self.plan.mode == "required"
        end, calls = self.plan.scan_partial(self.text, final, cut)
        if cut and not calls and not self.sent_args:
            end = len(self.text)  # no call's name was written: the text is the content
        content = self.text[self.sent_content:end] if end > self.sent_content else None
        self.sent_content = max(self.sent_content, end)
        out = []
        for j, call in enumerate(calls):
            if j >= len(self.sent_args):
                out.append(DeltaToolCall(index=j, id=new_call_id(), type="function",
                                         function=ResponseFunctionCall(name=call.name, arguments=call.arguments)))
                self.sent_args.append(len(call.arguments))
            elif len(call.arguments) > self.sent_args[j]:
                out.append(DeltaToolCall(index=j, function=ResponseFunctionCall(
                    arguments=call.arguments[self.sent_args[j]:])))
                self.sent_args[j] = len(call.arguments)
        return content, out

    def _named(self, delta: str) -> list[DeltaToolCall]:
        if self.named_id is None:
            self.named_id = new_call_id()
            return [DeltaToolCall(index=0, id=self.named_id, type="function",
                                  function=ResponseFunctionCall(name=self.plan.named, arguments=delta))]
        return [DeltaToolCall(index=0, function=ResponseFunctionCall(arguments=delta))] if delta else []
