"""GRPO / RLOO with tools, in-process, against TRL 1.16's own functions where they exist.

- Parsing: on a tokenizer with TRL's Qwen3 chat template, the calls shardtune reads off the template
  (shardtune.data.tool_calls.tool_call_format) give the messages TRL's ``parse_response`` gives with the response
  template TRL's ``add_response_schema`` sets (content, one call, two calls, a malformed call as plain text, a reply cut
  short); with that response template set, shardtune parses through it and agrees as well.
- The tool results' tokens: ``tool_result_ids`` equals ``GRPOTrainer._get_tool_suffix_ids``.
- The loop: ``roll_out`` and ``GRPOTrainer._tool_call_loop``, fed the same first replies and the same scripted
  model, give the same completion ids, tool masks (tool-result tokens 0), conversations, call and failure counts: a
  call answered and resumed, a reply without a call, an unknown tool and a raising tool (error messages, not crashes),
  the per-turn limit, a result that would pass max_completion_length (dropped, the completion ends).
- The keyed continuation: with the toy model (tests/tool_toy.py) and the real sampler, a completion's turns do not
  change with the rows sampled beside it (what makes 1 x 8 == 2 x 4 with tools).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardtune.config.schema import ConfigError
from shardtune.data.tool_calls import parse_completion, tool_call_format, tool_result_ids
from shardtune.training.objectives.grpo.rollouts import roll_out
from shardtune.training.objectives.grpo.tools import Toolbox
from tests import tool_toy

QWEN_TOKENS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the tool broke")


def template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def qwen():
    """The preset's tokenizer with Qwen3's special tokens and TRL's Qwen3 template (as TRL ships it), with the
    response template TRL's add_response_schema gives it."""
    from trl.chat_template_utils import add_response_schema

    from shardtune.model.loading import train_tokenizer

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template("qwen3")
    return add_response_schema(tokenizer)


REPLIES = [
    'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
    "The answer is 5<|im_end|>",
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n<tool_call>\n{"name": "broken", '
    '"arguments": {"x": 1}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "add", "argu</tool_call><|im_end|>',  # malformed: plain text, as TRL's fallback
    "cut short before its end",
]


@pytest.mark.parametrize("reply", REPLIES)
def test_a_reply_parses_as_trls_parse_response_parses_it(qwen, reply):
    from trl.chat_template_utils import parse_response

    prefix = qwen.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tools=[add], add_generation_prompt=True, return_dict=False
    )
    ids = qwen(reply, add_special_tokens=False)["input_ids"]
    expected = parse_response(qwen, ids, prefix=prefix, tools=[add])
    assert parse_completion(qwen, tool_call_format(qwen), ids, prefix, [add]) == expected  # read off the template
    assert parse_completion(qwen, None, ids, prefix, [add]) == expected  # the tokenizer's response template
    assert ("tool_calls" in expected) == (reply.count("</tool_call>") > 0 and "argu<" not in reply)


def test_the_format_read_off_templates_and_a_template_without_json_calls_refused():
    from shardtune.model.loading import train_tokenizer

    preset = train_tokenizer()  # the preset's template: calls as a JSON list after the reply's text
    fmt = tool_call_format(preset)
    assert (fmt.open, fmt.close, fmt.end, fmt.listed) == ("", "", "</s>", True)
    text = 'ok [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]</s>'
    parsed = parse_completion(preset, fmt, preset(text)["input_ids"], [], [add])
    assert parsed == {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
    }
    toy = tool_toy.tokenizer_with_tools()
    assert tool_call_format(toy).open == "<tool_call>" and tool_call_format(toy).listed is False
    xml = copy.deepcopy(preset)
    xml.chat_template = template("qwen3_5_nothink")  # calls as <function=...><parameter=...>: not JSON
    with pytest.raises(ConfigError, match="response_template"):
        tool_call_format(xml)


