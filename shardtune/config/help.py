"""``shardtune sft --help`` and docs/flags.md, generated from the config's fields and the dialects' tables
(``python -m shardtune.config.help > docs/flags.md``; a test checks the file is current)."""

from __future__ import annotations

from dataclasses import fields

from shardtune.config.defaults import HOME, TRL_DEFAULTS
from shardtune.config.dialects.cookbook import COOKBOOK_NAMES
from shardtune.config.dialects.trl import PROFILES
from shardtune.config.dialects.trl import SPELLINGS as TRL
from shardtune.config.fields import flat_fields
from shardtune.config.objectives import OBJECTIVES
from shardtune.config.schema import TrainConfig
from shardtune.config.spellings import SPEAKERS, names_of


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
        "a switch (BOOL, and every TRL / llama-cookbook name that takes true / false) is true given bare "
        "(--packing) and false as --no_NAME (--no_packing, --no_gradient_checkpointing, --no_eval.on_start), as "
        "TRL's parser takes it",
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
        readers = " / ".join(registration.shares)
        shared = f"; it reads shardtune {readers}'s flags too (its docs page: which)" if readers else ""
        lines.append(f"{command}: {registration.help}; its own flags: {', '.join(own)}{shared}")
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
        "On the command line, `--no_NAME` is `--NAME false` for every name that takes true / false (TRL's, "
        "llama-cookbook's, shardtune's: `--no_remove_unused_columns`, `--no_gradient_checkpointing`, `--no_bf16`, "
        "`--no_fsdp_config.pure_bf16`, `--no_eval.on_start`), as transformers' HfArgumentParser reads TRL's "
        "commands; `--no_NAME` takes no value, and before a name that takes a value it is refused. Recipes use "
        "the names themselves (`packing: false`).",
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
        *defaults_section(),
        "## TRL's names",
        "",
        "| TRL | llama-cookbook | shardtune | TRL's default | the cookbook's | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for name, spelling in TRL.items():
        targets = spelling.target.replace("/", " ").split()
        cookbook = (
            ", ".join(f"`{n}`" for t in targets for n in names_of(t, "llama-cookbook") if n in COOKBOOK_NAMES) or "-"
        )
        ours = "refused" if spelling.refuse else f"`{spelling.target}`"
        meaning = spelling.refuse if spelling.refuse else spelling.meaning
        known = [t for t in targets if t in flat_fields()] if not spelling.refuse else []
        trl = ", ".join(_shown(TRL_DEFAULTS["sft"].get(t, flat_fields()[t].default)) for t in known) or "-"
        theirs = ", ".join(_shown(flat_fields()[t].default) for t in known) or "-"
        lines.append(f"| `--{name}` | {cookbook} | {ours} | {trl} | {theirs} | {meaning} |")
    return "\n".join(lines) + "\n"


def _shown(value) -> str:
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`" if value else "`''`"


def defaults_section() -> list[str]:
    """docs/flags.md: whose defaults a command gets (shardtune.config.defaults), and where the two differ."""
    lines = [
        "## Whose defaults",
        "",
        "A setting you leave out takes TRL 1.16's default (SFTConfig / DPOConfig / ModelConfig) or llama-cookbook's "
        "(the canonical default, what `--help` shows), by one rule: `--defaults trl|cookbook` when given; else the "
        "names used: "
        + ", ".join(f"`--{n}`" for n in SPEAKERS["trl"])
        + " speak TRL, "
        + ", ".join(f"`--{n}`" for n in SPEAKERS["cookbook"])
        + " speak llama-cookbook (both at once is refused in one line, unless `--defaults` says whose); else the "
        "command's own: "
        + ", ".join(f"shardtune {o}: {'TRL' if h == 'trl' else 'llama-cookbook'}" for o, h in HOME.items())
        + ". Names both tools use (`--output_dir`, `--seed`, `--use_peft`, `--bf16`, `--save_steps`, "
        "`--max_steps`) and shardtune's own say nothing. The start log says whose, and the lr, schedule, warm-up, "
        "clipping, epochs or steps, batch, checkpoints, packing and LoRA the run has. Code building a config "
        "(`config_from`) gets the cookbook's unless it passes `defaults`.",
        "",
        "| setting | TRL (sft) | TRL (dpo) | llama-cookbook |",
        "|---|---|---|---|",
    ]
    for key in dict.fromkeys([*TRL_DEFAULTS["sft"], *TRL_DEFAULTS["dpo"]]):
        default = flat_fields()[key].default
        sft, dpo = (_shown(TRL_DEFAULTS[o].get(key, default)) for o in ("sft", "dpo"))
        lines.append(f"| `{key}` | {sft} | {dpo} | {_shown(default)} |")
    return [*lines, ""]


if __name__ == "__main__":
    print(flag_table(), end="")
