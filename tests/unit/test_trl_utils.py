"""TRL's public data utilities in shardtune's namespace (shardtune.data.trl_utils, create_reference_model): for the same
input, the same result as trl 1.16's own functions (the oracle, pinned in the dev extra), on every layout and branch
TRL has: conversational or not, explicit or implicit prompt, tools, template arguments, a real tokenizer's chat
template (the tiny preset's) and one that renders the prompt alone differently, datasets row by row. Each comparison
has a control that shows it can fail. No launch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import trl
import trl.data_utils as trl_data
from datasets import Dataset, DatasetDict, IterableDataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.config.schema import ConfigError
from shardtune.data import trl_utils as ours
from shardtune.model.reference import create_reference_model


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


# the generation prompt opens a thought that the whole conversation does not have (as DeepSeek-R1 / Qwen3 templates
# do): the prompt is then cut to what every rendering shares; enable_thinking (a template argument) turns it off
THINKING_TEMPLATE = (
    "{%- if tools %}{{ '<|tools|>' + (tools | tojson) + '\\n' }}{% endif -%}"
    "{%- for m in messages -%}{{ '<|' + m['role'] + '|>\\n' + (m['content'] or '') + '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{%- if enable_thinking | default(true) %}{{ '<think>\\n' }}{% endif %}{% endif -%}"
)
# a template that drops assistant tool calls without a word (as the basic Llama 3 template does)
NO_TOOL_CALLS_TEMPLATE = "{%- for m in messages -%}{{ m['role'] + ': ' + (m['content'] or '') + '\\n' }}{%- endfor -%}"
TOOLS = [{"type": "function", "function": {"name": "book", "description": "Book a table", "parameters": {}}}]

ASK, ASK_MORE = msg("user", "Anna wants the cinema at 7. Who comes?"), msg("user", "And where?")
SYSTEM = msg("system", "You plan outings.")
CHOSEN, REJECTED = [msg("assistant", "Tom and Kate.")], [msg("assistant", "Nobody, it rains.")]
LAYOUTS = {
    "language modelling": {"messages": [SYSTEM, ASK, *CHOSEN]},
    "prompt-only": {"prompt": [SYSTEM, ASK]},
    "prompt ending with the assistant": {"prompt": [ASK, msg("assistant", "Tom and")]},
    "prompt ending with a tool": {"prompt": [ASK, msg("assistant", "let me look"), msg("tool", "Tom, Kate")]},
    "prompt-completion": {"prompt": [ASK], "completion": CHOSEN},
    "preference": {"prompt": [SYSTEM, ASK], "chosen": CHOSEN, "rejected": REJECTED},
    "implicit-prompt preference": {"chosen": [ASK, *CHOSEN], "rejected": [ASK, *REJECTED]},
    "unpaired preference": {"prompt": [ASK], "completion": REJECTED, "label": False},
    "row's template arguments": {"prompt": [ASK], "completion": CHOSEN, "chat_template_kwargs": {"enable_thinking": 0}},
}


@pytest.fixture(scope="module")
def tokenizers(tiny_model):
    """The tiny preset's tokenizer (its own chat template) and a copy with THINKING_TEMPLATE."""
    preset = AutoTokenizer.from_pretrained(tiny_model)
    thinking = AutoTokenizer.from_pretrained(tiny_model)
    thinking.chat_template = THINKING_TEMPLATE
    return {"preset": preset, "thinking": thinking}


@pytest.mark.parametrize("template", ["preset", "thinking"])
@pytest.mark.parametrize("tools", [None, TOOLS, []])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_apply_chat_template_gives_trls_text(tokenizers, template, tools, layout):
    tokenizer, example = tokenizers[template], LAYOUTS[layout]
    mine = ours.apply_chat_template(copy.deepcopy(example), tokenizer, tools)
    assert mine == trl_data.apply_chat_template(copy.deepcopy(example), tokenizer, tools)
    assert ours.maybe_apply_chat_template(copy.deepcopy(example), tokenizer, tools) == mine
    if tools:  # control: the tools are in the text, so a comparison that dropped them would fail
        assert mine != ours.apply_chat_template(copy.deepcopy(example), tokenizer)


