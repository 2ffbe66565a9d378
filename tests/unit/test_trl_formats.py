"""TRL's dataset formats: shardtune's input_ids and loss positions equal what TRL's own SFTTrainer prepares.

trl (pinned in the dev extra) is the oracle: for each format and option, the same JSONL file goes through
``shardtune.data.load_examples`` and through ``trl.SFTTrainer``'s dataset preparation, and every kept row must have
the same token ids and the same labels (-100 where no loss). No launch: the trainer is only constructed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from datasets import load_dataset

from shardtune.config.flags import config_from, parse_args
from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data import DataError, check_data_config, load_examples
from shardtune.data.cache import cache_key
from shardtune.data.chat import apply_tokenizer_options
from shardtune.data.formatting import IGNORE_INDEX
from shardtune.data.trl_loading import drop_absent_validation, validation_available
from shardtune.model.loading import train_tokenizer

SYSTEM = {"role": "system", "content": "You plan outings. Be brief."}
CHATS = [
    [
        SYSTEM,
        {"role": "user", "content": "Anna wants the cinema at 7. Who comes?"},
        {"role": "assistant", "content": "Tom and Kate come."},
        {"role": "user", "content": "And where?"},
        {"role": "assistant", "content": "At the Odeon."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "Have fun on Friday."},
    ],
    [{"role": "user", "content": "Lunch on Monday?"}, {"role": "assistant", "content": "Ben can't come."}],
    [
        SYSTEM,
        {"role": "user", "content": "Bowling at Strike Zone?"},
        {"role": "assistant", "content": "Sure, at 8 pm."},
        {"role": "user", "content": "Bring snacks."},
        {"role": "assistant", "content": "I will bring drinks too."},
    ],
]
TEXTS = [
    "Anna and Tom go to the cinema at 7.",
    "Ben can't have lunch with Kate.</s>",
    "Lucy brings cake to the picnic at Riverside Park on Sunday, and Mark brings fruit and water.",
]
PAIRS = [
    ("Summarize: Anna: cinema at 7? Tom: sure!\nSummary:", " Anna and Tom go to the cinema."),
    ("Summarize: Kate: lunch? Ben: can't today.\nSummary:", " Ben can't have lunch with Kate."),
    ("Summarize: Lucy: I'll bring cake.\nSummary:", " Lucy brings cake."),
]
PLACE = {"type": "object", "properties": {"place": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "book", "description": "Book a table", "parameters": PLACE}}]


def chat_prompt_completion(chat: list[dict]) -> dict:
    return {"prompt": chat[:-1], "completion": chat[-1:]}


def sharegpt(chat: list[dict]) -> dict:
    return {"conversations": [{"from": m["role"], "value": m["content"]} for m in chat]}


ROWS = {
    "text": [{"text": t} for t in TEXTS],
    "prompt_completion": [{"prompt": p, "completion": c} for p, c in PAIRS],
    "messages": [{"messages": chat} for chat in CHATS],
    "chat_prompt_completion": [chat_prompt_completion(chat) for chat in CHATS],
    "sharegpt": [sharegpt(chat) for chat in CHATS],
    "tools": [{"messages": chat, "tools": json.dumps(TOOLS)} for chat in CHATS],
}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trl_cfg(path: Path, max_length: int = 1024, **options) -> TrainConfig:
    cfg = config_from(dataset="trl_dataset", context_length=max_length, run_validation=False)
    cfg.data.trl_dataset.dataset_name = str(path)
    for key, value in options.items():
        setattr(cfg.data.trl_dataset, key, value)  # typed values, set on the section TRL's data flags live in
    return cfg


def ours(cfg: TrainConfig, tokenizer) -> list[tuple[list[int], list[int]]]:
    tokenizer = apply_tokenizer_options(cfg, copy.deepcopy(tokenizer))
    examples, _ = load_examples(cfg, tokenizer, "train")
    return [(e["input_ids"], e["labels"]) for e in examples]


def trls(cfg: TrainConfig, tokenizer, tmp_path: Path) -> list[tuple[list[int], list[int]]]:
    """What TRL's SFTTrainer prepares for the same file and options (its own preparation, no training)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl import SFTConfig, SFTTrainer

    tc = cfg.data.trl_dataset
    tokenizer = copy.deepcopy(tokenizer)
    if tc.chat_template_path:
        tokenizer.chat_template = Path(tc.chat_template_path).read_text()
    completion_only = {"auto": None, "true": True, "false": False}[tc.completion_only_loss]
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        packing=False,
        save_strategy="no",
        max_length=cfg.data.context_length,
        truncation_mode=tc.truncation_mode,
        dataset_text_field=tc.dataset_text_field,
        completion_only_loss=completion_only,
        assistant_only_loss=tc.assistant_only_loss,
        eos_token=tc.eos_token or None,
    )
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=32,
            )
        )
    dataset = load_dataset("json", data_files=tc.dataset_name, split="train")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    return [(row["input_ids"], row["labels"]) for row in trainer.train_dataset]


