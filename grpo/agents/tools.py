"""Tools: plain Python functions a model may call during an episode.

A tool is a function with a type hint on every parameter and a docstring with an `Args:` line for each,
which is what transformers' `get_json_schema` turns into the chat template's tool definition. This module
loads such functions from `path/to/file.py:f,g` (or `module:f,g`), finds the calls a completion makes in the
model's own chat-template format, and runs one call with a time limit, turning every failure into a message
for the conversation.

The formats parsed (style names as `tool_call_style` returns them):
- "qwen" (Qwen2.5): one or several `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks,
  anywhere in the completion. Without tags, a reply that ends with the call object (or a list of them) in a
  Markdown code block, or is that object bare: what Qwen2.5-Coder writes, since it was not trained on the tags its
  template asks for (vllm-project/vllm#32926; docs/learning.md, "Agents"). Such an object needs both "name" and
  "arguments": other JSON a reply ends with is no call.
- "llama" (Llama 3.1/3.2): the whole reply is the JSON call `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`; several calls are separated by `;`.

What it deliberately is not: the episode loop. Parsing what a model wrote never raises, and running a call
never raises or hangs the caller: a bad call becomes a `ToolCall` with an `error`, and its message says what went wrong.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from grpo.run.failures import first_line
from grpo.user_code import import_user_module, split_spec

Tool = Callable[..., Any]
STYLES = ("qwen", "llama")

_QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_QWEN_ENDS = ("<|im_end|>", "<|endoftext|>")
_FENCE = "```"
_LLAMA_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eom_id|>", "<|eot_id|>")


@dataclass(frozen=True)
class ToolCall:
    """One call a completion makes: the tool's name and arguments, or why it cannot run (`error`)."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def load_tools(spec: str) -> list[Tool]:
    """`path/to/file.py:f,g` or `module:f,g` -> [f, g], each checked to be a tool (see the module's docstring).
    A module is found as `--reward` finds one: where Python looks, then in the current folder."""
    form = "path/to/file.py:f,g (or module:f,g)"
    module_name, names = split_spec(spec, "tools", form, "my_tools.py:calculator,lookup")
    wanted = [name.strip() for name in names.split(",")]
    if not all(wanted):
        raise ValueError(f"tools {spec!r}: an empty name in {names!r}; fix: separate the names by single commas")
    module = import_user_module(spec, "tools", module_name, form)
    tools = [_checked_tool(module, module_name, name) for name in wanted]
    repeated = sorted({name for name in wanted if wanted.count(name) > 1})
    if repeated:
        raise ValueError(f"tools {spec!r}: {', '.join(repeated)} named twice; fix: name each tool once")
    return tools


def _checked_tool(module: Any, module_name: str, name: str) -> Tool:
    fn = getattr(module, name, None)
    where = f"tool {module_name}:{name}"
    if fn is None:
        raise ValueError(f"{where}: {module_name!r} has no {name!r}; fix: name a function it defines")
    if not callable(fn):
        raise ValueError(f"{where}: {name!r} is a {type(fn).__name__}, not a function; fix: name a function")
    try:
        get_json_schema(fn)
    except (TypeHintParsingException, DocstringParsingException, TypeError, ValueError) as err:
        why = first_line(str(err)) or type(err).__name__
        raise ValueError(f"{where}: no tool definition can be made ({why}); fix: give every parameter a type "
                         "hint and the docstring an Args: line for each") from None
    return fn


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The chat template's tool definitions (`apply_chat_template(..., tools=...)`), one per function."""
    return [get_json_schema(fn) for fn in tools]