def test_the_prompt_is_cut_to_what_every_rendering_shares(tokenizers):
    """The thinking template's generation prompt ends with a thought the conversations lack: both cut it, and a
    template argument (or the row's chat_template_kwargs) that turns it off gives the same split."""
    tokenizer, example = tokenizers["thinking"], LAYOUTS["preference"]
    alone = tokenizer.apply_chat_template(example["prompt"], tokenize=False, add_generation_prompt=True)
    mine = ours.apply_chat_template(example, tokenizer)
    assert alone.endswith("<think>\n") and not mine["prompt"].endswith("<think>\n")
    assert mine == trl_data.apply_chat_template(example, tokenizer)
    off = ours.apply_chat_template(example, tokenizer, enable_thinking=False)
    assert off == trl_data.apply_chat_template(example, tokenizer, enable_thinking=False) == mine
    prompt_only = {"prompt": example["prompt"]}
    thinking_off = ours.apply_chat_template(prompt_only, tokenizer, enable_thinking=False)
    assert thinking_off == trl_data.apply_chat_template(prompt_only, tokenizer, enable_thinking=False)
    assert thinking_off != ours.apply_chat_template(prompt_only, tokenizer)  # control: the argument reaches it


def test_non_conversational_examples_are_returned_as_they_are(tokenizers):
    for example in ({"text": "The sky is blue."}, {"prompt": "The sky is", "completion": " blue."}, {"label": True}):
        assert ours.maybe_apply_chat_template(example, tokenizers["preset"]) is example
        assert trl_data.maybe_apply_chat_template(example, tokenizers["preset"]) is example


@pytest.mark.parametrize(
    "example",
    [
        {"prompt": [ASK], "chosen": CHOSEN},  # no TRL layout
        {"messages": [ASK], "prompt": [ASK]},
        {"prompt": [ASK, SYSTEM]},  # a prompt ending with the system
    ],
)
def test_bad_examples_are_refused_as_trl_refuses_them(tokenizers, example):
    with pytest.raises(ConfigError, match="apply_chat_template: .*: "):
        ours.apply_chat_template(example, tokenizers["preset"])
    with pytest.raises((KeyError, ValueError)):
        trl_data.apply_chat_template(example, tokenizers["preset"])


def test_a_template_argument_given_twice_is_refused(tokenizers):
    example = dict(LAYOUTS["row's template arguments"])
    with pytest.raises(ConfigError, match="enable_thinking given twice"):
        ours.apply_chat_template(example, tokenizers["thinking"], enable_thinking=True)
    with pytest.raises(TypeError, match="multiple values"):  # TRL: Python's own error
        trl_data.apply_chat_template(example, tokenizers["thinking"], enable_thinking=True)


def test_a_dataset_mapped_row_by_row_gives_trls_rows(tokenizers):
    rows = [{"prompt": [ASK], "completion": CHOSEN}, {"prompt": [SYSTEM, ASK_MORE], "completion": REJECTED}] * 3
    rows[3] = {"prompt": [ASK, msg("assistant", "Tom")], "completion": [msg("assistant", " and Kate.")]}
    dataset = Dataset.from_list(rows)
    kwargs = {"fn_kwargs": {"processing_class": tokenizers["thinking"], "tools": TOOLS}}
    mine = dataset.map(ours.maybe_apply_chat_template, **kwargs).to_list()
    assert mine == dataset.map(trl_data.maybe_apply_chat_template, **kwargs).to_list()
    assert len({row["prompt"] for row in mine}) == 3  # control: the rows differ from one another


CONVERSATIONAL = [
    {"messages": [ASK, *CHOSEN]},
    {"prompt": [ASK]},
    {"prompt": [ASK], "completion": CHOSEN},
    {"chosen": [ASK, *CHOSEN], "rejected": [ASK, *REJECTED]},
    {"prompt": [ASK], "completion": CHOSEN, "label": True},
    {"prompt": "The sky is"},
    {"prompt": "The sky is", "completion": " blue."},
    {"text": "The sky is blue."},
    {"messages": "plain text"},
    {"messages": [["nested"]]},
    {"messages": [{"content": "no role"}]},
    {"conversations": [{"from": "human", "value": "hi"}]},
    {"conversations": [{"role": "user", "content": "hi"}]},
    {"conversations": [{"from": "human"}]},
    {"conversations": "The sky is"},
    {},
]


