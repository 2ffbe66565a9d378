"""The data group of the canonical config (shardtune.config.schema): which dataset, its sections, batching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtune.config.setting import CACHE, REFERENCE, RUN, setting

# -- data ----------------------------------------------------------------------------------------------------------

DATASETS = (
    "synthetic_dialogues",
    "samsum_dataset",
    "alpaca_dataset",
    "custom_dataset",
    "grammar_dataset",
    "trl_dataset",
)
BATCHING_STRATEGIES = ("packing", "padding")
PACKING_STRATEGIES = ("greedy", "bfd", "bfd_split", "wrapped")  # shardtune.data.packing
COMPLETION_ONLY_LOSS = ("auto", "true", "false")
TRUNCATION_MODES = ("keep_start", "keep_end")
SAMPLING = ("random", "sequential")  # TRL's train_sampling_strategy (group_by_length is not built)


@dataclass
class SyntheticDialoguesConfig:
    num_train: int = setting(4000, "number of generated training dialogues", at_least=0, **CACHE)
    num_validation: int = setting(200, "number of generated validation dialogues", at_least=0, **CACHE)
    seed: int = setting(1234, "seed of the dialogue generator (independent of the training seed)", **CACHE)
    chatter: bool = setting(
        False,
        "mix off-topic talk into about half of the dialogues: 3 to 30 turns with a long "
        "tail of long chats, like SAMSum (the summaries do not change)",
        **CACHE,
    )
    messages: bool = setting(
        False,
        "write each dialogue as conversational `messages` (system, user: the dialogue, "
        "assistant: the summary), rendered by the chat template with the TRL dataset "
        "options (--assistant_only_loss ...)",
        **CACHE,
    )


@dataclass
class SamsumDatasetConfig:
    data_path: str = setting(
        "",
        "local file or folder (JSON, JSONL, CSV, Parquet with fields dialogue, summary); "
        "empty: the hub dataset named by hub_name",
        **CACHE,
    )
    hub_name: str = setting("knkarthick/samsum", "hub dataset used when data_path is empty", **CACHE)
    train_split: str = setting("train", "split used for training", **CACHE)
    test_split: str = setting("validation", "split used for evaluation", **CACHE)
    validation_fraction: float = setting(
        0.0,
        "if > 0 and no validation file exists, hold out this fraction of the "
        "training rows (deterministic from the seed)",
        at_least=0,
        below=1,
        **CACHE,
    )


@dataclass
class AlpacaDatasetConfig:
    data_path: str = setting("", "JSON / JSONL file of {instruction, input, output} rows", **CACHE)
    validation_fraction: float = setting(0.05, "fraction of rows held out for evaluation", at_least=0, below=1, **CACHE)


@dataclass
class CustomDatasetConfig:
    file: str = setting(
        "",
        "path.py[:function]; the function takes (dataset_config, tokenizer, split) and returns "
        "rows of input_ids / labels (and optionally attention_mask); default function: "
        "get_custom_dataset. A vision-language model's gets its processor instead of the tokenizer, and the "
        "file's get_data_collator(processor), if any, makes its batches (llama-cookbook's vision recipes)",
        **CACHE,
    )
    train_split: str = setting("train", "split name passed for training", **CACHE)
    test_split: str = setting("validation", "split name passed for evaluation", **CACHE)
    data_path: str = setting("", "free path your function may read (dataset_config.data_path)", **CACHE)


@dataclass
class GrammarDatasetConfig:
    train_split: str = setting(
        "gtrain_10k.csv",
        "CSV file of training rows with columns input, target (llama-cookbook's grammar_dataset)",
        **CACHE,
    )
    test_split: str = setting(
        "grammar_validation.csv", "CSV file of evaluation rows with columns input, target", **CACHE
    )


@dataclass
class TrlDatasetConfig:
    """TRL's SFT / DPO data settings, under TRL's names; see docs/data-formats.md."""

    dataset_name: str = setting(
        "",
        "a local JSON / JSONL / CSV / Parquet / Arrow file or folder of such files, or a "
        "hub dataset id; its format (text, prompt-completion, messages, ShareGPT "
        "conversations, input_ids) is recognised from its columns, as TRL does",
        **CACHE,
    )
    dataset_config: str = setting(
        "", "the dataset configuration (subset) name, for hub datasets that have several", **CACHE
    )
    dataset_train_split: str = setting("train", "split used for training", **CACHE)
    dataset_test_split: str = setting("test", "split used for evaluation; absent: no evaluation", **CACHE)
    dataset_text_field: str = setting("text", "column of language-modelling rows", **CACHE)
    completion_only_loss: str = setting(
        "auto",
        "prompt-completion rows: loss on the completion only; auto: true for prompt-completion data (TRL's None)",
        choices=COMPLETION_ONLY_LOSS,
        **CACHE,
    )
    assistant_only_loss: bool = setting(
        False,
        "conversational rows: loss on the assistant turns only, through the chat template's {% generation %} markers",
        **CACHE,
    )
    chat_template_path: str = setting(
        "", "a Jinja chat template file, or a tokenizer directory whose template to use", **CACHE
    )
    eos_token: str = setting("", "the token that ends a sequence / turn; empty: the tokenizer's", **CACHE)
    truncation_mode: str = setting(
        "keep_start",
        "rows longer than data.context_length are cut: keep_start or keep_end",
        choices=TRUNCATION_MODES,
        **CACHE,
    )
    dataset_mixture: list[dict[str, Any]] = setting(
        [],
        "several datasets in one run, by weight (TRL's datasets: list; docs/data-formats.md#mixtures): entries of "
        "path, name, data_dir, data_files, split, columns, weight (or TRL's fraction); on the command line "
        "path[@split][:weight],...",
        **CACHE,
    )


@dataclass
class DataSettings:
    dataset: str = setting("synthetic_dialogues", "one of: " + ", ".join(DATASETS), choices=DATASETS, **CACHE)
    context_length: int = setting(
        1024, "tokens per packed block / longest example kept (TRL: max_length)", at_least=1, **CACHE
    )
    batching: str = setting(
        "packing",
        "packing (blocks of up to context_length tokens, made by --packing_strategy, computed without padding; no "
        "attention across examples but with wrapped) or padding (length-grouped, padded to the longest in the "
        "micro-batch)",
        choices=BATCHING_STRATEGIES,
        **REFERENCE,
    )
    sampling: str = setting(
        "random",
        "the order of the training units each epoch (TRL: train_sampling_strategy): random (a permutation seeded by "
        "--seed and the epoch) or sequential (the data's order; TRL's KTO default); each step's units are the same "
        "on any layout either way",
        choices=SAMPLING,
    )
    packing_strategy: str = setting(
        "greedy",
        "with packing, which examples share a block: greedy (whole examples in a seeded order, a block closed when "
        "the next does not fit; llama-cookbook's), bfd (TRL's default: best-fit decreasing, longest first into the "
        "fullest block that holds them; rows cut to context_length), bfd_split (bfd, long rows split into pieces "
        "instead of cut), wrapped (TRL's: rows concatenated and cut every context_length tokens, no row cut first; "
        "a block is one sequence, its examples attend to those before them and an example may run on into the next "
        "block); TRL's three pack each 1,000 rows in data order, as TRL does (docs/data.md#packing)",
        choices=PACKING_STRATEGIES,
        **CACHE,
    )
    padding_free: bool | None = setting(
        None,
        "with padding: compute each micro-batch as one row of its examples without "
        "pad tokens (same examples and loss, no wasted compute); packing always is. None (not given): "
        "padding-free where the objective computes the same numbers faster so (text SFT on CPU), padded rows "
        "elsewhere; false: padded rows",
        **REFERENCE,
    )
    strict: bool = setting(
        False, "fail on the first bad data row (naming file and row) instead of skipping it", **CACHE
    )
    streaming: bool = setting(
        False,
        "--dataset_name data read, tokenised and batched as the steps need them, in the data's order (packing: "
        "blocks in that order), nothing prepared before launch; needs --max_steps (docs/data.md)",
    )
    num_workers: int = setting(
        1, "data loader worker processes per rank (0: in the training process)", at_least=0, **RUN
    )
    num_proc: int | None = setting(
        None,
        "processes that tokenise the data into the tokenised-data cache before launch (TRL: dataset_num_proc); "
        "None: one per CPU available to the launcher. The cache is the same for any number (docs/data.md)",
        at_least=1,
        **RUN,
    )
    synthetic_dialogues: SyntheticDialoguesConfig = setting(SyntheticDialoguesConfig(), "embedded dialogue data")
    samsum_dataset: SamsumDatasetConfig = setting(SamsumDatasetConfig(), "SAMSum-format data")
    alpaca_dataset: AlpacaDatasetConfig = setting(AlpacaDatasetConfig(), "alpaca-format data")
    custom_dataset: CustomDatasetConfig = setting(CustomDatasetConfig(), "your own dataset function")
    grammar_dataset: GrammarDatasetConfig = setting(GrammarDatasetConfig(), "llama-cookbook's grammar correction CSVs")
    trl_dataset: TrlDatasetConfig = setting(TrlDatasetConfig(), "TRL's dataset settings (--dataset_name ...)")

    @property
    def selected(self) -> Any:
        """The settings of the dataset trained on."""
        return getattr(self, self.dataset)