def assert_same_as_trl(cfg: TrainConfig, tokenizer, tmp_path: Path) -> list[tuple[list[int], list[int]]]:
    mine, theirs = ours(cfg, tokenizer), trls(cfg, tokenizer, tmp_path)
    assert len(mine) == len(theirs), "a different number of kept rows"
    for row, ((ids, labels), (trl_ids, trl_labels)) in enumerate(zip(mine, theirs), start=1):
        assert ids == trl_ids, f"row {row}: different input_ids"
        assert labels == trl_labels, f"row {row}: different loss positions"
    return mine


CASES = {  # name: (rows, max_length, options)
    "text": ("text", 1024, {}),
    "text_truncated_keep_start": ("text", 12, {}),
    "text_field_and_eos_token": ("content", 1024, {"dataset_text_field": "content", "eos_token": "<pad>"}),
    "prompt_completion": ("prompt_completion", 1024, {}),
    "prompt_completion_full_loss": ("prompt_completion", 1024, {"completion_only_loss": "false"}),
    "prompt_completion_keep_end": ("prompt_completion", 10, {"truncation_mode": "keep_end"}),
    "messages": ("messages", 1024, {}),
    "messages_assistant_only": ("messages", 1024, {"assistant_only_loss": True}),
    "messages_assistant_only_truncated": ("messages", 40, {"assistant_only_loss": True}),
    "messages_keep_end": ("messages", 40, {"truncation_mode": "keep_end", "assistant_only_loss": True}),
    "chat_prompt_completion": ("chat_prompt_completion", 1024, {}),
    "chat_prompt_completion_assistant_only": (
        "chat_prompt_completion",
        1024,
        {"assistant_only_loss": True, "completion_only_loss": "false"},
    ),
    "chat_prompt_completion_full_loss": ("chat_prompt_completion", 1024, {"completion_only_loss": "false"}),
    "sharegpt": ("sharegpt", 1024, {}),  # TRL refuses --assistant_only_loss on them; shardtune does not
    "tools": ("tools", 1024, {"assistant_only_loss": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_and_loss_positions_equal_trl(case, tokenizer, tmp_path):
    name, max_length, options = CASES[case]
    rows = [{"content": r["text"]} for r in ROWS["text"]] if name == "content" else ROWS[name]
    cfg = trl_cfg(write_jsonl(tmp_path / "data.jsonl", rows), max_length, **options)
    mine = assert_same_as_trl(cfg, tokenizer, tmp_path)
    assert mine and all(any(label != IGNORE_INDEX for label in labels) for _, labels in mine)


def test_assistant_only_loss_trains_every_assistant_turn_and_nothing_else(tokenizer, tmp_path):
    """Three assistant turns after a system message: exactly their text and eos carry loss."""
    cfg = trl_cfg(write_jsonl(tmp_path / "chat.jsonl", ROWS["messages"][:1]), assistant_only_loss=True)
    ((ids, labels),) = ours(cfg, tokenizer)
    trained = tokenizer.decode([label for label in labels if label != IGNORE_INDEX])
    assert trained == "Tom and Kate come.</s>At the Odeon.</s>Have fun on Friday.</s>"
    everything = ours(trl_cfg(cfg.data.trl_dataset.dataset_name), tokenizer)[0][1]
    assert everything == ids, "without --assistant_only_loss every token carries loss (as TRL)"


def test_the_comparison_sees_a_different_mask(tokenizer, tmp_path):
    """The oracle comparison fails when only the loss positions differ."""
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS["messages"])
    mine = ours(trl_cfg(path, assistant_only_loss=True), tokenizer)
    theirs = trls(trl_cfg(path), tokenizer, tmp_path)
    assert [ids for ids, _ in mine] == [ids for ids, _ in theirs]
    assert [labels for _, labels in mine] != [labels for _, labels in theirs]


def test_pretokenized_rows_use_their_masks_as_trl(tokenizer, tmp_path):
    rows = [
        {"input_ids": [5, 6, 7, 8, 2], "completion_mask": [0, 0, 1, 1, 1], "assistant_masks": [1, 1, 1, 1, 1]},
        {"input_ids": [9, 10, 11, 2], "completion_mask": [0, 1, 1, 1], "assistant_masks": [0, 0, 1, 1]},
    ]
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    explicit = assert_same_as_trl(trl_cfg(path, completion_only_loss="true"), tokenizer, tmp_path)
    assert explicit[0][1] == [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 2]
    assert explicit[1][1] == [IGNORE_INDEX, IGNORE_INDEX, 11, 2]
    auto = assert_same_as_trl(trl_cfg(path), tokenizer, tmp_path)  # TRL's auto: completion_mask only with prompts
    assert auto[0][1] == rows[0]["input_ids"]


def test_sharegpt_speaker_names_become_roles(tokenizer, tmp_path):
    named = [
        {
            "conversations": [
                {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
                for m in chat
            ]
        }
        for chat in CHATS
    ]
    by_name = ours(trl_cfg(write_jsonl(tmp_path / "a.jsonl", named), assistant_only_loss=True), tokenizer)
    by_role = ours(trl_cfg(write_jsonl(tmp_path / "b.jsonl", ROWS["messages"]), assistant_only_loss=True), tokenizer)
    assert by_name == by_role


def test_start_log_names_the_format_and_its_columns(tokenizer, tmp_path):
    expected = {
        "text": "language modelling rows (columns text)",
        "prompt_completion": "prompt-completion rows (columns prompt, completion)",
        "messages": "conversational rows (columns messages)",
        "chat_prompt_completion": "conversational prompt-completion rows (columns prompt, completion)",
        "sharegpt": "ShareGPT conversations rows (columns conversations)",
        "tools": "conversational rows (columns messages, tools)",
    }
    for name, description in expected.items():
        _, report = load_examples(trl_cfg(write_jsonl(tmp_path / f"{name}.jsonl", ROWS[name])), tokenizer, "train")
        assert report.summary().startswith(f"{tmp_path / name}.jsonl split train: {description}: 3 of 3 rows kept")


def test_truncations_are_counted(tokenizer, tmp_path):
    _, report = load_examples(trl_cfg(write_jsonl(tmp_path / "t.jsonl", ROWS["text"]), 6), tokenizer, "train")
    assert report.num_truncated == 3 and "(3 truncated to --max_length)" in report.summary()


BAD_CHATS = [
    [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "ok"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}],
    [{"role": "user", "content": "only a question"}],
]


def test_bad_rows_are_counted_by_kind_and_strict_data_names_file_and_row(tokenizer, tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": CHATS[1]}, *({"messages": c} for c in BAD_CHATS), {"messages": None}]
    )
    examples, report = load_examples(trl_cfg(path, assistant_only_loss=True), tokenizer, "train")
    assert len(examples) == 1
    assert report.skipped == {
        "unknown_role": 1,
        "empty_assistant_turn": 1,
        "no_assistant_tokens": 1,
        "missing_field": 1,
    }
    cfg = trl_cfg(path, assistant_only_loss=True)
    cfg.data.strict = True
    with pytest.raises(DataError, match=rf"^{path} row 2: message 1 of 'messages' has the role 'robot'"):
        load_examples(cfg, tokenizer, "train")


def test_templates_without_generation_markers_or_none_are_one_error(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS["messages"])
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    cfg = trl_cfg(path, assistant_only_loss=True, chat_template_path=str(plain))
    with pytest.raises(ConfigError, match="no such markers: pass --chat_template_path"):
        load_examples(cfg, apply_tokenizer_options(cfg, copy.deepcopy(tokenizer)), "train")
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ConfigError, match="has none: pass --chat_template_path"):
        load_examples(trl_cfg(path), bare, "train")
    with pytest.raises(ConfigError, match="needs conversational rows"):
        load_examples(
            trl_cfg(write_jsonl(tmp_path / "t.jsonl", ROWS["text"]), assistant_only_loss=True), tokenizer, "train"
        )


def test_chat_template_path_file_is_the_template_trl_uses(tokenizer, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(tokenizer.chat_template.replace("<|assistant|>", "[bot]").replace("<|", "[").replace("|>", "]"))
    cfg = trl_cfg(
        write_jsonl(tmp_path / "chat.jsonl", ROWS["messages"]),
        assistant_only_loss=True,
        chat_template_path=str(template),
    )
    mine = assert_same_as_trl(cfg, tokenizer, tmp_path)
    assert tokenizer.decode(mine[1][0]).startswith("[user]\nLunch on Monday?")


def test_dataset_name_flags_select_the_dataset_and_unused_options_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS["messages"])
    cfg = parse_args(
        [
            "--dataset_name",
            str(path),
            "--assistant_only_loss",
            "true",
            "--completion_only_loss",
            "False",
            "--max_length",
            "256",
            "--dataset_test_split",
            "validation",
        ]
    )
    assert cfg.data.dataset == "trl_dataset" and cfg.data.trl_dataset.assistant_only_loss
    assert cfg.data.trl_dataset.completion_only_loss == "false" and cfg.data.context_length == 256
    check_data_config(cfg)
    with pytest.raises(ConfigError, match="--assistant_only_loss True has no effect with --dataset samsum_dataset"):
        check_data_config(parse_args(["--dataset", "samsum_dataset", "--assistant_only_loss", "true"]))
    with pytest.raises(ConfigError, match="both name the data"):
        check_data_config(parse_args(["--dataset", "alpaca_dataset", "--dataset_name", str(path)]))


def test_folder_splits_and_an_absent_test_split(tokenizer, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS["messages"])
    write_jsonl(folder / "test.jsonl", ROWS["messages"][:2])
    cfg = trl_cfg(folder)
    assert validation_available(cfg)
    examples, report = load_examples(cfg, tokenizer, "validation")
    assert len(examples) == 2 and "split test" in report.source
    assert not validation_available(trl_cfg(write_jsonl(tmp_path / "one.jsonl", ROWS["messages"])))


def test_an_evaluation_asked_for_on_data_without_the_split_is_refused_not_dropped(tmp_path):
    one = write_jsonl(tmp_path / "one.jsonl", ROWS["messages"])
    asked = ["--dataset_name", str(one), "--dataset_test_split", "validation", "--eval_strategy", "steps"]
    with pytest.raises(DataError, match="--eval_strategy asks for evaluation.*no split 'validation'") as error:
        drop_absent_validation(parse_args(asked), say=False)
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="--run_validation asks"):
        drop_absent_validation(parse_args(["--dataset_name", str(one), "--run_validation", "true"]), say=False)
    unasked = parse_args(["--dataset_name", str(one), "--defaults", "cookbook"])  # the cookbook evaluates by default
    assert unasked.eval.enabled
    drop_absent_validation(unasked, say=False)
    assert not unasked.eval.enabled  # not asked for: trains without evaluation, said before launch


