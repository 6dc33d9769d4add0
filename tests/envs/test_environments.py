"""The calculator tool (parsed, never eval'd), the Qwen <tool_call> parser, and the calculator environment:
malformed, unknown and failing calls are error observations, counted, never exceptions; a turn without a
call is the final answer, checked by math-verify."""

from types import SimpleNamespace

import pytest

from megaopd.envs import EnvConfig, build_environment, parse_tool_calls
from megaopd.envs.calculator import ToolError, calculate


def call(expr: str) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr


@pytest.mark.parametrize(
    "expr, want",
    [
        ("12 * (3 + 4)", "84"),
        ("7 / 2", "3.5"),
        ("2 ** 10", "1024"),
        ("-3 + 5 % 3", "-1"),
        ("9 // 2", "4"),
        ("1 / 3", "0.333333333333"),
        ("2^3", "8"),
        ("6 / 3", "2"),
    ],
)
def test_calculator_values(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize(
    "expr, why",
    [
        ("__import__('os').system('true')", "a call"),
        ("x + 1", "a name"),
        ("(1).real", "an attribute"),
        ("1 / 0", "division by zero"),
        ("2 ** 10 ** 9", "too large"),
        ("9" * 80, "too large"),
        ("1 +", "cannot parse"),
        ("", "non-empty"),
        ("1 < 2", "a comparison"),
        ("1" * 300, "longer than"),
        ("'a' * 3", "unsupported"),
        ("(-8) ** 0.5", "not a real number"),
    ],
)
def test_calculator_refuses_anything_but_arithmetic(expr, why):
    with pytest.raises(ToolError, match=why):
        calculate(expr)


def test_tool_call_parser():
    calls = parse_tool_calls("first " + call("1+1") + " then " + call("2*3"))
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+1"}, ""),
        ("calculator", {"expression": "2*3"}, ""),
    ]
    assert parse_tool_calls("no tools here, \\boxed{3}") == []
    assert "not valid JSON" in parse_tool_calls("<tool_call>{name: calc}</tool_call>")[0].error
    assert "without its" in parse_tool_calls('<tool_call>{"name": "calculator"')[0].error
    assert "JSON object" in parse_tool_calls("<tool_call>[1, 2]</tool_call>")[0].error
    s = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>')
    assert s[0].arguments == {"expression": "1"} and not s[0].error


def test_environment_answers_errors_and_final_answers():
    env = build_environment(EnvConfig(name="calculator"))
    env.reset(SimpleNamespace(answer="84", problem="Compute 12 * 7."))
    assert env.tools[0]["function"]["name"] == "calculator"
    r = env.step("Let me compute. " + call("12 * 7"))
    assert (r.done, r.observations, r.tool_calls, r.tool_errors) == (False, ["84"], 1, 0)
    bad = env.step(
        '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
        "<tool_call>not json</tool_call>"
        + call("1 / 0")
        + call("os.system(1)")
        + '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
    )
    assert not bad.done and bad.tool_calls == 5 and bad.tool_errors == 5
    assert all(o.startswith("Error: ") for o in bad.observations)
    assert "unknown tool 'calc'" in bad.observations[0] and "division by zero" in bad.observations[2]
    final = env.step("So the answer is \\boxed{84}.")
    assert final.done and final.reward == 1.0 and final.tool_calls == 0
    assert env.step("The answer is \\boxed{85}.").reward == 0.0


def test_config_rejects_unknown_environments():
    with pytest.raises(ValueError, match="env.name='web'.*calculator"):
        EnvConfig(name="web")
    assert not EnvConfig().enabled


def test_the_docs_example_environment_runs():
    """docs/environments.md's example environment, executed as written."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "environments.md")).read()
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    ns: dict = {}
    exec(compile(code, "docs/environments.md", "exec"), ns)
    env = ns["UnitsEnv"]()
    env.reset(SimpleNamespace(answer="250", problem="p"))
    r = env.step(
        '<tool_call>{"name": "convert", "arguments": {"value": 2.5, "from": "m", "to": "cm"}}</tool_call>'
        '<tool_call>{"name": "convert", "arguments": {"value": 1, "from": "mi", "to": "m"}}</tool_call>'
    )
    assert r.observations[0] == "250.0" and r.tool_errors == 1 and not r.done
    assert env.step("\\boxed{250}").reward == 1.0


def test_agentic_data_is_what_the_generator_makes():
    """examples/tiny/agentic_data/ is byte-identical to a fresh `tools/build_tiny_agentic.py --data` build."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, os.path.join(root, "tools", "build_tiny_agentic.py"), "--data", "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=root),
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_agentic_preset_loads_and_refuses_a_teacher_prompt_of_its_own():
    import os

    from megaopd.config import load_config
    from megaopd.config.load import ConfigError
    from megaopd.config.schema import MegaOPDConfig

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    preset = os.path.join(root, "examples", "tiny", "agentic.yaml")
    cfg = load_config(MegaOPDConfig, preset, [])
    assert cfg.env.name == "calculator" and cfg.rollout.max_turns == 3
    with pytest.raises(ConfigError, match="teacher_prompt=own"):
        load_config(MegaOPDConfig, preset, ["data.teacher_prompt=own"])
    with pytest.raises(ConfigError, match="max_trajectory_tokens"):  # prompt + trajectory over 512 positions
        load_config(MegaOPDConfig, preset, ["rollout.max_trajectory_tokens=1000"])


def test_multi_turn_goldens_mask_their_tool_turns():
    """A golden trace with a tool turn: tokenized turn by turn (the tool turn as ToolTurns renders it), its
    tool turn masked out of the SFT loss; the assistant's tokens, turn ends included, kept."""
    import os

    from megaopd.data import PromptDataset
    from megaopd.data.config import DataConfig, SourceConfig
    from megaopd.models.hf_io import load_tokenizer
    from megaopd.rollout.trajectories import ToolTurns

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tok = load_tokenizer(os.path.join(root, "examples", "tiny", "models", "student"))
    cfg = DataConfig(
        sources=[SourceConfig(path=os.path.join(root, "examples", "tiny", "agentic_data", "val.jsonl"), max_rows=3)],
        max_prompt_len=128,
    )
    for ex in PromptDataset.load(cfg, tok, log=None).examples[0]:
        ids, mask = ex.golden_ids, ex.golden_loss_mask
        tool = [i for i, m in zip(ids[len(ex.prompt_ids) :], mask[len(ex.prompt_ids) :]) if not m]
        assert tool == ToolTurns(tok).ids([ex.answer])  # the trace's tool turn answers with the result
        kept = tok.decode([i for i, m in zip(ids, mask) if m])
        end = f"</tool_call><|im_end|>The answer is \\boxed{{{ex.answer}}}.<|im_end|>"
        assert kept.startswith("<tool_call>") and kept.endswith(end)
