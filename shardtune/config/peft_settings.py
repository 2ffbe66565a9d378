"""The adapter group of the canonical config (shardtune.config.schema): the method and each method's settings."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config.setting import REFERENCE, setting

# -- adapters ------------------------------------------------------------------------------------------------------

PEFT_METHODS = ("", "lora", "llama_adapter", "prefix")


@dataclass
class LoraConfig:
    r: int = setting(8, "LoRA rank", at_least=1)
    alpha: int = setting(32, "LoRA scaling numerator (scale = alpha / r)", above=0)
    target_modules: list[str] = setting(["q_proj", "v_proj"], "module names to adapt (or all-linear)")
    dropout: float = setting(0.05, "dropout on the LoRA input", at_least=0, below=1)
    bias: str = setting("none", "none, all or lora_only", choices=("none", "all", "lora_only"))
    use_dora: bool = setting(False, "weight-decomposed LoRA (DoRA)")
    use_rslora: bool = setting(False, "rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r")
    modules_to_save: list[str] = setting([], "modules trained in full and saved with the adapter (e.g. lm_head)")


@dataclass
class LlamaAdapterConfig:
    adapter_len: int = setting(10, "adaption prompt length", at_least=1)
    adapter_layers: int = setting(30, "number of top layers adapted (clamped to the model's depth)", at_least=1)


@dataclass
class PrefixConfig:
    num_virtual_tokens: int = setting(30, "prefix length", at_least=1)


@dataclass
class PeftSettings:
    method: str = setting(
        "",
        "train an adapter instead of all parameters: lora, llama_adapter or prefix; empty: full fine-tuning",
        choices=PEFT_METHODS,
        **REFERENCE,
    )
    from_checkpoint: str = setting("", "adapter directory to continue training from")
    lora: LoraConfig = setting(LoraConfig(), "LoRA settings")
    llama_adapter: LlamaAdapterConfig = setting(LlamaAdapterConfig(), "llama-adapter settings")
    prefix: PrefixConfig = setting(PrefixConfig(), "prefix tuning settings")
