"""``shardtune sft --help`` and docs/flags.md, generated from the config's fields and the dialects' tables
(``python -m shardtune.config.help > docs/flags.md``; a test checks the file is current)."""

from __future__ import annotations

from dataclasses import fields

from shardtune.config.dialects.cookbook import COOKBOOK_NAMES
from shardtune.config.dialects.trl import PROFILES
from shardtune.config.dialects.trl import SPELLINGS as TRL
from shardtune.config.fields import flat_fields
from shardtune.config.objectives import OBJECTIVES
from shardtune.config.schema import TrainConfig
from shardtune.config.spellings import names_of


def type_name(typ) -> str:
    return getattr(typ, "__name__", str(typ)).replace("typing.", "")


def help_text(command: str = "sft") -> str:
    lines = [
        f"usage: shardtune {command} [--config recipe.yaml] [--accelerate_config accelerate.yaml|PROFILE] [--flag "
        "value ...] [torchrun flags]",
        "",
        "precedence: command line > recipe (--config; TRL's `trl sft --config` YAML too) > Accelerate file; a "
        "setting the recipe and the Accelerate file give different values is named in one line",
        "",
        "settings (--group.name VALUE; the names llama-cookbook and TRL give them work too, as shown):",
    ]
    group = ""
    for key, info in flat_fields().items():
        if key.split(".")[0] != group:
            group = key.split(".")[0]
            lines += ["", f"{group}:"]
        cookbook, trl = names_of(key, "llama-cookbook"), names_of(key, "TRL")
        also = ([f"llama-cookbook: {', '.join('--' + n for n in cookbook)}"] if cookbook else []) + (
            [f"TRL: {', '.join('--' + n for n in trl)}"] if trl else []
        )
        lines.append(
            f"  --{key} {type_name(info.type).upper()}  (default: {info.default!r})"
            + (f"  ({'; '.join(also)})" if also else "")
        )
        lines.append(f"      {info.meta.get('help', '')}")
    lines.append("")
    refused = [n for n, spelling in TRL.items() if spelling.refuse]
    lines.append(
        "TRL flags refused (with the fix, in one line): "
        + ", ".join(f"--{n}" for n in refused)
        + " (docs/flags.md: the whole table)"
    )
    registration = OBJECTIVES.get(command)
    if registration is not None and registration.settings:
        own = [f"--{f.name}" for f in fields(type(getattr(TrainConfig(), registration.settings)))]
        lines.append(f"{command}: {registration.help}; its own flags: {', '.join(own)}")
    return "\n".join(lines)


def flag_table() -> str:
    """docs/flags.md: TRL name, cookbook name, the canonical setting, meaning."""
    lines = [
        "# Flags: TRL's names, llama-cookbook's, shardtune's",
        "",
        "Generated from the config (`shardtune/config/schema.py`, `shardtune/config/dialects/`: `python -m "
        "shardtune.config.help > docs/flags.md`); a test checks it is current.",
        "",
        "shardtune's settings are one canonical config, grouped by what owns them (`--optim.lr`, "
        "`--parallel.strategy fsdp`, `--peft.method lora`; `shardtune sft --help` lists them all, and "
        "`config.yaml` is written in that form). llama-cookbook's flags (`--lr`, `--enable_fsdp`, "
        "`--fsdp_config.pure_bf16`, `--use_peft --peft_method lora`) and TRL's (below) are translated into it "
        "with their own meaning; so are earlier shardtune releases' flat names and config.yaml files.",
        "",
        "Precedence: command line > recipe (`--config`) > Accelerate file (`--accelerate_config`). Where the "
        "recipe and the Accelerate file set the same setting to different values, one line names both and the "
        "recipe's value is used. Every flag given is honoured or refused before launch in one line.",
        "",
        "Weight decay is not applied to biases and norm weights (as Hugging Face's Trainer does). The "
        "warm-up ramps the lr as (step + 1) / (warmup + 1) of the peak, so no step trains at lr 0 (Hugging "
        "Face's first step does).",
        "",
        "## Files",
        "",
        "- `shardtune sft --config FILE` reads a `trl sft --config` YAML: TRL's flat keys (the table below), "
        "shardtune's own names (nested sections too), `env:` (exported before launch) and `accelerate_config:` "
        "(a file or a profile name). All unknown keys are named at once, in one line.",
        "- `--accelerate_config` takes a file or a packaged profile: "
        + ", ".join(f"`{p}`" for p in PROFILES)
        + " (no process count: one per visible GPU, or `--num_processes N`). `distributed_type: NO` starts one "
        "process whatever `num_processes` says, as Accelerate does.",
        "- `parallelism_config`: `cp_size` (torch backend) is ring attention (`--cp_size`); `sp_size`, and "
        "`cp_size` with `cp_backend: deepspeed` (ALST), are Ulysses (`--sp_size`); `dp_replicate_size` > 1 under "
        "FSDP is HYBRID_SHARD with that many replicas; `dp_shard_size` is the rest of the world; the product must "
        "equal `num_processes`; `tp_size` > 1 is refused.",
        "",
        "## TRL's names",
        "",
        "| TRL | llama-cookbook | shardtune | meaning |",
        "|---|---|---|---|",
    ]
    for name, spelling in TRL.items():
        targets = spelling.target.replace("/", " ").split()
        cookbook = (
            ", ".join(f"`{n}`" for t in targets for n in names_of(t, "llama-cookbook") if n in COOKBOOK_NAMES) or "-"
        )
        ours = "refused" if spelling.refuse else f"`{spelling.target}`"
        meaning = spelling.refuse if spelling.refuse else spelling.meaning
        lines.append(f"| `--{name}` | {cookbook} | {ours} | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(flag_table(), end="")