@pytest.mark.parametrize("results", [["5"], ["5", "{'error': 'the tool broke'}"]])
def test_tool_result_tokens_equal_trls(qwen, results):
    from trl import GRPOTrainer

    training = copy.deepcopy(qwen)
    training.chat_template = template("qwen3_training")  # TRL's prefix-preserving template for multi-turn training
    messages = [{"role": "tool", "name": "add", "content": r} for r in results]
    trl_self = SimpleNamespace(
        _is_vlm=False, processing_class=training, chat_template=None, chat_template_kwargs={}, _tokenizer=training
    )
    expected = GRPOTrainer._get_tool_suffix_ids(trl_self, messages)
    assert tool_result_ids(training, messages) == expected
    assert training.decode(expected).count("<tool_response>") == len(results)


def test_a_tool_that_raises_or_is_unknown_is_an_error_message():
    box = Toolbox([add, broken], None, None, 5, 100, 1000)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    assert box.run(call) == ({"role": "tool", "name": "add", "content": "5"}, False)
    call["function"] = {"name": "broken", "arguments": {"x": 1}}
    assert box.run(call) == ({"role": "tool", "name": "broken", "content": "{'error': 'the tool broke'}"}, True)
    call["function"] = {"name": "mul", "arguments": {}}
    assert box.run(call)[0]["content"] == "{'error': 'Tool mul not found.'}"

    async def later(a: int) -> int:
        return a + 1

    assert Toolbox([later], None, None, 5, 100, 1000).run(
        {"type": "function", "function": {"name": "later", "arguments": {"a": 1}}}
    ) == ({"role": "tool", "name": "later", "content": "2"}, False)


# Scripted turns: reply k of row r (in ids) -- row 0 calls add, then answers; row 1 answers at once; row 2 calls an
# unknown tool, then broken, then add (past the 2-turn limit: its last call is not run); row 3 writes a long reply
# that calls add, whose result would pass the budget (dropped: the completion ends after the call); row 4 calls add
# twice in one turn
SCRIPT = {
    0: ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>', "It is 5<|im_end|>"],
    1: ["Four<|im_end|>"],
    2: [
        '<tool_call>\n{"name": "mul", "arguments": {"a": 2}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "broken", "arguments": {"x": 2}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call><|im_end|>',
    ],
    3: ["Long. " * 55 + '\n<tool_call>\n{"name": "add", "arguments": {"a": 100000, "b": 1}}\n</tool_call><|im_end|>'],
    4: [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "add", '
        '"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
        "3 and 7<|im_end|>",
    ],
}


