"""The image side of a vision-language model, for the plan: its vision tower and projector (parameters, counted
exactly from config.json per family), the tokens each image adds to the text sequence, and the positions the tower
computes per image (what its activations scale with). Read from the model's config and its processor's settings
(preprocessor_config.json, processor_config.json beside it), never from weights.

Families: LLaVA (CLIP or SigLIP tower, two-layer projector), Qwen2-VL (its own tower, a patch merger), Llama 3.2
Vision (mllama: tiled tower with global layers; cross-attention layers in the text model), Idefics3 / SmolVLM
(SigLIP, pixel-shuffle connector), Gemma 3 (SigLIP, pooled soft tokens). Another family is refused in one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from shardtune.config.schema import ConfigError

FAMILIES = ("llava", "qwen2_vl", "mllama", "idefics3", "gemma3")
# Qwen2-VL's image processor when its folder names no max_pixels (transformers' default)
QWEN2VL_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class VisionShape:
    """What a plan needs of a model's image side. ``positions_per_image``: the tower's sequence per image, all
    tiles / sub-images together (CLS and padding included); ``image_tokens``: the tokens one image puts into the text
    sequence; ``cross_tokens_per_image``: the image features the text's cross-attention layers attend to (mllama)."""

    family: str
    tower_params: int
    projector_params: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    positions_per_image: int
    image_tokens: int
    cross_tokens_per_image: int = 0
    # the image tokens follow the image's resolution (Qwen2-VL): --image_tokens may set them
    dynamic: bool = False
    # the tower's positions per image token (Qwen2-VL: merge size squared)
    positions_per_token: int = 1
    source: str = ""  # how image_tokens was found, for the plan's line
    pixels_per_position: int = 0  # pixel values per patch (channels x patch^2, x frames for Qwen2-VL)

    @property
    def num_params(self) -> int:
        return self.tower_params + self.projector_params

    def with_image_tokens(self, tokens: int) -> VisionShape:
        """Images of ``tokens`` text tokens each (a dynamic-resolution family); the tower's positions follow."""
        from dataclasses import replace

        return replace(
            self,
            image_tokens=tokens,
            positions_per_image=tokens * self.positions_per_token,
            source="--image_tokens",
        )


def vit_layer_params(d: int, f: int, attention_bias: bool = True) -> int:
    """A pre-norm ViT encoder layer: q, k, v, out (d x d, biases or not), fc1 / fc2 with biases, two LayerNorms."""
    return 4 * d * d + (4 * d if attention_bias else 0) + 2 * d * f + f + d + 4 * d


def vit_layer_activation_bytes(v: VisionShape, compute_bytes: int) -> float:
    """Bytes one tower layer saves for backward per position, counted as the text layer's are
    (shardtune.planner.estimate.layer_activation_bytes) on a pre-norm ViT layer: two LayerNorms (fp32 input and
    the normalised output, fp32 mean / rstd), attention (q, k, v, head-major copies, output and log-sum-exp, the
    out projection's input), the MLP (fc1's output and the activation's output)."""
    c, d, f = compute_bytes, v.hidden_size, v.intermediate_size
    return 2 * (4 + c) * d + 16 + 8 * c * d + 4 * v.num_heads + 2 * c * f


def vision_shape(config: dict, processor: dict, name: str = "") -> VisionShape:
    """The image side of ``config`` (a full config dict: transformers' defaults filled in) with ``processor``'s
    settings (the image processor's and the processor's saved settings, {} when none)."""
    family = config.get("model_type", "")
    readers = {
        "llava": _llava,
        "qwen2_vl": _qwen2vl,
        "mllama": _mllama,
        "idefics3": _idefics3,
        "smolvlm": _idefics3,
        "gemma3": _gemma3,
    }
    if family not in readers:
        raise ConfigError(
            f"--model_name {name or family}: a vision-language model of type {family!r}, whose image side the "
            f"planner does not count (it counts {', '.join(FAMILIES)}): plan its text model alone by passing a "
            "folder with its text_config as config.json"
        )
    return readers[family](config, processor)


def _pixels(vision: dict) -> int:
    return vision.get("num_channels", 3) * vision["patch_size"] ** 2


def _tower_dims(vision: dict) -> dict:
    return dict(
        hidden_size=vision["hidden_size"],
        num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"],
        intermediate_size=vision["intermediate_size"],
    )


