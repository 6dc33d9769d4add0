"""The multi-turn rollout loop (megaopd.rollout.trajectories): the student's tokens are the engine's own ids
(a tokenizer whose decode/encode does not round-trip them proves nothing re-encodes them), environment turns
are the ids the chat template renders for tool messages (Qwen2.5's <tool_response> wrapping), each turn
continues from the trajectory's ids, truncation by turns vs tokens, error observations counted; with the
real embedded engine, the engine's log-prob of every generated token equals a float64 HF forward of the
whole trajectory."""

import os
from types import SimpleNamespace

import pytest
import torch

from megaopd.data.config import DataConfig
from megaopd.data.templates import render_prompt
from megaopd.envs import EnvConfig, StepResult
from megaopd.envs.math_tools import CALCULATOR_TOOL
from megaopd.rollout import trajectories as TR
from megaopd.rollout.protocol import Sample, SamplingParams
from megaopd.rollout.records import build_rollout_batch
from tests.data.tiny_vocab import QWEN_ADDED, make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "tiny")
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'

# Qwen2.5-Instruct's handling of tools and tool messages (its chat template, abridged to those parts).
QWEN25_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tiny_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(TINY, "tokenizer"))


class ScriptedEngine:
    """Returns canned output ids per call and prompt, and records the token ids each request continued from."""

    def __init__(self, outputs):
        self.outputs, self.requests = list(outputs), []

    def generate(self, prompts, params, first_prompt_index=0):
        out = []
        for p in prompts:
            ids, reason = self.outputs.pop(0)
            ids = ids[: params.max_new_tokens]
            self.requests.append((list(p), params))
            out.append(
                Sample(list(p), list(ids), [-0.5] * len(ids), reason if len(ids) else "length", weight_version="7")
            )
        return out


def _split_merges(tok, text):
    """Ids of text with every multi-character token split into single characters: a valid tokenization the
    engine may sample, which decode -> encode does NOT give back (encode merges them again)."""
    out = []
    for i in tok(text, add_special_tokens=False)["input_ids"]:
        piece = tok.convert_ids_to_tokens(i)
        out += [tok.convert_tokens_to_ids(c) for c in piece] if len(piece) > 1 and not piece.startswith("<|") else [i]
    return out


def _run(engine, tok, examples, n=1, max_turns=4, max_tokens=400, seed=3):
    mt = TR.MultiTurn(EnvConfig(name="calculator"), max_turns, max_tokens, tok)
    return mt, mt.generate(engine, examples, SamplingParams(max_new_tokens=300, n=n, seed=seed))