def test_the_tool_loop_equals_trls_on_the_same_replies(qwen):
    from trl import GRPOTrainer

    tokenizer = copy.deepcopy(qwen)
    tokenizer.chat_template = template("qwen3_training")
    prompts = [[{"role": "user", "content": f"Question {r}: what is it?"}] for r in SCRIPT]
    prompt_ids = [
        list(tokenizer.apply_chat_template(p, tools=[add, broken], add_generation_prompt=True, return_dict=False))
        for p in prompts
    ]
    replies = {r: [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] for r, texts in SCRIPT.items()}
    budget = 240  # tokens: row 3's long reply and its result pass it; the other rows' turns fit

    def row_of(ids: list[int]) -> int:
        return next(r for r, p in enumerate(prompt_ids) if ids[: len(p)] == p)

    def scripted(prompts_ids: list[list[int]]) -> list[list[int]]:
        """Each prompt's next reply: its turn is the eos tokens after the question / 2 (a reply's and its results')."""
        out = []
        for ids in prompts_ids:
            r = row_of(ids)
            turn = ids[len(prompt_ids[r]) :].count(tokenizer.eos_token_id) // 2
            out.append(list(replies[r][min(turn, len(replies[r]) - 1)]))
        return out

    first = [list(replies[r][0]) for r in SCRIPT]
    parsed = [parse_completion(tokenizer, None, ids, p, [add, broken]) for ids, p in zip(first, prompt_ids)]

    tools = {"add": add, "broken": broken}
    trl_self = SimpleNamespace(
        _sync_tool_dicts=[tools] * len(SCRIPT),
        _async_tool_dicts=[{}] * len(SCRIPT),
        max_tool_calling_iterations=2,
        use_vllm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096)),
        _is_vlm=False,
        tools=[add, broken],
        max_completion_length=budget,
        environment_factories=None,
        _tokenizer=tokenizer,
        processing_class=tokenizer,
        chat_template=None,
        chat_template_kwargs={},
        _generate_single_turn=lambda ids, *args, **kwargs: (scripted(ids), None),
    )
    trl_self._get_tool_suffix_ids = lambda messages: GRPOTrainer._get_tool_suffix_ids(trl_self, messages)
    mask, messages, ids, _, calls, failures, _ = GRPOTrainer._tool_call_loop(
        trl_self,
        copy.deepcopy(prompts),
        prompt_ids,
        copy.deepcopy(first),
        [[m] for m in copy.deepcopy(parsed)],
        None,
        None,
        {},
    )

    box = Toolbox([add, broken], tokenizer, None, 2, budget, 4096)
    rows = [{"prompt": p, "prompt_ids": i} for p, i in zip(prompts, prompt_ids)]

    def turn(extended, seeds, budgets):
        return [reply[:b] for reply, b in zip(scripted(extended), budgets)]

    ours = roll_out(box, rows, first, [0] * len(rows), turn, torch.device("cpu"))
    assert ours.ids == ids
    assert ours.masks == mask
    assert ours.messages == messages
    assert (sum(ours.calls), sum(ours.failures)) == (calls, failures) == (6, 2)  # rows 0..4: 1, 0, 2, 1, 2 calls
    assert [m["role"] for m in ours.messages[2]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert ours.messages[2][-1]["tool_calls"][0]["function"]["name"] == "add"  # past the limit: not run
    assert ours.masks[1] == [1] * len(ids[1]) and 0 in ours.masks[0]  # results masked, replies not
    assert ours.messages[3][-1].get("tool_calls") and len(ours.messages[3]) == 1  # its result dropped: ends there


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory):
    """The toy model taught briefly, calling the tool in most replies (its calls need not be right)."""
    out = tmp_path_factory.mktemp("toy") / "model"
    return tool_toy.build(out, call_fraction=0.9, steps=150)


class _Whole:
    """A model held whole on one device (what DDP's strategy does around generation)."""

    def unwrap(self, model):
        return model

    def generating(self, model, whole=False):
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()


def test_a_completions_turns_do_not_change_with_the_rows_beside_it(calling_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.training.objectives.grpo.batches import sampling_seed
    from shardtune.training.objectives.grpo.generate import sample

    model = AutoModelForCausalLM.from_pretrained(calling_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(calling_model)
    box = Toolbox([tool_toy.add], tokenizer, tool_call_format(tokenizer), sys.maxsize, 24, 2048)
    rows = []
    for a, b in ((3, 4), (1, 8), (6, 6), (0, 2)):
        prompt = tool_toy.question(a, b)
        ids = tokenizer.apply_chat_template(prompt, tools=[tool_toy.add], add_generation_prompt=True, return_dict=False)
        rows.append({"prompt": prompt, "prompt_ids": list(ids)})
    seeds = [sampling_seed(5, 0, 0, i, 0) for i in range(len(rows))]

    def turn(prompts, keys, budgets=None):
        return sample(
            model,
            _Whole(),
            prompts,
            keys,
            max_new_tokens=24,
            eos_ids={tokenizer.eos_token_id},
            pad_id=tokenizer.pad_token_id,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            device=torch.device("cpu"),
            budgets=budgets,
        )

    together = roll_out(box, rows, turn([r["prompt_ids"] for r in rows], seeds), seeds, turn, torch.device("cpu"))
    assert sum(together.calls) >= 2  # tools were called: the turns after their results are compared
    for i, row in enumerate(rows):
        first = turn([row["prompt_ids"]], seeds[i : i + 1])
        alone = roll_out(box, [row], first, seeds[i : i + 1], turn, torch.device("cpu"))
        assert alone.ids[0] == together.ids[i] and alone.masks[0] == together.masks[i], i
        assert alone.messages[0] == together.messages[i], i