def test_conversational_detection_is_trls():
    mine = [(ours.is_conversational(e), ours.is_conversational_from_value(e)) for e in CONVERSATIONAL]
    assert mine == [(trl_data.is_conversational(e), trl_data.is_conversational_from_value(e)) for e in CONVERSATIONAL]
    assert {answer for pair in mine for answer in pair} == {True, False}  # control: both answers occur


def test_an_empty_message_list_is_no_conversation():
    """TRL raises IndexError on an empty list; shardtune answers no."""
    assert not ours.is_conversational({"messages": []}) and not ours.is_conversational_from_value({"conversations": []})
    with pytest.raises(IndexError):
        trl_data.is_conversational({"messages": []})


PREFERENCES = [
    {"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"},  # the space goes with the completions
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "abc", "rejected": "abcd"},  # one a prefix of the other: its last item stays a completion
    {"chosen": "same", "rejected": "same"},
    {"chosen": "x", "rejected": "y"},
    {"chosen": [ASK, *CHOSEN], "rejected": [ASK, *REJECTED]},
    {"chosen": [SYSTEM, ASK, *CHOSEN], "rejected": [SYSTEM, ASK, *REJECTED]},
    {"chosen": [ASK, *CHOSEN], "rejected": [ASK_MORE, *REJECTED]},
]


def test_implicit_prompts_are_extracted_as_trl_does():
    mine = [ours.extract_prompt(dict(e)) for e in PREFERENCES]
    assert mine == [trl_data.extract_prompt(dict(e)) for e in PREFERENCES]
    assert mine[0] == {"prompt": "Q: sky? A:", "chosen": " blue", "rejected": " green"}
    assert len({str(m["prompt"]) for m in mine}) == len(PREFERENCES)  # control: every case splits differently


def test_a_first_difference_never_steps_back_past_the_start():
    """TRL's space rule at index 0 looks at the LAST character (index -1): a chosen ending with a space that differs
    from the first character on loses all but its last character to the "prompt". shardtune's prompt is empty."""
    example = {"chosen": "yes ", "rejected": "no"}
    assert ours.extract_prompt(example) == {"prompt": "", "chosen": "yes ", "rejected": "no"}
    assert trl_data.extract_prompt(example) == {"prompt": "yes", "chosen": " ", "rejected": "o"}


@pytest.mark.parametrize(
    "example",
    [
        *PREFERENCES,
        {"prompt": "Q: sky?", "chosen": " blue", "rejected": " green"},  # explicit: as it is
        {"prompt": [ASK], "chosen": CHOSEN, "rejected": REJECTED},
        {"prompt": ASK["content"], "chosen": [ASK, *CHOSEN], "rejected": [ASK, *REJECTED]},  # a text prompt beside
        {"prompt": [ASK], "completion": CHOSEN},  # not a preference example
        {"chosen": [ASK, *CHOSEN], "rejected": [ASK, *REJECTED], "score": 0.5},
    ],
)
def test_maybe_extract_prompt_is_trls(example):
    assert ours.maybe_extract_prompt(copy.deepcopy(example)) == trl_data.maybe_extract_prompt(copy.deepcopy(example))


def test_maybe_extract_prompt_on_a_dataset_is_trls():
    dataset = Dataset.from_list([{"chosen": [ASK, *c], "rejected": [ASK, *r]} for c, r in [(CHOSEN, REJECTED)] * 2])
    mine = dataset.map(ours.maybe_extract_prompt).to_list()
    assert mine == dataset.map(trl_data.maybe_extract_prompt).to_list()
    assert mine[0]["prompt"] == [ASK] and mine != dataset.to_list()  # control: the rows changed


def preference_rows(num: int, prompt: bool = True) -> list[dict]:
    rows = [{"chosen": f" good {i}", "rejected": f" bad {i}", "score": float(i), "tag": [i, i + 1]} for i in range(num)]
    return [{"prompt": f"Q{i}:", **row} for i, row in enumerate(rows)] if prompt else rows


