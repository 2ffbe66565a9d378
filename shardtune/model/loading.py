"""Models and tokenizers: presets built from scratch (with a tokenizer trained here), loading, checks.

A preset is a LlamaConfig shape. ``preset:NAME`` model names are built once into the cache directory and
are then ordinary Hugging Face directories, so every later code path treats them like a downloaded model.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from shardtune.config.schema import ConfigError, TrainConfig
from shardtune.data.chat import PRESET_CHAT_TEMPLATE
from shardtune.data.synthetic import corpus_for_tokenizer
from shardtune.model.attention import attention_implementation
from shardtune.model.vision_presets import VISION_PRESETS, build_vision_preset
from shardtune.publishing.saving import already_unwrapped

PRESET_PREFIX = "preset:"
DEFAULT_PRESET = "demo"
PRESET_VERSION = "v2"  # bump when a preset's shape, init or tokenizer changes, so stale caches are not reused
TOKENIZER_VOCAB_SIZE = 1024
TOKENIZER_SEED = 0  # every preset shares one tokenizer, whatever the model's init seed

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"

_COMMON = dict(
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
)
PRESETS: dict[str, dict] = {
    "tiny": dict(
        _COMMON,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
    ),
    "demo": dict(
        _COMMON,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=704,
    ),
    # the demo's shape with a Llama-2-sized 32k vocabulary (~21M parameters): the output layer then costs what it
    # costs in real fine-tunes (bench/: the workload of issue 23's measurement)
    "demo-32k": dict(
        _COMMON,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=704,
        vocab_size=32000,
    ),
    "llama-1b-shape": dict(
        _COMMON,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama-8b-shape": dict(
        _COMMON,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
    ),
    # ~76M parameters, ~300 MB in fp32: big enough to see rank-0-only loading in host memory (bench/)
    "bench-300mb": dict(
        _COMMON,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
    ),
}
# The benchmark shapes are far too large for float32 on disk; they are built directly in bfloat16.
PRESET_BUILD_DTYPES: dict[str, torch.dtype] = {"llama-1b-shape": torch.bfloat16, "llama-8b-shape": torch.bfloat16}

_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def cache_dir() -> Path:
    return Path(os.environ.get("SHARDTUNE_CACHE") or Path.home() / ".cache" / "shardtune")


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE, seed: int = TOKENIZER_SEED) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the synthetic corpus; never adds bos/eos by itself (the data code does); with a
    small chat template (plain-text role headers, {% generation %} markers: data.chat.PRESET_CHAT_TEMPLATE)."""
    bpe = Tokenizer(BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus_for_tokenizer(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="right",
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
        chat_template=PRESET_CHAT_TEMPLATE,
    )


def init_model(preset: str, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Build a randomly initialised preset model (plus tokenizer) into ``out_dir``, atomically.

    Everything is written into a temporary sibling first and renamed onto ``out_dir``, so a reader never
    sees a half-written model.
    """
    out_dir = Path(out_dir).expanduser()
    _check_preset(preset, "preset")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"init_model: {out_dir} exists and is not empty: pick an empty or new directory")
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}"
    try:  # before building anything: the folder must be writable
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise ValueError(
            f"init_model: cannot write {out_dir} ({e.strerror}): pick a directory you can write to"
        ) from None
    tokenizer = train_tokenizer()
    if preset in VISION_PRESETS:  # model, processor and tokenizer with the family's image tokens
        build_vision_preset(preset, tokenizer, tmp, seed, dtype)
    else:
        model = _random_model(preset, tokenizer, seed, dtype)
        with already_unwrapped():
            model.save_pretrained(tmp)
        _save_tokenizer(tokenizer, tmp)
    os.replace(tmp, out_dir)
    return out_dir


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """save_pretrained, naming the class PreTrainedTokenizerFast (transformers 5 writes its internal
    TokenizersBackend name, which transformers 4 readers, such as older inference servers, cannot load)."""
    tokenizer.save_pretrained(out_dir)
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def _random_model(preset: str, tokenizer: PreTrainedTokenizerFast, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    special_ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    kwargs = {"vocab_size": len(tokenizer), **PRESETS[preset], **special_ids}
    config = LlamaConfig(**kwargs, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, token_id in special_ids.items():
        setattr(model.generation_config, name, token_id)
    return model


def resolve_model_name(model_name: str) -> str:
    """Map ``""`` and ``preset:NAME`` to the cached preset directory (built on first use); else unchanged."""
    if model_name and not model_name.startswith(PRESET_PREFIX):
        return model_name
    name = model_name.removeprefix(PRESET_PREFIX) or DEFAULT_PRESET
    _check_preset(name, "model_name")
    presets_dir = cache_dir() / "presets"
    path = presets_dir / f"{name}-{PRESET_VERSION}-{preset_fingerprint(name)}"
    presets_dir.mkdir(parents=True, exist_ok=True)
    with open(presets_dir / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then find it built
        if not (path / "config.json").is_file():
            init_model(name, path, seed=0, dtype=PRESET_BUILD_DTYPES.get(name, torch.float32))
    return str(path)


def preset_fingerprint(name: str) -> str:
    """What a preset is built from: its shape, seed and dtype, the code that builds it and its tokenizer (this module
    and the synthetic corpus), and the torch / transformers versions whose initialisers draw its weights. The cached
    directory is named by it, so a cache built by other code is never taken for this code's preset."""
    import hashlib

    import transformers

    from shardtune.data import synthetic
    from shardtune.model import vision_presets

    if name in VISION_PRESETS:  # built by vision_presets: its code is part of what the preset is
        spec = {"vision_preset": name, "seed": 0, "torch": torch.__version__, "transformers": transformers.__version__}
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
        for source in (__file__, synthetic.__file__, vision_presets.__file__):
            digest.update(Path(source).read_bytes())
        return digest.hexdigest()[:12]
    digest = hashlib.sha256(
        json.dumps(
            {
                "config": PRESETS[name],
                "seed": 0,
                "dtype": str(PRESET_BUILD_DTYPES.get(name, torch.float32)),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            sort_keys=True,
        ).encode()
    )
    for source in (__file__, synthetic.__file__):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:12]


def _check_preset(name: str, what: str) -> None:
    if name not in PRESETS and name not in VISION_PRESETS:
        raise ConfigError(
            f"--{what} {PRESET_PREFIX}{name}: unknown preset: choose one of "
            + ", ".join(PRESET_PREFIX + p for p in [*PRESETS, *VISION_PRESETS])
        )


def _looks_like_path(value: str) -> bool:
    first = value.split("/", 1)[0]
    return value.startswith(("/", "./", "../", "~")) or Path(value).exists() or (bool(first) and Path(first).is_dir())


# what a training run never reads from a model repository (other formats of the same weights)
REVISION_IGNORED_FILES = ("original/*", "*.pth", "*.pt", "*.gguf", "*.msgpack", "*.h5", "*.onnx", "*.ot")


def _hub_cache() -> str | None:
    """huggingface_hub reads its cache location once, at import: honour HF_HUB_CACHE / HF_HOME set later too."""
    return os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None
    )


def resolve_revision(model_name: str, revision: str) -> str:
    """--model_revision: the local snapshot folder of that revision of the hub id ``model_name`` (downloaded when
    online; from the Hugging Face cache when HF_HUB_OFFLINE is set), which every rank then reads. ``model_name`` as
    it is when no revision is given."""
    if not revision:
        return model_name
    if not model_name or model_name.startswith(PRESET_PREFIX) or _looks_like_path(model_name):
        raise ConfigError(
            f"--model_revision {revision} names a revision of a hub id, but --model_name "
            f"{model_name or '(empty: the demo preset)'} is local: drop --model_revision"
        )
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    try:
        return snapshot_download(
            model_name,
            revision=revision,
            local_files_only=offline,
            cache_dir=_hub_cache(),
            ignore_patterns=list(REVISION_IGNORED_FILES),
        )
    except Exception as e:  # any failure (network, auth, unknown revision, not cached) means the same fix
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        hint = "HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it" if offline else "offline?"
        raise ConfigError(
            f"--model_name {model_name} --model_revision {revision} could not be fetched ({reason}); "
            f"{hint}: download it first (hf download {model_name} --revision {revision} --local-dir "
            "DIR) and pass --model_name DIR"
        ) from None


def weights_identity(model_name: str, revision: str = "") -> str | None:
    """Names the weights ``model_name`` loads, cheaply, for caches of what a model computes: a local directory by its
    files (path, size and modification time of each; config.json by content), a hub id by the commit of its snapshot
    in the Hugging Face cache. None when that is unknown (a hub id not in the local cache)."""
    import hashlib

    path = Path(model_name).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        stats = [[str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
        config = path / "config.json"
        content = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else ""
        return json.dumps({"dir": str(path.resolve()), "files": stats, "config": content})
    if model_name.startswith(PRESET_PREFIX) or not _HUB_ID.match(model_name):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(model_name, "config.json", cache_dir=_hub_cache(), revision=revision or None)
    except Exception:  # a malformed id or cache: no identity, so nothing is cached
        return None
    return f"{model_name}@{Path(found).parent.name}" if isinstance(found, str) else None


def auto_config(name_or_path: str | Path, trust_remote_code: bool = False, **kwargs):
    """AutoConfig.from_pretrained of the user's model: its own code (auto_map) runs only with --trust_remote_code.
    Every loader of the user's model, config or tokenizer below takes the setting the same way."""
    return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)


def check_model_source(model_name: str, what: str = "model_name", trust_remote_code: bool = False) -> None:
    """Fail early, in one line, if ``model_name`` is neither a preset, a model directory nor a loadable hub id."""
    if not model_name or model_name.startswith(PRESET_PREFIX):
        _check_preset(model_name.removeprefix(PRESET_PREFIX) or DEFAULT_PRESET, what)
    elif _looks_like_path(model_name):
        _check_directory(model_name, what, trust_remote_code)
    elif _HUB_ID.match(model_name):
        _check_hub_id(model_name, what, trust_remote_code)
    else:
        raise ConfigError(
            f"--{what} {model_name!r} is neither a directory nor a hub id (org/name): "
            "pass a local model directory, a hub id or preset:NAME"
        )


def _check_directory(model_name: str, what: str, trust_remote_code: bool) -> None:
    path = Path(model_name).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"--{what} {model_name}: no such directory: pass a Hugging Face model directory "
            f"(with config.json), a hub id or {PRESET_PREFIX}NAME"
        )
    needed = ("tokenizer_config.json", "tokenizer.json") if what == "tokenizer_name" else ("config.json",)
    if not any((path / f).is_file() for f in needed):
        raise ConfigError(
            f"--{what} {model_name}: the directory has no {' or '.join(needed)}: pass the directory "
            "that save_pretrained wrote (or the snapshot folder of a download)"
        )
    if what != "tokenizer_name":
        _check_config_file(path / "config.json", what, trust_remote_code)


def _check_config_file(config_file: Path, what: str = "model_name", trust_remote_code: bool = False) -> None:
    """A config.json that is not JSON, or names a model_type transformers does not know: one line naming it. One
    whose architecture is the model's own code (auto_map, a model_type transformers does not ship) needs
    --trust_remote_code."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{config_file} is not valid JSON ({e}): restore it from the model's source") from None
    if not trust_remote_code and _needs_remote_code(config):
        raise ConfigError(
            f"--{what} {config_file.parent}: its architecture ({config.get('model_type')}) is the "
            "model's own Python code (auto_map in config.json), which shardtune runs only when asked: "
            "pass --trust_remote_code if you trust that code (it runs as you: docs/security.md), or "
            "use a model of an architecture transformers ships"
        )
    try:
        auto_config(config_file.parent, trust_remote_code)
    except (ValueError, KeyError, OSError, TypeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"{config_file} cannot be read as a model config ({reason}): fix its model_type, or "
            "update transformers if the architecture is newer than it"
        ) from None


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as it is now: huggingface_hub reads it once, at import; honour it even when set later."""
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")


def _needs_remote_code(config: dict) -> bool:
    from transformers import CONFIG_MAPPING

    return bool(config.get("auto_map")) and config.get("model_type") not in CONFIG_MAPPING


def _check_hub_id(model_name: str, what: str, trust_remote_code: bool = False) -> None:
    offline = _hub_offline()
    try:
        auto_config(model_name, trust_remote_code, local_files_only=offline)
    except Exception as e:  # any failure (network, auth, missing repo) means the same fix for the user
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        if "trust_remote_code" in reason and not trust_remote_code:
            raise ConfigError(
                f"--{what} {model_name}: its architecture is the model's own Python code, which "
                "shardtune runs only when asked: pass --trust_remote_code if you trust that code (it "
                "runs as you: docs/security.md), or use a model of an architecture transformers "
                "ships"
            ) from None
        hint = "HF_HUB_OFFLINE is set:" if offline else "offline?"
        raise ConfigError(
            f"--{what} {model_name!r} is not a local directory and could not be loaded from the "
            f"Hugging Face Hub ({reason}); {hint} download it first "
            f"(hf download {model_name} --local-dir DIR) or pass a local path"
        ) from None


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerFast:
    """AutoTokenizer, with a pad token (eos, else unk) when the model has none, as for Llama 3."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def check_tokenizer_fits(
    model_name: str, tokenizer: PreTrainedTokenizerFast, tokenizer_name: str, trust_remote_code: bool = False
) -> None:
    """A token id without a row in the model's embedding fails mid-step (IndexError on every rank): refuse it here.
    Typical cause: a tokenizer (class) that adds a pad or chat token, saved without resizing the model."""
    num_rows = auto_config(model_name, trust_remote_code).get_text_config().vocab_size
    if len(tokenizer) > num_rows:
        source = f"--tokenizer_name {tokenizer_name}" if tokenizer_name else f"the tokenizer of {model_name}"
        raise ConfigError(
            f"{source} has {len(tokenizer)} tokens, but the model's embedding has {num_rows} rows "
            f"(vocab_size in its config.json), so ids {num_rows} and up cannot be embedded: use the "
            "model's own tokenizer, or resize the embedding first (model.resize_token_embeddings("
            "len(tokenizer)), then save_pretrained both)"
        )


@dataclass(frozen=True)
class ModelHead:
    """A head a run's model is trained with (an objective's Registration.model_head): the transformers auto class,
    what its config sets, and peft's task type for its adapters."""

    auto_class: str
    config: dict
    task_type: str
    # weights the causal LM's checkpoint holds that this head does not use, and the head's own new ones (drawn from
    # the run's seed): expected when a causal LM is loaded with this head, so not reported as a mismatch
    unused_keys: tuple[str, ...] = ()
    new_keys: tuple[str, ...] = ()