def _siglip_tower(vision: dict) -> int:
    """SigLIP's vision model (Gemma 3, Idefics3, LLaVA variants): patch convolution with bias, one position per patch,
    the layers, the final LayerNorm, and the attention-pooling head when used."""
    d, f, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    patches = (vision["image_size"] // p) ** 2
    embeddings = d * vision.get("num_channels", 3) * p * p + d + patches * d
    head = 0
    if vision.get("vision_use_head", False):  # probe, multi-head attention (in and out projections), LayerNorm, MLP
        head = d + 4 * d * d + 4 * d + 2 * d + 2 * d * f + f + d
    return embeddings + vision["num_hidden_layers"] * vit_layer_params(d, f) + 2 * d + head


def _clip_tower(vision: dict) -> int:
    """CLIP's vision model: class embedding, patch convolution without bias, positions for the patches and CLS, a
    LayerNorm before and after the layers."""
    d, f, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    positions = (vision["image_size"] // p) ** 2 + 1
    embeddings = d + d * vision.get("num_channels", 3) * p * p + positions * d
    return embeddings + 2 * d + vision["num_hidden_layers"] * vit_layer_params(d, f) + 2 * d


def _llava(config: dict, processor: dict) -> VisionShape:
    vision, text = config["vision_config"], config["text_config"]
    if vision.get("model_type") == "siglip_vision_model":
        tower, cls = _siglip_tower(vision), 0
    elif vision.get("model_type", "clip_vision_model") == "clip_vision_model":
        tower, cls = _clip_tower(vision), 1
    else:
        raise ConfigError(f"llava with a {vision.get('model_type')} tower: the planner counts CLIP and SigLIP towers")
    layers = config.get("vision_feature_layer", -2)
    features = vision["hidden_size"] * (len(layers) if isinstance(layers, list) else 1)
    bias = config.get("multimodal_projector_bias", True)
    h = text["hidden_size"]
    projector = features * h + h * h + (2 * h if bias else 0)
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    if config.get("image_seq_length"):
        tokens, source = config["image_seq_length"], "image_seq_length"
    else:
        full = config.get("vision_feature_select_strategy", "default") == "full"
        tokens, source = patches + (cls if full else 0), "(image_size / patch_size)^2"
    return VisionShape(
        "llava",
        tower,
        projector,
        **_tower_dims(vision),
        positions_per_image=patches + cls,
        image_tokens=tokens,
        source=source,
        pixels_per_position=_pixels(vision),
    )


def _qwen2vl(config: dict, processor: dict) -> VisionShape:
    vision = config["vision_config"]
    e, p, m = vision["embed_dim"], vision["patch_size"], vision["spatial_merge_size"]
    f = int(e * vision["mlp_ratio"])
    patch = e * vision.get("in_channels", vision.get("in_chans", 3)) * vision["temporal_patch_size"] * p * p
    merged = e * m * m
    merger = 2 * e + merged * merged + merged + merged * vision["hidden_size"] + vision["hidden_size"]
    tower = patch + vision["depth"] * vit_layer_params(e, f)
    size = processor.get("size") or {}
    max_pixels = processor.get("max_pixels") or size.get("longest_edge") or QWEN2VL_MAX_PIXELS
    tokens = max(1, max_pixels // (p * m) ** 2)
    return VisionShape(
        "qwen2_vl",
        tower,
        merger,
        hidden_size=e,
        num_layers=vision["depth"],
        num_heads=vision["num_heads"],
        intermediate_size=f,
        positions_per_image=tokens * m * m,
        image_tokens=tokens,
        dynamic=True,
        positions_per_token=m * m,
        source=f"max_pixels {max_pixels:,}",
        pixels_per_position=patch // e,
    )


def _mllama(config: dict, processor: dict) -> VisionShape:
    """Tiles of the image through the local layers, then all tiles through the global (gated) layers; the
    projector maps the final and intermediate layers' features to the text's width for the cross-attention."""
    vision, text = config["vision_config"], config["text_config"]
    d, f, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    positions = (vision["image_size"] // p) ** 2 + 1  # CLS
    tiles = vision["max_num_tiles"]
    ratios = len(vision["supported_aspect_ratios"]) + 1
    embeddings = d + d * vision.get("num_channels", 3) * p * p
    embeddings += 1 + positions * d + ratios * tiles * positions * d  # gated position and tile-position embeddings
    embeddings += 2 * (1 + ratios * tiles * d)  # pre- and post-tile embeddings, gated
    layer = vit_layer_params(d, f, attention_bias=False)
    global_layers = vision["num_global_layers"]
    tower = embeddings + 4 * d + vision["num_hidden_layers"] * layer + global_layers * (layer + 2)
    h = text["hidden_size"]
    projector = vision["vision_output_dim"] * h + h
    tiles = min(tiles, processor.get("max_image_tiles") or tiles)
    padded = math.ceil(positions / 8) * 8  # the tower pads each tile's sequence to a multiple of 8
    return VisionShape(
        "mllama",
        tower,
        projector,
        hidden_size=d,
        num_layers=vision["num_hidden_layers"] + global_layers,
        num_heads=vision["attention_heads"],
        intermediate_size=f,
        positions_per_image=tiles * padded,
        image_tokens=1,
        cross_tokens_per_image=tiles * positions,
        source=f"<|image|>; {tiles} tiles of {positions} positions for the cross-attention",
        pixels_per_position=_pixels(vision),
    )


def _idefics3(config: dict, processor: dict) -> VisionShape:
    """SigLIP over each sub-image (the image split into tiles of max_image_size, plus the whole image, when the
    processor splits), a pixel shuffle of scale_factor^2 patches into one token, one linear projection."""
    vision, text = config["vision_config"], config["text_config"]
    scale = config.get("scale_factor", 2)
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    seq = patches // (scale * scale)
    projector = vision["hidden_size"] * scale * scale * text["hidden_size"]
    sub_images = 1
    if processor.get("do_image_splitting", True):
        longest = (processor.get("size") or {}).get("longest_edge", 4 * vision["image_size"])
        tile = (processor.get("max_image_size") or {}).get("longest_edge", vision["image_size"])
        per_side = math.ceil(longest / tile)
        sub_images = per_side * per_side + (1 if per_side > 1 else 0)
    return VisionShape(
        config.get("model_type", "idefics3"),
        _siglip_tower(vision),
        projector,
        **_tower_dims(vision),
        positions_per_image=sub_images * patches,
        image_tokens=sub_images * (seq + 2) + 1,  # each sub-image's tokens, two markers each, one closing
        source=f"{sub_images} sub-image(s) of {seq} tokens",
        pixels_per_position=_pixels(vision),
    )


def _gemma3(config: dict, processor: dict) -> VisionShape:
    vision, text = config["vision_config"], config["text_config"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    tokens = config.get("mm_tokens_per_image", 256)
    projector = vision["hidden_size"] * text["hidden_size"] + vision["hidden_size"]  # projection, soft-token norm
    return VisionShape(
        "gemma3",
        _siglip_tower(vision),
        projector,
        **_tower_dims(vision),
        positions_per_image=patches,
        image_tokens=tokens + 2,  # begin- and end-of-image around the soft tokens
        source=f"mm_tokens_per_image {tokens}",
        pixels_per_position=_pixels(vision),
    )


# -- reading a folder, a preset ------------------------------------------------------------------------------------


def full_config(config: dict) -> dict:
    """``config`` with transformers' defaults filled in (a saved config.json omits its defaults): through its own
    config class, so the counts read the values the model is built with."""
    from transformers import AutoConfig

    values = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(config.get("model_type", ""), **values).to_dict()
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"model_type {config.get('model_type')!r}: transformers cannot read this config ({e}): pass a folder "
            "whose config.json transformers reads"
        ) from None


def processor_settings(folder: Path) -> dict:
    """The saved settings of the processor beside a model (image processor's and processor's), {} when none."""
    settings: dict = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = folder / name
        if path.is_file():
            saved = json.loads(path.read_text())
            settings.update(saved.get("image_processor", {}))
            settings.update({k: v for k, v in saved.items() if k != "image_processor"})
    return settings


def write_preset_config(name: str, into: Path) -> None:
    """A vision preset's config.json and processor files in ``into`` (no weights): its tokenizer with the family's
    image tokens, the config built from it, the processor written as the preset writes it."""
    from transformers import PreTrainedTokenizerFast

    from shardtune.model.loading import train_tokenizer
    from shardtune.model.vision_presets import GEMMA3_TOKENS, VISION_PRESETS

    preset = VISION_PRESETS[name]
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(preset.image_tokens)})
    if preset.family == "gemma3":  # its processor reads these names off the tokenizer (as build_vision_preset does)
        tokenizer.save_pretrained(into)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(into, extra_special_tokens=GEMMA3_TOKENS)
    config = preset.build_config(tokenizer)
    config.architectures = [_architecture(preset.family)]
    config.save_pretrained(into)
    preset.write_processor(tokenizer, into)


def _architecture(family: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[family]