def test_cache_key_follows_template_and_mask_options(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS["messages"])
    keys = {
        cache_key(trl_cfg(path), tokenizer, "train"),
        cache_key(trl_cfg(path, assistant_only_loss=True), tokenizer, "train"),
        cache_key(trl_cfg(path, completion_only_loss="false"), tokenizer, "train"),
        cache_key(trl_cfg(path, truncation_mode="keep_end"), tokenizer, "train"),
    }
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template.replace("<|assistant|>", "<|bot|>")
    keys.add(cache_key(trl_cfg(path), other, "train"))
    assert len(keys) == 5


def test_synthetic_dialogues_as_messages_train_on_the_summary_and_eos(tokenizer):
    cfg = config_from(run_validation=False)
    cfg.data.synthetic_dialogues.num_train, cfg.data.synthetic_dialogues.messages = 8, True
    cfg.data.trl_dataset.assistant_only_loss = True
    check_data_config(cfg)
    examples, report = load_examples(cfg, tokenizer, "train")
    assert "generated train dialogues as messages" in report.source and len(examples) == 8
    plain, _ = load_examples(config_from({"synthetic_dialogues.num_train": 8}), tokenizer, "train")
    for example, samsum in zip(examples, plain):
        summary = [t for t in samsum["labels"] if t != IGNORE_INDEX]
        assert [t for t in example["labels"] if t != IGNORE_INDEX] == summary  # summary + eos, as the samsum form
        assert tokenizer.decode(example["input_ids"]).startswith("<|system|>\nSummarize the dialog.\n<|user|>\n")