def test_trained_ids_are_the_engines_own_and_tool_turns_are_the_templates(tiny_tok):
    tok, end = tiny_tok, tiny_tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = _split_merges(tok, "Let me compute: " + CALC) + [end]
    turn2 = _split_merges(tok, "So 12 * 7 = 84. The answer is \\boxed{84}.") + [end]
    for ids in (turn1[:-1], turn2[:-1]):  # the point of the test: these ids do not survive decode -> encode
        assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] != ids
    engine = ScriptedEngine([(turn1, "stop"), (turn2, "stop")])
    prompt = tok("<|im_start|>user\nCompute 12 * 7.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    ex = SimpleNamespace(prompt_ids=prompt, answer="84", problem="Compute 12 * 7.")
    mt, (s,) = _run(engine, tok, [ex])
    env_ids = mt.turns.ids(["84"])
    assert tok.decode(env_ids) == "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    assert s.output_ids == turn1 + env_ids + turn2
    assert s.output_mask == [1] * len(turn1) + [0] * len(env_ids) + [1] * len(turn2)
    assert engine.requests[1][0] == prompt + turn1 + env_ids  # turn 2 continued from the trajectory's ids
    assert s.output_logprobs == [-0.5] * len(turn1) + [0.0] * len(env_ids) + [-0.5] * len(turn2)
    assert (
        s.finish_reason,
        s.trajectory.turns,
        s.trajectory.tool_calls,
        s.trajectory.tool_errors,
        s.trajectory.reward,
        s.trajectory.truncated_by,
    ) == ("stop", 2, 1, 0, 1.0, "")
    batch = build_rollout_batch([s], 0, 1)
    P = len(prompt)
    on = batch.loss_mask_BT[0].bool()
    assert batch.tokens_BS[0, 1:][on].tolist() == turn1 + turn2  # what is trained: exactly the engine's ids
    assert batch.tokens_BS[0, P:].tolist() == s.output_ids
    # The sequence is the one the chat template renders for the whole conversation (inference's view).
    conversation = [
        {"role": "user", "content": "Compute 12 * 7."},
        {"role": "assistant", "content": tok.decode(turn1[:-1])},
        {"role": "tool", "content": "84"},
        {"role": "assistant", "content": tok.decode(turn2[:-1])},
    ]
    assert tok.decode(prompt + s.output_ids) + "\n" == tok.apply_chat_template(conversation, tokenize=False)
    texts, rewards = mt.texts_and_rewards([s])
    assert rewards == [1.0]
    assert texts[0] == tok.decode(turn1 + turn2, skip_special_tokens=True)  # the student's turns only


def test_truncation_by_turns_and_by_tokens_and_counted_errors(tiny_tok):
    tok, end = tiny_tok, tiny_tok.convert_tokens_to_ids("<|im_end|>")
    call = tok(CALC, add_special_tokens=False)["input_ids"] + [end]
    bad = tok("<tool_call>{not json}</tool_call>", add_special_tokens=False)["input_ids"] + [end]
    ex = SimpleNamespace(prompt_ids=[5, 6, 7], answer="84", problem="p")
    # max_turns=2: a call, an error observation, a call -> truncated by turns (the last tool turn dropped)
    _, (s,) = _run(ScriptedEngine([(call, "stop"), (bad, "stop")]), tok, [ex], max_turns=2)
    assert (s.finish_reason, s.trajectory.truncated_by, s.trajectory.turns) == ("length", "turns", 2)
    assert (s.trajectory.tool_calls, s.trajectory.tool_errors, s.trajectory.reward) == (2, 1, 0.0)
    assert s.output_mask[-1] == 1  # ends with the student's turn: no environment turn nobody answers
    # a trajectory budget too small for turn 2: truncated by tokens; the engine's budget shrinks per turn
    engine = ScriptedEngine([(call, "stop"), (call * 4, "stop")])
    _, (s,) = _run(engine, tok, [ex], max_tokens=len(call) + 30)
    assert (s.finish_reason, s.trajectory.truncated_by) == ("length", "tokens")
    assert len(s.output_ids) <= len(call) + 30
    assert engine.requests[1][1].max_new_tokens == len(call) + 30 - (len(engine.requests[1][0]) - 3)


def test_n_trajectories_per_row_are_prompt_major_and_seeded_per_turn(tiny_tok):
    tok, end = tiny_tok, tiny_tok.convert_tokens_to_ids("<|im_end|>")
    done = tok("\\boxed{1}", add_special_tokens=False)["input_ids"] + [end]
    call = tok(CALC, add_special_tokens=False)["input_ids"] + [end]
    exs = [
        SimpleNamespace(prompt_ids=[5, 6], answer="1", problem="a"),
        SimpleNamespace(prompt_ids=[8], answer="2", problem="b"),
    ]
    engine = ScriptedEngine([(done, "stop"), (call, "stop"), (done, "stop"), (done, "stop"), (done, "stop")])
    _, samples = _run(engine, tok, exs, n=2)
    assert [s.prompt_ids for s in samples] == [[5, 6], [5, 6], [8], [8]]
    assert [s.trajectory.turns for s in samples] == [1, 2, 1, 1]
    assert [s.trajectory.reward for s in samples] == [1.0, 1.0, 0.0, 0.0]
    seeds = [p.seed for _, p in engine.requests]
    assert seeds[0] == seeds[1] != seeds[4]  # one call per turn (the engine derives each request's seed)


def test_qwen25_tool_turns_and_tools_in_the_prompt():
    tok = make_tokenizer(QWEN_ADDED, "<|im_end|>", QWEN25_TOOLS)
    turns = TR.ToolTurns(tok, [CALCULATOR_TOOL])
    assert turns.text(["84", "Error: division by zero"]) == (
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\nError: division by zero\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = render_prompt("Compute 12 * 7.", DataConfig(), tok, tools=[CALCULATOR_TOOL])
    assert '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_embedded_engine_logprobs_of_every_generated_token_match_a_float64_hf_forward(tiny_tok, monkeypatch):
    """The real engine, a trajectory of 2 assistant turns (an environment that always answers): each turn
    continues from the ids; each generated token's engine log-prob equals the float64 HF forward of the whole
    trajectory at its position."""
    from transformers import AutoModelForCausalLM

    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.embedded import EmbeddedEngine

    class Chatty:
        tools = []

        def reset(self, ex):
            pass

        def step(self, text):
            return StepResult(done=False, observations=["7"], tool_calls=1)

    monkeypatch.setattr(TR, "build_environment", lambda cfg: Chatty())
    student = os.path.join(TINY, "models", "student")
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=student, max_batch_size=4))
    prompt = tiny_tok("<|im_start|>user\nCompute 3 + 4.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    ex = SimpleNamespace(prompt_ids=prompt, answer="7", problem="Compute 3 + 4.")
    mt = TR.MultiTurn(EnvConfig(name="calculator"), 2, 800, tiny_tok)
    end = tiny_tok.convert_tokens_to_ids("<|im_end|>")
    (s,) = mt.generate(engine, [ex], SamplingParams(max_new_tokens=200, seed=1, stop_token_ids=[end]))
    assert s.trajectory.turns == 2 and 0 in s.output_mask
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + s.output_ids])).logits[0]
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0]
    on = torch.tensor(s.output_mask).bool()
    got = torch.tensor(s.output_logprobs, dtype=torch.float64)
    assert (got[on] - lp[on]).abs().max() < 1e-4, (got[on] - lp[on]).abs().max()
    assert got[~on].eq(0).all()


def test_validation_with_an_environment_is_pass_at_1_with_tools(tiny_tok, tmp_path):
    from megaopd.data.config import DataConfig as DC
    from megaopd.rollout.config import RolloutConfig
    from megaopd.trainer.validation import _evaluate

    val = tmp_path / "val.jsonl"
    val.write_text('{"problem": "Compute 12 * 7.", "answer": "84"}\n{"problem": "Compute 2 * 3.", "answer": "6"}\n')
    end = tiny_tok.convert_tokens_to_ids("<|im_end|>")
    ids = lambda text: tiny_tok(text, add_special_tokens=False)["input_ids"] + [end]  # noqa: E731
    engine = ScriptedEngine([(ids(CALC), "stop"), (ids("\\boxed{5}"), "stop"), (ids("\\boxed{84}"), "stop")])
    cfg = SimpleNamespace(
        env=EnvConfig(name="calculator"),
        rollout=RolloutConfig(max_turns=3),
        data=DC(),
        validation=SimpleNamespace(path=str(val), max_problems=0, temperature=0.6, max_new_tokens=64),
    )
    m = _evaluate(engine, tiny_tok, cfg, 0, [end], None)
    assert m == {"val/accuracy": 0.5, "val/tool_call_rate": 0.5, "val/turns_mean": 1.5, "val/truncation_rate": 0.0}