@pytest.mark.parametrize("prompt", [True, False])
def test_unpaired_rows_equal_trls_row_by_row(prompt):
    """Batches of 3 of 7 pairs: every chosen of a batch, then every rejected; extra columns repeated."""
    dataset = Dataset.from_list(preference_rows(7, prompt))
    mine = ours.unpair_preference_dataset(dataset, batch_size=3)
    theirs = trl_data.unpair_preference_dataset(dataset, batch_size=3)
    assert mine.to_list() == theirs.to_list() and sorted(mine.column_names) == sorted(theirs.column_names)
    assert mine.num_rows == 14 and mine[0]["label"] and not mine[3]["label"]
    other_batches = ours.unpair_preference_dataset(dataset, batch_size=7).to_list()
    assert other_batches != mine.to_list()  # control: the row order is compared, not only the set of rows
    assert (
        ours.maybe_unpair_preference_dataset(dataset).to_list()
        == trl_data.maybe_unpair_preference_dataset(dataset).to_list()
    )


def test_unpairing_splits_and_streams_is_trls():
    splits = DatasetDict(
        {"train": Dataset.from_list(preference_rows(3)), "test": Dataset.from_list(preference_rows(2))}
    )
    mine = ours.maybe_unpair_preference_dataset(splits, desc="unpairing")
    theirs = trl_data.maybe_unpair_preference_dataset(splits, desc="unpairing")
    assert {k: v.to_list() for k, v in mine.items()} == {k: v.to_list() for k, v in theirs.items()}
    stream = IterableDataset.from_generator(preference_rows, gen_kwargs={"num": 4})
    assert list(ours.unpair_preference_dataset(stream)) == list(trl_data.unpair_preference_dataset(stream))
    unpaired = Dataset.from_list([{"prompt": "Q", "completion": " A", "label": True}])
    assert ours.maybe_unpair_preference_dataset(unpaired) is unpaired


def test_a_preference_dataset_with_a_label_column_is_refused():
    """TRL's unpaired rows would take the pairs' own label column instead of True / False; shardtune says so."""
    dataset = Dataset.from_list([{**row, "label": "x"} for row in preference_rows(2)])
    with pytest.raises(ConfigError, match="already has label, .*: rename or remove"):
        ours.unpair_preference_dataset(dataset)


CHATML = [
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello", "weight": 1}]},
    {"prompt": [{"from": "user", "value": "hi"}], "completion": [{"from": "assistant", "value": "yo"}], "n": [1]},
    {"messages": [msg("user", "already ChatML")], "tools": [{"value": "not a message column"}]},
    {"chosen": [{"from": "user", "value": "a"}, "not a message"], "rejected": "text"},
    {"text": "no messages"},
]


def test_chatml_conversion_is_trls():
    for example in CHATML:
        mine, theirs = copy.deepcopy(example), copy.deepcopy(example)
        assert ours.maybe_convert_to_chatml(mine) is mine
        assert mine == trl_data.maybe_convert_to_chatml(theirs) == theirs  # in place, as TRL
    assert ours.maybe_convert_to_chatml(copy.deepcopy(CHATML[0])) != CHATML[0]  # control: a conversion happened


def test_chatml_conversion_of_a_dataset_drops_the_conversations_column():
    dataset = Dataset.from_list([CHATML[0]] * 2)
    mine = dataset.map(ours.maybe_convert_to_chatml)
    assert mine.to_list() == dataset.map(trl.maybe_convert_to_chatml).to_list()
    assert mine.column_names == ["messages"] and mine[0]["messages"][1]["role"] == "gpt"


def test_tool_calling_support_is_trls(tokenizers, tiny_model):
    dropping = AutoTokenizer.from_pretrained(tiny_model)
    dropping.chat_template = NO_TOOL_CALLS_TEMPLATE
    unset = AutoTokenizer.from_pretrained(tiny_model)
    unset.chat_template = None
    cases = [tokenizers["preset"], tokenizers["thinking"], dropping, unset]
    mine = [ours.supports_tool_calling(t) for t in cases]
    assert mine == [trl.supports_tool_calling(t) for t in cases]
    assert mine == [True, False, False, False]  # control: the preset renders tool calls, the others drop them


def test_the_reference_model_is_trls_frozen_copy(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).train()
    reference = create_reference_model(model)
    with pytest.warns(FutureWarning):  # trl's top-level name moved to trl.experimental.utils
        theirs = trl.create_reference_model(model)
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())  # the model is left as it was
    for (name, mine), (_, their) in zip(reference.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(mine, their) and mine.data_ptr() != model.state_dict()[name].data_ptr(), name
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(next(model.parameters()), next(reference.parameters()))  # control: a copy, not a view
    with pytest.raises(ConfigError, match="freeze_layers"):
        create_reference_model(model, num_shared_layers=1)
