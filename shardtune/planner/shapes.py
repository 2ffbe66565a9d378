"""The shapes a plan is computed from: a model's architecture (read from config.json alone, or a built-in
shape) and what is trained (full, or an adapter).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from shardtune.config.schema import ConfigError
from shardtune.planner.vision import VisionShape, full_config, processor_settings, vision_shape, write_preset_config

# -- architectures ---------------------------------------------------------------------------------------------------

_LLAMA3 = dict(
    model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072
)
BUILTIN_SHAPES: dict[str, dict] = {
    "llama3.2-1b": dict(
        _LLAMA3,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        tie_word_embeddings=True,
    ),
    "llama3.2-3b": dict(
        _LLAMA3,
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        intermediate_size=8192,
        tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        _LLAMA3,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
    ),
    "llama3-70b": dict(
        _LLAMA3,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
    ),
    "llama3.1-405b": dict(
        _LLAMA3,
        hidden_size=16384,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
    ),
}
# the hub ids a recommended command line names for the built-in shapes
HUB_IDS = {
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama3-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama3.1-405b": "meta-llama/Llama-3.1-405B-Instruct",
}


@dataclass(frozen=True)
class Arch:
    """The shapes of a decoder-only transformer that memory and FLOPs depend on."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    sliding_window: int | None = None
    # outputs of a sequence-classification head in place of the output layer over the vocabulary (a reward model's
    # score: 1); 0: the causal LM's output layer
    score_outputs: int = 0
    qk_norm: bool = False  # an RMSNorm on each query and key head (Gemma 3, Qwen3)
    norms_per_layer: int = 2  # RMSNorms per decoder layer (Gemma 2 / 3: four, before and after each block)
    extra_embedding_rows: int = 0  # input embedding rows beyond the vocabulary (mllama: 8)
    # decoder layers (of num_layers) that cross-attend to the image (mllama): a query / key RMSNorm and two gates more
    cross_attention_layers: int = 0
    vision: VisionShape | None = None  # a vision-language model's tower, projector and image tokens

    @classmethod
    def from_config(cls, config: dict, name: str = "") -> Arch:
        text = config.get("text_config") or config
        heads = text["num_attention_heads"]
        hidden = text["hidden_size"]
        model_type = text.get("model_type", "llama")
        # a composite config's own flag decides the tying (transformers reads it there)
        tied = config.get("tie_word_embeddings") if "text_config" in config else None
        return cls(
            name=name or text.get("_name_or_path", "") or text.get("model_type", "model"),
            model_type=model_type,
            vocab_size=text["vocab_size"],
            hidden_size=hidden,
            num_layers=text["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or hidden // heads,
            intermediate_size=text["intermediate_size"],
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False) if tied is None else tied),
            attention_bias=bool(text.get("attention_bias", model_type.startswith("qwen2"))),
            sliding_window=text.get("sliding_window") if text.get("use_sliding_window", True) else None,
            qk_norm=model_type.startswith(("gemma3", "qwen3")),
            norms_per_layer=4 if model_type.startswith(("gemma2", "gemma3")) else 2,
            extra_embedding_rows=8 if model_type.startswith("mllama") else 0,
            cross_attention_layers=len(text.get("cross_attention_layers") or ()),
        )

    # shapes (in, out) of each linear layer of one decoder layer
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        d, q, kv, f = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        return {
            "q_proj": (d, q),
            "k_proj": (d, kv),
            "v_proj": (d, kv),
            "o_proj": (q, d),
            "gate_proj": (d, f),
            "up_proj": (d, f),
            "down_proj": (f, d),
        }

    @property
    def layer_linear_params(self) -> int:
        return sum(i * o for i, o in self.linear_shapes().values())

    @property
    def layer_params(self) -> int:
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return self.layer_linear_params + bias + qk_norm + self.norms_per_layer * self.hidden_size  # + RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return (self.vocab_size + self.extra_embedding_rows) * self.hidden_size

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embedding, final norm, and the head when untied."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size  # the vocabulary only (mllama)
        if self.score_outputs:
            head = self.score_outputs * self.hidden_size
        return self.embedding_params + self.hidden_size + head

    @property
    def matmul_params(self) -> int:
        """Parameters a text token is multiplied by: all of the text model but the input embedding (a lookup), unless
        the output layer is the embedding itself (tied). The vision tower computes per image, not per token."""
        tied_output = self.tie_word_embeddings and not self.score_outputs
        return self.text_params - (0 if tied_output else self.embedding_params)

    @property
    def text_params(self) -> int:
        """The language model's parameters (mllama's cross-attention layers included) and its head."""
        cross = self.cross_attention_layers * (2 * self.head_dim + 2)  # query / key norms and two tanh gates
        return self.root_params + self.num_layers * self.layer_params + cross

    @property
    def num_params(self) -> int:
        return self.text_params + (self.vision.num_params if self.vision else 0)

    @property
    def cross_attention_params(self) -> int:
        """mllama's cross-attention decoder layers: a decoder layer's shapes, query / key norms and two gates."""
        return self.cross_attention_layers * (self.layer_params + 2 * self.head_dim + 2)


