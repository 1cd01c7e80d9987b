"""Tools: calculator, hermes / llama3 parsing, the registry's time limits and errors, YAML configs."""

import time

import pytest
from agent_helpers import AnswerTool, HangingTool, RaisingTool

from hybridrl.interactions import RetryFeedbackInteraction, load_interaction_config, pick_interaction
from hybridrl.tools import CalculatorTool, CallJob, ToolCall, ToolConfigError, ToolRegistry, load_tool_config
from hybridrl.tools.calculator import CalculatorError, evaluate, format_number
from hybridrl.tools.parser import parse_tool_calls


@pytest.mark.parametrize("expr, expected", [
    ("347 * 29", "10063"), ("(2 + 3) * -4", "-20"), ("84 / 4", "21"), ("1 / 3", "0.3333333333"),
    ("2 ** 10", "1024"), ("2^3", "8"), ("17 // 5", "3"), ("17 % 5", "2"), ("123456789 * 987654321", "121932631112635269"),
])
def test_calculator_values(expr, expected):
    assert format_number(evaluate(expr)) == expected


@pytest.mark.parametrize("expr, why", [
    ("1 / 0", "division by zero"), ("__import__('os')", "only numbers"), ("2 ** 100000", "exponents"),
    ("3 +", "not an arithmetic expression"), ("x * 2", "only numbers"),
])
def test_calculator_rejects(expr, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expr)


def test_calculator_tool_reports_errors_as_text():
    tool = CalculatorTool()
    assert tool.execute("i", {"expression": "6*7"}).text == "42"
    bad = tool.execute("i", {"expression": "6/0"})
    assert bad.error and bad.text == "Error: division by zero"


def test_parse_hermes_calls_and_content():
    text = 'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>' \
           '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    turn = parse_tool_calls(text, "hermes")
    assert turn.content == "Let me compute."
    assert turn.calls == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("python", {"code": "print(1)"})]
    assert turn.errors == []


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calc", "arguments": {}}', "not closed"),
])
def test_parse_hermes_malformed_calls_become_errors(text, error):
    turn = parse_tool_calls(text, "hermes")
    assert turn.calls == [] and turn.has_calls
    assert error in turn.errors[0]


def test_parse_plain_text_and_llama3_json():
    assert not parse_tool_calls("The answer is 4.", "hermes").has_calls
    turn = parse_tool_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1+1"}}', "llama3_json")
    assert turn.calls == [ToolCall("calculator", {"expression": "1+1"})]
    assert not parse_tool_calls("Just text {with braces}", "llama3_json").has_calls
    with pytest.raises(ValueError, match="allowed"):
        parse_tool_calls("x", "mistral")


def test_registry_errors_timeouts_and_arguments():
    HangingTool.gate.clear()
    registry = ToolRegistry([CalculatorTool(), RaisingTool(), HangingTool(config={"timeout_s": 0.3})])
    jobs = [CallJob(ToolCall("calculator", {"expression": "2+2"}), "i"),
            CallJob(ToolCall("boom", {}), "i"),
            CallJob(ToolCall("sleepy", {}), "i"),
            CallJob(ToolCall("nope", {}), "i"),
            CallJob(ToolCall("calculator", {}), "i"),
            CallJob(ToolCall("calculator", {"expression": 5, "extra": 1}), "i")]
    start = time.monotonic()
    results = registry.execute(jobs)
    elapsed = time.monotonic() - start
    HangingTool.gate.set()
    assert [r.error for r in results] == [False, True, True, True, True, True]
    assert results[0].text == "4"
    assert results[1].text == "Error: RuntimeError: kaboom"
    assert results[2].text == "Error: tool 'sleepy' timed out after 0.3 s"
    assert "unknown tool 'nope'" in results[3].text and "calculator" in results[3].text
    assert "missing required argument(s) ['expression']" in results[4].text
    assert "unknown argument(s) ['extra']" in results[5].text
    assert elapsed < 30  # the hung call was abandoned, not waited for (its gate only opens above)


