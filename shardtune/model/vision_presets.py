"""Tiny random vision-language presets: one per model family, built from configs (no download), with a processor.

Each preset is written as a directory that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load offline: the
model (fp32, seeded), the project's own tokenizer plus the family's image tokens, the family's image processor (its
PIL backend: torchvision is not a dependency) and a chat template that renders ``{"type": "image"}`` blocks the way
the family's processor expects and marks assistant turns with ``{% generation %}`` (TRL's assistant_only_loss).

The text model is the ``tiny`` preset's shape; the vision towers are as small as the family allows, so the images
are 32x32 (mllama: one 16x16 tile) and each gives a handful of image tokens. This module takes the tokenizer from
its caller (shardtune.model.loading) rather than importing it, so the two never import each other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForImageTextToText, PreTrainedTokenizerFast

TEXT_SHAPE = dict(  # the tiny preset's text shape (shardtune.model.loading.PRESETS["tiny"])
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=176,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)
IMAGE_SIZE = 32


def vision_chat_template(image_text: str, prefix: str = "") -> str:
    """The presets' chat template (plain-text role headers, as the text presets') with ``image_text`` for each image
    block; string contents render as they are. Assistant text and its eos sit inside ``{% generation %}``."""
    image = "{{ '" + image_text.replace("\n", "\\n") + "' }}"
    return (
        "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- elif content -%}"
        "{%- for block in content -%}{%- if block['type'] == 'image' -%}" + image + ""
        "{%- elif block['type'] == 'text' -%}{{ block['text'] }}{%- endif -%}{%- endfor -%}"
        "{%- endif -%}{%- endmacro -%}" + prefix + "{%- for message in messages -%}"
        "{{ '<|' + message['role'] + '|>\\n' }}"
        "{%- if message['role'] == 'assistant' -%}"
        "{% generation %}{{ render(message['content']) }}{{ eos_token }}{% endgeneration %}"
        "{%- else -%}{{ render(message['content']) }}{%- endif -%}"
        "{{ '\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif -%}"
    )


@dataclass(frozen=True)
class VisionPreset:
    """A family's tiny preset: the special tokens it adds to the tokenizer, how to build its config from that
    tokenizer (the ids of the added tokens go into the config), and how to write its processor beside the model."""

    family: str
    image_tokens: tuple[str, ...]
    build_config: Callable[[PreTrainedTokenizerFast], object]
    write_processor: Callable[[PreTrainedTokenizerFast, Path], None]
    # weights the family initialises to zero that would cut the image off a fresh model: drawn here instead
    open_image_path: Callable[[torch.nn.Module], None] | None = None


def _text_ids(tokenizer: PreTrainedTokenizerFast) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def _llava_config(tokenizer: PreTrainedTokenizerFast):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(**TEXT_SHAPE, **_text_ids(tokenizer), rope_theta=500000.0, attention_bias=False, mlp_bias=False)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=8,
        projection_dim=32,
    )
    # the last layer's patch features, CLS included ("full"), so every layer of the tower gets a gradient
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=(IMAGE_SIZE // 8) ** 2 + 1,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )


def _llava_processor(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    images = CLIPImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,
        chat_template=_with_template(tokenizer, vision_chat_template("<image>")),
    ).save_pretrained(out_dir)


QWEN2VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _qwen2vl_config(tokenizer: PreTrainedTokenizerFast):
    from transformers import Qwen2VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN2VL_TOKENS}
    head_dim = TEXT_SHAPE["hidden_size"] // TEXT_SHAPE["num_attention_heads"]
    text = dict(
        TEXT_SHAPE,
        **_text_ids(tokenizer),
        # M-RoPE: the rotary half of each head split over (time, height, width) positions
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 3, 3]},
    )
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    vision = dict(depth=2, embed_dim=32, hidden_size=TEXT_SHAPE["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=8)
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _qwen2vl_processor(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """The files Qwen2VLProcessor reads, written one by one: transformers builds that processor only with a video
    processor, which needs torchvision (transformers#48558), so the processor itself cannot be made here."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # every image is resized to 32x32 pixels: 4x4 patches of 8, merged 2x2 into 4 image tokens
    pixels = IMAGE_SIZE * IMAGE_SIZE
    Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=8, merge_size=2).save_pretrained(out_dir)
    template = _with_template(tokenizer, vision_chat_template("<|vision_start|><|image_pad|><|vision_end|>"))
    tokenizer.save_pretrained(out_dir)
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(template)


MLLAMA_TILE = 16


def _mllama_config(tokenizer: PreTrainedTokenizerFast):
    from transformers import MllamaConfig

    # three text layers, the middle one cross-attention (Llama 3.2 Vision interleaves them among self-attention)
    text = dict(TEXT_SHAPE, **_text_ids(tokenizer), num_hidden_layers=3, cross_attention_layers=[1])
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=2,
        image_size=MLLAMA_TILE,
        patch_size=8,
        max_num_tiles=2,
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
        intermediate_layers_indices=[0],
        vision_output_dim=64,  # hidden_size x (1 + number of intermediate layers)
    )
    return MllamaConfig(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("<|image|>")
    )