# the parts full fine-tuning may keep frozen (shardtune.model.freezing.VISION_FREEZING, without "model.freeze_")
FREEZABLE_PARTS = ("vision_tower", "multi_modal_projector", "language_model", "llm_only")


def frozen_params(arch: Arch, parts: frozenset[str]) -> int:
    """Parameters the freezing flags keep as they are (shardtune.model.freezing.frozen_parameters counts the same on
    the built model): the tower, the projector, the language model (its decoder and head), or llm_only: the language
    model less mllama's cross-attention layers."""
    if not parts:
        return 0
    v = arch.vision
    if v is None:
        raise ConfigError(f"freezing {', '.join(sorted(parts))}: {arch.name} is a text model (no vision tower)")
    frozen = v.tower_params if "vision_tower" in parts else 0
    frozen += v.projector_params if "multi_modal_projector" in parts else 0
    if "language_model" in parts:
        frozen += arch.text_params
    elif "llm_only" in parts:
        frozen += arch.text_params - arch.cross_attention_params
    return frozen


def read_arch(model: str) -> Arch:
    """A built-in shape name, a preset (preset:tiny), a local directory or config.json, or a hub id (its config
    only, when online)."""
    if model in BUILTIN_SHAPES:
        return Arch.from_config(BUILTIN_SHAPES[model], model)
    if model.startswith("preset:") or not model:
        from shardtune.model.loading import PRESETS, TOKENIZER_VOCAB_SIZE
        from shardtune.model.vision_presets import VISION_PRESETS

        name = model.removeprefix("preset:") or "demo"
        if name in VISION_PRESETS:
            with tempfile.TemporaryDirectory(prefix="shardtune-plan-") as folder:
                write_preset_config(name, Path(folder))
                return replace(read_arch(folder), name=model)
        if name not in PRESETS:
            raise ConfigError(
                f"--model_name {model}: unknown preset: choose one of "
                + ", ".join(f"preset:{p}" for p in [*PRESETS, *VISION_PRESETS])
            )
        return Arch.from_config({"vocab_size": TOKENIZER_VOCAB_SIZE, "model_type": "llama", **PRESETS[name]}, model)
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return arch_of(json.loads(path.read_text()), str(model), processor_settings(path.parent))
    if path.parent != Path(".") and not path.parent.exists() or model.startswith(("/", ".", "~")):
        raise ConfigError(
            f"--model_name {model}: no such directory or config.json: pass a model directory, a "
            "hub id, or a built-in shape: " + ", ".join(BUILTIN_SHAPES)
        )
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model).to_dict()
    except Exception as e:  # offline, unknown repo, gated: the same fix for the user
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"--model_name {model}: not a local directory and its config could not be read from the "
            f"hub ({reason}): pass a local directory with config.json or a built-in shape: " + ", ".join(BUILTIN_SHAPES)
        ) from None
    return arch_of(config, model, {})  # a hub id's processor settings are not read: the family's defaults


def arch_of(config: dict, name: str, processor: dict) -> Arch:
    """The shapes of a config: a text model's as it is; a vision-language model's (a ``vision_config``, as
    shardtune.model.loading.is_vision_model tells one) with its defaults filled in, its tower and image tokens."""
    if "vision_config" not in config:
        return Arch.from_config(config, name)
    config = full_config(config)
    return replace(Arch.from_config(config, name), vision=vision_shape(config, processor, name))


# -- what is trained ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    """The trainable part: everything (method ""), or a PEFT adapter."""

    method: str = ""  # "", lora, llama_adapter, prefix
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_dropout: float = 0.05
    adapter_len: int = 10
    adapter_layers: int = 30
    num_virtual_tokens: int = 30

    def trainable_params(self, arch: Arch) -> int:
        if not self.method:
            return arch.num_params
        if self.method == "lora":
            shapes = arch.linear_shapes()
            per_layer = sum(self.lora_r * (shapes[t][0] + shapes[t][1]) for t in self.lora_targets if t in shapes)
            return arch.num_layers * per_layer + self.score_head(arch)
        if self.method == "llama_adapter":
            layers = min(self.adapter_layers, arch.num_layers)
            return layers * (self.adapter_len * arch.hidden_size + 1) + self.score_head(arch)
        # prefix: a key and a value per layer and virtual token, at the key-value width (GQA)
        return self.num_virtual_tokens * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim + self.score_head(arch)

    @staticmethod
    def score_head(arch: Arch) -> int:
        """A score head trains in full with any adapter (peft's SEQ_CLS modules_to_save: a trainable copy)."""
        return arch.score_outputs * arch.hidden_size