def test_registry_lifecycle_with_tools_kwargs():
    tool = AnswerTool()
    registry = ToolRegistry([tool])
    kwargs = {"submit": {"create_kwargs": {"ground_truth": "7"}, "execute_kwargs": {"note": "x"}}}
    registry.create("a", kwargs)
    registry.execute([CallJob(ToolCall("submit", {"answer": "7"}), "a", {"note": "x"})])
    assert tool.state["a"]["seen_kwargs"] == {"note": "x"}
    assert registry.finish("a", kwargs) == {"submit": 1.0}
    assert tool.released == ["a"]
    with pytest.raises(ValueError, match="not configured"):
        registry.create("b", {"calculator": {}})
    with pytest.raises(ValueError, match="create_kwargs"):
        registry.create("b", {"submit": {"bad_key": {}}})


def test_load_tool_config_yaml(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: calculator\n    config: {timeout_s: 2}\n"
        "  - class_name: agent_helpers.AnswerTool\n"
        "    tool_schema:\n      type: function\n      function:\n        name: check\n"
        "        description: check an answer\n"
        "        parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}\n")
    registry = load_tool_config(path)
    assert sorted(registry.tools) == ["calculator", "check"]
    assert registry.tools["calculator"].timeout_s == 2.0
    assert registry.schemas()[1]["function"]["description"] == "check an answer"


@pytest.mark.parametrize("body, message", [
    ("tools: {}\n", "'tools' list"),
    ("tools:\n  - config: {}\n", "tools[0]: each tool must be a mapping with a string 'class_name'"),
    ("tools:\n  - class_name: calculator\n    colour: red\n", "unknown key(s) ['colour']"),
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n", "verl's own tools"),
    ("tools:\n  - class_name: calculator\n    config: {timeout_s: -1}\n", "timeout_s must be > 0"),
    ("tools:\n  - class_name: calculator\n  - class_name: calculator\n", "unique"),
])
def test_load_tool_config_errors_name_the_entry(tmp_path, body, message):
    path = tmp_path / "tools.yaml"
    path.write_text(body)
    with pytest.raises((ToolConfigError, ValueError)) as info:
        load_tool_config(path)
    assert message in str(info.value)


def test_python_tool_runs_sandboxed_and_times_out(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: python\n    config: {timeout_s: 2}\n")
    registry = load_tool_config(path)
    ok, loop, crash = registry.execute([
        CallJob(ToolCall("python", {"code": "print(sum(range(10)))"}), "i"),
        CallJob(ToolCall("python", {"code": "while True: pass"}), "i"),
        CallJob(ToolCall("python", {"code": "1/0"}), "i"),
    ])
    assert ok.text.strip() == "45" and not ok.error
    assert loop.error and loop.text.startswith("Error: killed")
    assert crash.error and "ZeroDivisionError" in crash.text


def test_interaction_config_and_retry_feedback(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text("interaction:\n  - name: teacher\n    class_name: retry_feedback\n    config: {max_retries: 1}\n")
    interactions = load_interaction_config(path)
    teacher = pick_interaction(interactions, {"ground_truth": "12"})
    assert isinstance(teacher, RetryFeedbackInteraction) and teacher.name == "teacher"
    teacher.start_interaction("a", ground_truth="12")
    wrong = [{"role": "assistant", "content": "<answer>13</answer>"}]
    assert teacher.generate_response("a", wrong) == (False, "Your answer 13 is wrong. Check your work and try again.", 0.0, {})
    assert teacher.generate_response("a", wrong)[:3] == (True, "Wrong.", 0.0)
    teacher.start_interaction("b", ground_truth="1,200")
    assert teacher.generate_response("b", [{"role": "assistant", "content": "#### 1200"}])[:3] == (True, "Correct.", 1.0)
    with pytest.raises(ValueError, match="not configured"):
        pick_interaction(interactions, {"name": "other"})