def _mllama_processor(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    from transformers import MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    images = MllamaImageProcessorPil(size={"height": MLLAMA_TILE, "width": MLLAMA_TILE}, max_image_tiles=2)
    # Llama 3.2's templates start with bos (the processor adds it to a text without one)
    template = vision_chat_template("<|image|>", prefix="{{ bos_token }}")
    MllamaProcessor(images, tokenizer, chat_template=_with_template(tokenizer, template)).save_pretrained(out_dir)


IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")


def _idefics3_config(tokenizer: PreTrainedTokenizerFast):
    from transformers import Idefics3Config

    text = dict(TEXT_SHAPE, **_text_ids(tokenizer), model_type="llama")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,  # 4x4 patches shuffled into 2x2: 4 image tokens
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )


def _idefics3_processor(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}
    )
    template = _with_template(tokenizer, vision_chat_template("<image>"))
    Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=template).save_pretrained(out_dir)


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def _gemma3_config(tokenizer: PreTrainedTokenizerFast):
    from transformers import Gemma3Config

    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in GEMMA3_TOKENS.items()}
    shape = {k: v for k, v in TEXT_SHAPE.items() if k != "hidden_act"}
    text = dict(shape, **_text_ids(tokenizer), head_dim=16, query_pre_attn_scalar=16, sliding_window=512)
    text["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=8,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,  # 4x4 patches average-pooled to 2x2
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        tie_word_embeddings=False,
    )


def _gemma3_processor(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)
    template = _with_template(tokenizer, vision_chat_template(GEMMA3_TOKENS["boi_token"]))
    Gemma3Processor(images, tokenizer, image_seq_length=4, chat_template=template).save_pretrained(out_dir)


def _open_mllama_gates(model: torch.nn.Module) -> None:
    """Mllama initialises its tanh gates (cross-attention layers, tile and position embeddings, the global vision
    layers) to zero, so a fresh model ignores the image and its tower gets no gradient; trained checkpoints have
    them open. Each gate is drawn in [0.5, 1) from the build's seeded generator, so images matter as they do there."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if re.search(r"(\.gate|gate_attn|gate_ffn|_gate)$", name):
                param.copy_(0.5 + 0.5 * torch.rand(param.shape, dtype=param.dtype))


def _draw_gemma3_projection(model: torch.nn.Module) -> None:
    """Gemma 3 initialises its image projection to zeros (a fresh model sees no image, its tower gets no gradient);
    drawn like its other linear weights instead (normal, the config's initializer_range)."""
    projection = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        projection.normal_(0.0, model.config.initializer_range)


def _with_template(tokenizer: PreTrainedTokenizerFast, template: str) -> str:
    """The tokenizer renders what the processor renders (a text-only reader of the directory gets the same turns)."""
    tokenizer.chat_template = template
    return template


VISION_PRESETS: dict[str, VisionPreset] = {
    "vlm-llava-tiny": VisionPreset("llava", ("<image>",), _llava_config, _llava_processor),
    "vlm-qwen2vl-tiny": VisionPreset("qwen2_vl", QWEN2VL_TOKENS, _qwen2vl_config, _qwen2vl_processor),
    "vlm-mllama-tiny": VisionPreset("mllama", ("<|image|>",), _mllama_config, _mllama_processor, _open_mllama_gates),
    "vlm-idefics3-tiny": VisionPreset("idefics3", IDEFICS3_TOKENS, _idefics3_config, _idefics3_processor),
    "vlm-gemma3-tiny": VisionPreset(
        "gemma3", tuple(GEMMA3_TOKENS.values()), _gemma3_config, _gemma3_processor, _draw_gemma3_projection
    ),
}


def build_vision_preset(
    name: str, tokenizer: PreTrainedTokenizerFast, out_dir: Path, seed: int, dtype: torch.dtype = torch.float32
) -> None:
    """Write preset ``name`` (model, processor with ``tokenizer`` plus the family's image tokens) into ``out_dir``,
    its weights drawn from ``seed`` (the same seed gives the same bytes)."""
    from shardtune.publishing.saving import already_unwrapped

    preset = VISION_PRESETS[name]
    tokenizer.add_special_tokens({"additional_special_tokens": list(preset.image_tokens)})
    if preset.family == "gemma3":  # Gemma3Processor reads these names off the tokenizer: set through a reload
        tokenizer.save_pretrained(out_dir)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir, extra_special_tokens=GEMMA3_TOKENS)
    config = preset.build_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa")
        if preset.open_image_path is not None:
            preset.open_image_path(model)
    text = config.get_text_config()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(text, key))
    with already_unwrapped():
        model.save_pretrained(out_dir)
    preset.write_processor(tokenizer, out_dir)