def test_generate_renders_message_prompts_with_the_chat_template(tokenizer):
    from shardtune.commands.generate import encode_messages, prompt_messages

    chat = [SYSTEM, {"role": "user", "content": "Lunch on Monday?"}]
    for text in (json.dumps(chat), json.dumps({"messages": chat}), json.dumps({"prompt": chat})):
        assert prompt_messages(text) == chat
    assert prompt_messages("Summarize this dialog: [1, 2]") is None and prompt_messages('["a"]') is None
    rendered = tokenizer.decode(encode_messages(tokenizer, chat))
    assert rendered == "<|system|>\nYou plan outings. Be brief.\n<|user|>\nLunch on Monday?\n<|assistant|>\n"


def test_missing_files_and_unreachable_hub_ids_are_one_line(tokenizer, tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        check_data_config(parse_args(["--dataset_name", str(tmp_path / "missing.jsonl")]))
    with pytest.raises(DataError, match="unknown format '.txt'"):
        check_data_config(parse_args(["--dataset_name", str(write_jsonl(tmp_path / "rows.txt", ROWS["text"]))]))
    cfg = parse_args(["--dataset_name", "nobody-here/no-such-dataset", "--run_validation", "false"])
    check_data_config(cfg)  # a hub id: looked up when loading (HF_DATASETS_OFFLINE is set in the tests)
    with pytest.raises(DataError, match="nobody-here/no-such-dataset: could not be loaded from the Hugging Face hub"):
        load_examples(cfg, tokenizer, "train")


@pytest.mark.parametrize("suffix", [".json", ".csv", ".parquet", ".arrow"])
def test_every_file_format_gives_the_same_examples(suffix, tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ROWS["prompt_completion"]
    path = tmp_path / f"pairs{suffix}"
    table = pa.Table.from_pylist(rows)
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        table.to_pandas().to_csv(path, index=False)
    elif suffix == ".parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    expected = ours(trl_cfg(write_jsonl(tmp_path / "pairs.jsonl", rows)), tokenizer)
    assert ours(trl_cfg(path), tokenizer) == expected


def test_chat_template_path_may_name_a_tokenizer_directory(tokenizer, tmp_path):
    source = copy.deepcopy(tokenizer)
    source.chat_template = tokenizer.chat_template.replace("<|assistant|>", "<|bot|>")
    source.save_pretrained(tmp_path / "other")
    cfg = trl_cfg(tmp_path / "unused.jsonl", chat_template_path=str(tmp_path / "other"))
    assert apply_tokenizer_options(cfg, copy.deepcopy(tokenizer)).chat_template == source.chat_template
    with pytest.raises(ConfigError, match="no such Jinja file"):
        apply_tokenizer_options(
            trl_cfg(tmp_path / "unused.jsonl", chat_template_path=str(tmp_path / "nope.jinja")),
            copy.deepcopy(tokenizer),
        )
    with pytest.raises(ConfigError, match="--eos_token '<eot>' is not a token"):
        apply_tokenizer_options(trl_cfg(tmp_path / "unused.jsonl", eos_token="<eot>"), copy.deepcopy(tokenizer))


def test_a_data_file_is_parsed_in_a_child_and_this_process_maps_its_cache(tmp_path, monkeypatch):
    """The launcher lives for the whole run, so datasets' parsing of a fresh file (heap its allocators keep, growing
    with the corpus) is done in a forked child: the Arrow cache exists before this process loads, and its load maps
    those very files (not written again) with the file's rows. A failing child is silent (the load here says why);
    a rank forks nothing."""
    import functools

    import datasets

    from shardtune.data.aside import build_aside
    from shardtune.data.trl_loading import _load

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    rows = ROWS["text"] * 40
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert build_aside(functools.partial(datasets.load_dataset, "json", data_files={"train": str(path)}))
    built = {p: p.stat().st_mtime_ns for p in (tmp_path / "hf").rglob("*.arrow")}
    assert built, "the child wrote the Arrow cache"
    loaded = _load.__wrapped__(str(path), "")
    assert loaded["train"]["text"] == [r["text"] for r in rows]
    assert {Path(f["filename"]) for f in loaded["train"].cache_files} <= set(built)
    assert {p: p.stat().st_mtime_ns for p in built} == built  # mapped, not parsed and written again here

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a row"}\n{"text": \n')
    assert not build_aside(functools.partial(datasets.load_dataset, "json", data_files={"train": str(bad)}))
    with pytest.raises(DataError, match="bad.jsonl: could not be loaded from local data"):
        _load.__wrapped__(str(bad), "")

    other = write_jsonl(tmp_path / "other.jsonl", rows[:3])
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    before = set((tmp_path / "hf").rglob("*.arrow"))
    assert not build_aside(functools.partial(datasets.load_dataset, "json", data_files={"train": str(other)}))
    assert set((tmp_path / "hf").rglob("*.arrow")) == before
