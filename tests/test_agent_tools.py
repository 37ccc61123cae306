"""grpo.agents.tools and the calculator: tools loaded and checked, their definitions, tool calls parsed in
Qwen2.5's and Llama 3's formats, and one call run with every way it can fail turned into a message."""

from __future__ import annotations

import json
import threading
import time
from textwrap import dedent

import pytest

from grpo.agents.calculator import calculator
from grpo.agents.tools import (ToolCall, load_tools, parse_tool_calls, run_tool_call, tool_call_style,
                               tool_schemas)

TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def lookup(key: str) -> dict:
    """Look a key up.

    Args:
        key: what to look up.
    """
    return {"key": key, "found": True}


def no_hints(a, b: int) -> int:
    """Add.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


def no_args_section(a: int) -> int:
    """Return a."""
    return a


RATE = 3
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(dedent(TOOLS_FILE))
    return path


def one_line_error(spec: str) -> str:
    with pytest.raises(ValueError) as caught:
        load_tools(spec)
    message = str(caught.value)
    assert "\n" not in message and "fix:" in message, message
    return message


# -- loading -------------------------------------------------------------------------------------------------


def test_load_tools_returns_the_named_functions_of_a_file_in_order(tools_file):
    tools = load_tools(f"{tools_file}:lookup, add")
    assert [fn.__name__ for fn in tools] == ["lookup", "add"]
    assert tools[1](a=2, b=3) == 5


def test_load_tools_finds_a_module_in_the_current_folder(tools_file, monkeypatch):
    monkeypatch.chdir(tools_file.parent)
    monkeypatch.syspath_prepend(str(tools_file.parent))
    assert [fn.__name__ for fn in load_tools("my_tools:add")] == ["add"]


def test_load_tools_finds_an_installed_module():
    assert load_tools("grpo.agents.calculator:calculator") == [calculator]


@pytest.mark.parametrize("spec", ["my_tools.py", "my_tools.py:", ":add", "my_tools.py: "])
def test_a_spec_without_module_and_functions_is_one_line(spec):
    assert "expected path/to/file.py:f,g" in one_line_error(spec)


def test_an_empty_name_among_the_tools_is_one_line():
    assert "an empty name in 'add,,lookup'" in one_line_error("my_tools.py:add,,lookup")


def test_a_file_that_does_not_import_is_one_line_naming_the_file_and_the_error(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    message = one_line_error(f"{broken}:f")
    assert str(broken) in message and "SyntaxError" in message
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('no network\\nsecond line')\n")
    message = one_line_error(f"{raising}:f")
    assert "RuntimeError: no network" in message and "second line" not in message


def test_a_missing_file_is_one_line(tmp_path):
    assert "cannot import" in one_line_error(f"{tmp_path / 'absent.py'}:f")


def test_a_function_the_file_lacks_is_one_line(tools_file):
    message = one_line_error(f"{tools_file}:add,subtract")
    assert "'subtract'" in message and "my_tools.py" in message


def test_a_name_that_is_not_a_function_is_one_line(tools_file):
    assert "'RATE' is a int, not a function" in one_line_error(f"{tools_file}:RATE")


@pytest.mark.parametrize("name, reason", [("no_hints", "type hint"), ("no_docstring", "docstring"),
                                          ("no_args_section", "description")])
def test_a_function_without_hints_or_documented_arguments_is_one_line_naming_it(tools_file, name, reason):
    message = one_line_error(f"{tools_file}:add,{name}")
    assert f"my_tools.py:{name}" in message and reason in message and "type hint and the docstring" in message


def test_a_tool_named_twice_is_one_line(tools_file):
    assert "add named twice" in one_line_error(f"{tools_file}:add,lookup,add")


# -- definitions and the template's style ---------------------------------------------------------------------


def test_tool_schemas_are_the_chat_templates_function_definitions(tools_file):
    (add_schema, calc_schema) = tool_schemas([*load_tools(f"{tools_file}:add"), calculator])
    assert add_schema["type"] == "function"
    function = add_schema["function"]
    assert function["name"] == "add" and function["description"] == "Add two numbers."
    assert function["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first number."}
    assert function["parameters"]["required"] == ["a", "b"]
    assert calc_schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"


def test_tool_call_style_reads_the_chat_template():
    qwen = '{%- if tools %}...<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}...'
    llama = "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    assert tool_call_style(qwen) == "qwen"
    assert tool_call_style(llama) == "llama"


@pytest.mark.parametrize("template", [None, "{% for message in messages %}{{ message['content'] }}{% endfor %}"])
def test_a_chat_template_without_tool_support_is_one_line(template):
    with pytest.raises(ValueError, match="no tool support") as caught:
        tool_call_style(template)
    assert "\n" not in str(caught.value) and "fix:" in str(caught.value)


# -- parsing ---------------------------------------------------------------------------------------------------


def test_qwen_parses_one_call_inside_prose():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert parse_tool_calls(text, "qwen") == [ToolCall("calculator", {"expression": "2+3"})]


def test_qwen_parses_several_calls_in_order():
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>')
    assert parse_tool_calls(text, "qwen") == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "x"})]


def test_qwen_reads_a_call_cut_before_its_closing_tag():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
    assert parse_tool_calls(text, "qwen") == [ToolCall("add", {"a": 1, "b": 2})]


def test_qwen_reads_a_call_in_the_doubled_braces_its_template_shows():
    text = '<tool_call>{{"name": "calculator", "arguments": {"expression": "7*0.5"}}}</tool_call>'
    assert parse_tool_calls(text, "qwen") == [ToolCall("calculator", {"expression": "7*0.5"})]
    assert parse_tool_calls('<tool_call>{{"name": "add"}</tool_call>', "qwen")[0].error is not None


CODER_CALL = '{\n  "name": "calculator",\n  "arguments": {\n    "expression": "(5 * 25 * 4) + (2 * 60 * 3)"\n  }\n}'


@pytest.mark.parametrize("text", [
    f"```json\n{CODER_CALL}\n```",                            # what Qwen2.5-Coder writes for the tags
    f"First the first four weeks.\n\n```json\n{CODER_CALL}\n```\n<|im_end|>",  # after prose, its end token kept
    f"```\n{CODER_CALL}\n```",
    CODER_CALL,                                               # bare, the whole reply
    "{" + CODER_CALL + "}",                                   # in the doubled braces its template shows
])
def test_qwen_reads_an_untagged_call_that_ends_the_reply(text):
    assert parse_tool_calls(text, "qwen", names={"calculator"}) == [
        ToolCall("calculator", {"expression": "(5 * 25 * 4) + (2 * 60 * 3)"})]


def test_qwen_reads_a_list_of_untagged_calls_and_checks_their_names():
    text = '```json\n[{"name": "add", "arguments": {"a": 1}}, {"name": "sub", "arguments": {}}]\n```'
    add, sub = parse_tool_calls(text, "qwen", names={"add"})
    assert add == ToolCall("add", {"a": 1}) and sub.name == "sub" and "unknown tool" in sub.error


@pytest.mark.parametrize("text", [
    f"```json\n{CODER_CALL}\n```\nSo the total is 860 km.",    # the model went on: it answered itself
    f"The call would be {CODER_CALL}",                          # bare JSON after prose
    '```json\n{"name": "Ann", "age": 30}\n```',                 # JSON that is not a call
    '```python\nprint({"name": "f", "arguments": {}})\n```',
    "```json\n[1, 2]\n```", "```", "``````", '{"name": "f"',
])
def test_qwen_reads_no_call_where_the_reply_does_not_end_with_a_call_object(text):
    assert parse_tool_calls(text, "qwen") == []


def test_qwen_tags_take_precedence_and_a_broken_untagged_call_is_an_error():
    tagged = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert parse_tool_calls(f"{tagged}\n```json\n{CODER_CALL}\n```", "qwen") == [ToolCall("add", {"a": 1})]
    (broken,) = parse_tool_calls('```json\n{"name": "calculator", "arguments": {"expression": "1+1"\n```', "qwen")
    assert broken.name is None and "not valid JSON" in broken.error


def test_a_completion_without_calls_parses_to_none():
    assert parse_tool_calls("The answer is 5.", "qwen") == []
    assert parse_tool_calls('The answer is 5, as in {"a": 5}.', "llama") == []


@pytest.mark.parametrize("body, error", [
    ('{"name": "add", "arguments": {"a": 1,}}', "not valid JSON"),
    ('["add", {"a": 1}]', 'no "name"'),
    ('{"arguments": {"a": 1}}', 'no "name"'),
    ('{"name": "add", "arguments": [1, 2]}', "not a JSON object"),
])
def test_qwen_malformed_calls_parse_with_an_error_beside_good_ones(body, error):
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    calls = parse_tool_calls(f"{good}\n<tool_call>\n{body}\n</tool_call>", "qwen")
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert len(calls) == 2 and calls[1].error is not None and error in calls[1].error


def test_llama_parses_a_json_call_with_or_without_the_python_tag():
    plain = '{"name": "calculator", "parameters": {"expression": "2+3"}}'
    expected = [ToolCall("calculator", {"expression": "2+3"})]
    assert parse_tool_calls(plain, "llama") == expected
    assert parse_tool_calls(f"<|python_tag|>{plain}<|eom_id|>", "llama") == expected
    assert parse_tool_calls(f"  {plain}<|eot_id|>\n", "llama") == expected


def test_llama_reads_arguments_for_parameters_and_no_arguments_as_none():
    assert parse_tool_calls('{"name": "f", "arguments": {"x": 1}}', "llama") == [ToolCall("f", {"x": 1})]
    assert parse_tool_calls('{"name": "f"}', "llama") == [ToolCall("f", {})]


def test_llama_parses_several_calls_separated_by_semicolons():
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "lookup", "parameters": {"key": "x"}}'
    assert parse_tool_calls(text, "llama") == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "x"})]


def test_llama_malformed_json_after_a_good_call_is_a_call_with_an_error():
    calls = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "lookup", "par', "llama")
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert len(calls) == 2 and calls[1].name is None and "not valid JSON" in calls[1].error
    (tagged,) = parse_tool_calls("<|python_tag|>calculator.call(expression='2')", "llama")
    assert "not valid JSON" in tagged.error


def test_an_unknown_tool_name_parses_with_an_error_when_the_names_are_given():
    text = ('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
            '<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>')
    add, sub = parse_tool_calls(text, "qwen", names={"add", "lookup"})
    assert add.error is None
    assert sub.name == "sub" and sub.error == "unknown tool 'sub'; the tools are: add, lookup"


def test_an_unknown_style_is_one_line():
    with pytest.raises(ValueError, match="style 'mistral': expected one of qwen, llama"):
        parse_tool_calls("", "mistral")


# -- running ---------------------------------------------------------------------------------------------------


def test_run_returns_the_result_as_text_and_dicts_as_json(tools_file):
    tools = load_tools(f"{tools_file}:add,lookup")
    assert run_tool_call(ToolCall("add", {"a": 2, "b": 3}), tools, timeout_s=5) == "5"
    assert json.loads(run_tool_call(ToolCall("lookup", {"key": "k"}), tools, 5)) == {"key": "k", "found": True}
    assert run_tool_call(ToolCall("calculator", {"expression": "(3 + 4) * 2.5"}), [calculator], 5) == "17.5"


def test_run_returns_a_parse_error_and_an_unknown_tool_as_messages(tools_file):
    tools = load_tools(f"{tools_file}:add")
    assert run_tool_call(ToolCall(None, error="the tool call is not valid JSON (x)"), tools, 5) == \
        "Error: the tool call is not valid JSON (x)"
    assert run_tool_call(ToolCall("sub", {}), tools, 5) == "Error: unknown tool 'sub'; the tools are: add"


@pytest.mark.parametrize("arguments", [{"a": 1}, {"a": 1, "b": 2, "c": 3}, {"x": 1, "b": 2}])
def test_run_refuses_arguments_the_function_does_not_take_without_calling_it(arguments):
    called = []

    def add(a: int, b: int) -> int:
        called.append(True)
        return a + b

    message = run_tool_call(ToolCall("add", arguments), [add], 5)
    assert message.startswith("Error: tool 'add' cannot take these arguments (") and not called


def test_run_turns_a_raising_tool_into_an_error_message():
    message = run_tool_call(ToolCall("calculator", {"expression": "1 / 0"}), [calculator], 5)
    assert message == "Error: tool 'calculator' raised ZeroDivisionError: division by zero"

    def leaves(code: int) -> str:
        raise SystemExit(code)

    assert run_tool_call(ToolCall("leaves", {"code": 3}), [leaves], 5) == "Error: tool 'leaves' raised SystemExit: 3"


def test_run_stops_waiting_for_a_hanging_tool_at_the_deadline():
    release = threading.Event()

    def hang(seconds: float) -> str:
        release.wait(seconds)
        return "late"

    start = time.monotonic()
    message = run_tool_call(ToolCall("hang", {"seconds": 30}), [hang], timeout_s=0.2)
    waited = time.monotonic() - start
    release.set()  # the worker thread ends now rather than outliving the test
    assert message == "Error: tool 'hang' did not return within 0.2 s"
    assert 0.2 <= waited < 5


def test_run_turns_a_result_that_cannot_be_text_into_an_error_message():
    class Unprintable:
        def __str__(self):
            raise RuntimeError("no text")

    def junk() -> object:
        return Unprintable()

    def unserializable() -> dict:
        return {"values": {1, 2}}

    assert run_tool_call(ToolCall("junk", {}), [junk], 5) == \
        "Error: tool 'junk' returned a Unprintable that cannot be made text (RuntimeError: no text)"
    assert run_tool_call(ToolCall("unserializable", {}), [unserializable], 5).startswith(
        "Error: tool 'unserializable' returned a dict that cannot be made text (TypeError:")


def test_run_does_not_change_the_calls_arguments():
    def keep(values: list) -> int:
        return len(values)

    call = ToolCall("keep", {"values": [1, 2]})
    assert run_tool_call(call, [keep], 5) == "2" and call.arguments == {"values": [1, 2]}


# -- the calculator ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("7 / 2", 3.5),
                                               ("6 / 3", 2), ("7 // 2", 3), ("7 % 4", 3), ("-2 ** 2", -4),
                                               ("+1.5e3", 1500), (" 2 ** 10 ", 1024),
                                               # as a word problem writes numbers
                                               ("$1,200 * 3", 3600), ("1,234,567 - 7", 1234560),
                                               ("3 \u00d7 4 \u00f7 2", 6), ("\u22122 + 5", 3)])
def test_calculator_evaluates_arithmetic(expression, value):
    result = calculator(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "x + 1", "abs(-1)", "(1).real",
                                        "[1, 2]", "True + 1", "'a' * 3", "1 if 1 else 2", "2 +",
                                        "1, 2", "1,20 + 1", "1,2345"])
def test_calculator_refuses_anything_but_numbers_and_operators(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_calculator_refuses_a_power_too_large_to_compute_quickly():
    with pytest.raises(ValueError, match="too large"):
        calculator("9 ** 9 ** 9")
    assert calculator("2 ** -2") == 0.25
