"""Chat templates and the tokenizer options of TRL's SFT flags (--chat_template_path, --eos_token).

``apply_tokenizer_options`` runs wherever a tokenizer is loaded for training or evaluation (the launcher's checks,
every worker, ``shardtune eval``), so all of them tokenise alike, and the tokenizer saved with the model carries
the template it was trained with.

The preset tokenizers ship :data:`PRESET_CHAT_TEMPLATE`: plain-text role headers (the preset vocabulary has no
chat tokens), eos closing every assistant turn, and ``{% generation %}`` markers around the assistant's text and
its eos, so ``--assistant_only_loss`` works on presets out of the box.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardtune.config.schema import ConfigError, TrainConfig

PRESET_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|tools|>\\n' + (tools | tojson) + '\\n' }}{% endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] or '' }}"
    "{%- if message['tool_calls'] %}{{ message['tool_calls'] | tojson }}{% endif -%}"
    "{{ eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif -%}"
)
TEMPLATE_SUFFIXES = (".jinja", ".j2")
TRL_TRAINING_TEMPLATES_HINT = (
    "trl ships such templates for common model families in trl/chat_templates/*_training.jinja"
)


def has_generation_markers(template: str | dict | None) -> bool:
    """True when the template marks assistant text with ``{% generation %}`` (any whitespace-trim spelling)."""
    if isinstance(template, dict):
        template = template.get("default")
    return bool(template) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def read_chat_template(path: str) -> str:
    """The template of ``--chat_template_path``: a Jinja file, or the chat template of a tokenizer directory."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix in TEMPLATE_SUFFIXES:
        return p.read_text(encoding="utf-8")
    if p.is_dir():
        from transformers import AutoTokenizer

        template = AutoTokenizer.from_pretrained(str(p)).chat_template
        if not template:
            raise ConfigError(
                f"--chat_template_path {path}: that tokenizer has no chat template: pass a Jinja file "
                "(.jinja) or a tokenizer directory that has one"
            )
        return template
    raise ConfigError(
        f"--chat_template_path {path}: no such Jinja file (.jinja, .j2) or tokenizer directory: pass one of them"
    )


def apply_tokenizer_options(cfg: TrainConfig, tokenizer: Any) -> Any:
    """Set the chat template and eos token that the data flags ask for (in place; returns the tokenizer)."""
    tc = cfg.data.trl_dataset
    if tc.chat_template_path:
        tokenizer.chat_template = read_chat_template(tc.chat_template_path)
    if tc.eos_token:
        if tc.eos_token not in tokenizer.get_vocab():
            raise ConfigError(
                f"--eos_token {tc.eos_token!r} is not a token of the tokenizer: pass one of its tokens "
                f"(its eos is {tokenizer.eos_token!r})"
            )
        tokenizer.eos_token = tc.eos_token
    return tokenizer


def check_chat_template(cfg: TrainConfig, tokenizer: Any, what: str) -> None:
    """Conversational rows need a template; --assistant_only_loss needs its generation markers."""
    template = tokenizer.chat_template
    if not template:
        raise ConfigError(
            f"{what} needs a chat template, and the tokenizer has none: pass --chat_template_path "
            "(a Jinja file, or a tokenizer directory whose template to use)"
        )
    if cfg.data.trl_dataset.assistant_only_loss and not has_generation_markers(template):
        raise ConfigError(
            "--assistant_only_loss true needs a chat template that marks the assistant's text with "
            "{% generation %} ... {% endgeneration %}, and the tokenizer's has no such markers: pass "
            f"--chat_template_path with a template that has them ({TRL_TRAINING_TEMPLATES_HINT}), or "
            "--assistant_only_loss false"
        )


def mirror_eos_token(cfg: TrainConfig, model: Any, tokenizer: Any) -> None:
    """With --eos_token, the model's config and generation config end sequences at it too (as TRL does), so the
    saved model stops where it was trained to; the generation config keeps its other eos ids."""
    if not cfg.data.trl_dataset.eos_token:
        return
    model.config.get_text_config().eos_token_id = tokenizer.eos_token_id
    if getattr(model, "generation_config", None) is None:  # a sequence-classification model generates nothing
        return
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id not in ids:
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *ids]