def tool_call_style(chat_template: str | None) -> str:
    """Which format a chat template writes tool calls in: "qwen" or "llama" (see the module's docstring)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "qwen"
    if '"parameters": ' in template:
        return "llama"
    raise ValueError("the chat template has no tool support (it writes neither Qwen2.5's <tool_call> nor "
                     "Llama 3's JSON tool call); fix: use a model whose chat template takes tools, such as "
                     "Qwen2.5-Instruct or Llama-3.1/3.2-Instruct")


def parse_tool_calls(text: str, style: str, names: Collection[str] | None = None) -> list[ToolCall]:
    """The calls `text` makes, in the order written; [] when it makes none. A call whose JSON does not
    parse, lacks a name or arguments object, or (when `names` is given) names no known tool carries an
    `error` instead of raising."""
    if style == "qwen":
        calls = [_call(_single_braced(body), "arguments") for body in _QWEN_CALL.findall(text)]
        calls = calls or _untagged_qwen_calls(text)
    elif style == "llama":
        calls = _llama_calls(text)
    else:
        raise ValueError(f"tool call style {style!r}: expected one of {', '.join(STYLES)}")
    if names is not None:
        calls = [_known(call, names) for call in calls]
    return calls


def _llama_calls(text: str) -> list[ToolCall]:
    """Llama's reply is a call only when it opens with `<|python_tag|>` or `{`: prose that mentions JSON
    later is an answer, not a call."""
    body = text.strip()
    for end in _LLAMA_ENDS:
        body = body.removesuffix(end).rstrip()
    tagged = body.startswith(_LLAMA_TAG)
    body = body.removeprefix(_LLAMA_TAG).strip()
    if not (tagged or body.startswith("{")):
        return []
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as err:
            return [*calls, ToolCall(None, error=f"the tool call is not valid JSON ({err.msg})")]
        calls.append(_from_object(obj, "parameters"))
        at = end
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return calls


def _untagged_qwen_calls(text: str) -> list[ToolCall]:
    """The call objects a tagless reply ends with, in a code block or bare (the module's docstring)."""
    body = text.strip()
    for end in _QWEN_ENDS:
        body = body.removesuffix(end).rstrip()
    if body.endswith(_FENCE) and len(body) > len(_FENCE):
        opening = body.rfind(_FENCE, 0, len(body) - len(_FENCE))
        if opening < 0:
            return []
        block = body[opening + len(_FENCE):-len(_FENCE)]
        first_line, _, rest = block.partition("\n")
        body = (rest if first_line.strip().lower() in ("json", "") else block).strip()
    if not body.startswith(("{", "[")):
        return []
    body = _single_braced(body)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        looks_like_a_call = '"name"' in body and '"arguments"' in body
        return [ToolCall(None, error=f"the tool call is not valid JSON ({err.msg})")] if looks_like_a_call else []
    objects = obj if isinstance(obj, list) else [obj]
    if not objects or not all(isinstance(o, dict) and "name" in o and "arguments" in o for o in objects):
        return []
    return [_from_object(o, "arguments") for o in objects]


def _single_braced(body: str) -> str:
    """Qwen2.5's template shows a call's shape as `{{"name": ..., "arguments": ...}}` (its Jinja string literal
    keeps both braces) and its models copy them; `{{` never opens JSON, so the outer pair is dropped."""
    inner = body.strip()
    return inner[1:-1] if inner.startswith("{{") and inner.endswith("}}") else body


def _call(body: str, arguments_key: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(None, error=f"the tool call is not valid JSON ({err.msg})")
    return _from_object(obj, arguments_key)


def _from_object(obj: Any, arguments_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error='the tool call has no "name" string')
    # Llama models also write "arguments" for "parameters" (vLLM's Llama parser reads both)
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], error=f'the tool call\'s "{arguments_key}" is not a JSON object')
    return ToolCall(obj["name"], arguments)


def _known(call: ToolCall, names: Collection[str]) -> ToolCall:
    if call.error is not None or call.name in names:
        return call
    return ToolCall(call.name, call.arguments, error=f"unknown tool {call.name!r}; the tools are: "
                                                     f"{', '.join(sorted(names)) or 'none'}")


def run_tool_call(call: ToolCall, tools: Sequence[Tool], timeout_s: float) -> str:
    """The tool message's content for `call`: the function's result as a string (JSON for dicts, lists and
    tuples), or an `Error: ...` line for a call that did not parse, names no tool, gets arguments the
    function does not take, raises, runs past `timeout_s` or returns what cannot be made a string.

    The call runs in a daemon thread and the caller stops waiting at the deadline. Python cannot stop a
    thread, so a tool that hangs keeps running in the background until it returns, and its result is
    dropped; being a daemon, it does not keep the process alive at exit. A thread rather than a process:
    a tool is any function of the user's file, closures and unpicklable state included, and a thread starts
    in microseconds and shares what the tool already loaded, where a process would re-import the file."""
    if call.error is not None:
        return f"Error: {call.error}"
    by_name = {fn.__name__: fn for fn in tools}
    fn = by_name.get(call.name)
    if fn is None:
        return f"Error: {_known(call, by_name).error}"
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as err:
        return f"Error: tool {call.name!r} cannot take these arguments ({err})"
    except ValueError:  # no signature to read: the call itself says whether the arguments fit
        pass
    outcome: dict[str, Any] = {}
    worker = threading.Thread(target=_run_into, args=(fn, call.arguments, outcome), daemon=True,
                              name=f"tool-{call.name}")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return f"Error: tool {call.name!r} did not return within {timeout_s:g} s"
    if "error" in outcome:
        err = outcome["error"]
        return f"Error: tool {call.name!r} raised {type(err).__name__}: {first_line(str(err)) or 'no message'}"
    return _as_content(call.name, outcome["result"])


def _run_into(fn: Tool, arguments: dict[str, Any], outcome: dict[str, Any]) -> None:
    try:
        outcome["result"] = fn(**arguments)
    except BaseException as err:  # noqa: BLE001  a tool's failure of any kind is the conversation's, not ours
        outcome["error"] = err


def _as_content(name: str, result: Any) -> str:
    try:
        if isinstance(result, str):
            return result
        if isinstance(result, (dict, list, tuple)):
            return json.dumps(result)
        return str(result)
    except Exception as err:  # noqa: BLE001  a result that will not become text is the tool's fault
        return f"Error: tool {name!r} returned a {type(result).__name__} that cannot be made text " \
               f"({type(err).__name__}: {first_line(str(err)) or 'no message'})"