CAUSAL_LM = "causal_lm"
IMAGE_TEXT = "image_text"  # a vision-language model's own head (shardtune.model.vision: its processor and data)
MODEL_HEADS = {
    CAUSAL_LM: ModelHead("AutoModelForCausalLM", {}, "CAUSAL_LM"),
    # a vision-language model (shardtune.model.vision): its own conditional-generation class, adapters on its text
    IMAGE_TEXT: ModelHead("AutoModelForImageTextToText", {}, "CAUSAL_LM"),
    # one scalar per sequence, read at its last non-pad token (transformers' sequence classification): reward models
    "score": ModelHead(
        "AutoModelForSequenceClassification", {"num_labels": 1}, "SEQ_CLS", (r"^lm_head\.",), (r"^score\.",)
    ),
}


def model_head(cfg: TrainConfig) -> str:
    """The head the run's objective trains (shardtune.config.objectives: Registration.model_head)."""
    from shardtune.config.objectives import registration

    head = registration(cfg.objective).model_head
    return IMAGE_TEXT if head == CAUSAL_LM and vision_run(cfg) else head


@functools.lru_cache(maxsize=16)
def is_vision_model(name_or_path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model's config has a vision tower (``vision_config``): then it loads as AutoModelForImageTextToText.
    An unreadable config is not one (the model checks say why elsewhere)."""
    try:
        config = auto_config(resolve_model_name(name_or_path), trust_remote_code)
    except Exception:  # noqa: BLE001 - the model checks report a model that cannot be read, in their words
        return False
    return getattr(config, "vision_config", None) is not None


def vision_run(cfg: TrainConfig) -> bool:
    return bool(cfg.model.name) and is_vision_model(cfg.model.name, cfg.model.trust_remote_code)


def auto_model_class(head: str = CAUSAL_LM):
    import transformers

    return getattr(transformers, MODEL_HEADS[head].auto_class)


def training_model_config(cfg: TrainConfig):
    """The config the model is trained with: its config.json, plus --rope_scaling and what the objective's head sets
    (one label for a score head). The one place where training flags change a model's config: every path that
    builds the model to train (full weights, 4-bit, the meta device of rank-0 loading) builds from it, and
    checkpoints record it (export rebuilds the same model)."""
    from shardtune.model.longseq import rope_config_overrides

    config = auto_config(cfg.model.name, cfg.model.trust_remote_code)
    for key, value in rope_config_overrides(cfg, config).items():
        setattr(config, key, value)
    return with_head(config, model_head(cfg))


def own_head(config, head: str) -> str:
    """The head a model of ``config`` is built with when a causal LM is asked for: a vision-language model's own
    class (it is a causal LM over its text, with a vision tower beside)."""
    return IMAGE_TEXT if head == CAUSAL_LM and getattr(config, "vision_config", None) is not None else head


def with_head(config, head: str):
    """``config`` with what ``head`` sets in it (a score head: one label)."""
    for key, value in MODEL_HEADS[head].config.items():
        setattr(config, key, value)
    return config


def name_pad_token(model_or_config, head: str, tokenizer) -> None:
    """A score head reads each sequence at its last non-pad token (transformers' sequence classification finds it by
    ``config.pad_token_id``): the config names the tokenizer's pad token, which pads the batches (as TRL's
    RewardTrainer sets it); it is written with the model, so a reader finds the same token."""
    if head != "score":
        return
    config = getattr(model_or_config, "config", model_or_config)
    config.get_text_config().pad_token_id = tokenizer.pad_token_id


@contextlib.contextmanager
def head_weights(head: str, seed: int | None) -> Iterator[None]:
    """While a causal LM's checkpoint is loaded with ``head``: the head's new weights are drawn from ``seed`` (the
    same on every rank and in every run of that seed, as TRL seeds before it loads a reward model), and the weights
    one head has and the other not are expected, not reported on every rank as a mismatch."""
    from transformers.modeling_layers import GenericForSequenceClassification

    spec = MODEL_HEADS[head]
    if not spec.new_keys and not spec.unused_keys:
        yield
        return
    saved = {
        name: getattr(GenericForSequenceClassification, name, None)
        for name in ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected")
    }
    GenericForSequenceClassification._keys_to_ignore_on_load_missing = [
        *(saved["_keys_to_ignore_on_load_missing"] or ()),
        *spec.new_keys,
    ]
    GenericForSequenceClassification._keys_to_ignore_on_load_unexpected = [
        *(saved["_keys_to_ignore_on_load_unexpected"] or ()),
        *spec.unused_keys,
    ]
    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            yield
    finally:
        for name, value in saved.items():
            setattr(GenericForSequenceClassification, name, value)


def load_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config=None,
    trust_remote_code: bool = False,
    head: str = CAUSAL_LM,
    seed: int | None = None,
) -> torch.nn.Module:
    """The model's weights from ``name_or_path``, built with ``config`` (default: its own config.json) and ``head``
    (MODEL_HEADS; a new head's weights drawn from ``seed``)."""
    config = with_head(config or auto_config(name_or_path, trust_remote_code), head)
    head = own_head(config, head)
    with head_weights(head, seed):
        model = auto_model_class(head).from_pretrained(
            name_or_path,
            config=config,
            dtype=dtype,
            attn_implementation=attention_implementation(config),
            trust_remote_code=trust_remote_code,
        )
    return model.to(device)


def build_model_on_meta(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    config=None,
    trust_remote_code: bool = False,
    head: str = CAUSAL_LM,
) -> torch.nn.Module:
    """The model's structure without memory, for sharding first and loading weights (on rank 0) afterwards."""
    config = with_head(config or auto_config(name_or_path, trust_remote_code), head)
    head = own_head(config, head)
    with torch.device("meta"):
        return auto_model_class(head).from_config(
            config,
            dtype=dtype,
            attn_implementation=attention_implementation(config),
            trust_remote_code=trust_remote_code,
        )


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; tied weights count once; a quantised weight counts its logical shape,
    not its packed storage (bitsandbytes packs two 4-bit values per byte, or into bf16 storage under FSDP)."""
    params = list(model.parameters())
    return sum(logical_numel(p) for p in params), sum(logical_numel(p) for p in params if p.requires_grad)


def logical_numel(param: torch.Tensor) -> int:
    quant_state = getattr(param, "quant_state", None)
    shape = getattr(quant_state, "shape", None)
    return math.prod(shape) if shape is not None else param.numel()
