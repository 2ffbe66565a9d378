"""The entries of a dataset mixture (``data.trl_dataset.dataset_mixture``): TRL's ``datasets:`` list of a recipe
(its DatasetConfig mappings) or ``--dataset_mixture``'s text, normalised into one form (what config.yaml holds) and
checked. How the rows are drawn from them: shardtune.data.mixture; docs/data-formats.md#mixtures.

The text form is comma-separated ``path[@split][:weight]`` (``data/a.jsonl:0.7,data/b.jsonl:0.3``,
``trl-lib/tldr@validation:2``). An entry without a weight weighs 1 when another has one; a mixture whose entries
have none (nor TRL's ``fraction``) is every row of every source, as TRL concatenates them.
"""

from __future__ import annotations

from typing import Any

from shardtune.config.setting import ConfigError

MIXTURE_KEY = "data.trl_dataset.dataset_mixture"
# TRL's DatasetConfig (trl.scripts.utils, 1.16) with its defaults, then shardtune's weight
ENTRY_DEFAULTS: dict[str, Any] = {
    "path": "",
    "name": None,
    "data_dir": None,
    "data_files": None,
    "split": "train",
    "columns": None,
    "fraction": None,
    "weight": None,
}
TEXT_FORM = "path[@split][:weight], comma-separated (e.g. data/a.jsonl:0.7,data/b.jsonl:0.3)"


def mixture_entries(flag: str, value: Any) -> list[dict[str, Any]]:
    """The normalised entries of ``value`` (a list of mappings or of texts, or one comma-separated text); already
    normalised entries come back as they are. ``flag`` names the value in errors (``--dataset_mixture``,
    ``datasets:``)."""
    if isinstance(value, str):
        items: list[Any] = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"{flag} {value!r} is not a list of datasets: pass {TEXT_FORM}, or a YAML list of mappings")
    if not items:
        raise ConfigError(f"{flag} {value!r} names no dataset: pass {TEXT_FORM}, or drop it")
    entries = [_entry(f"{flag} entry {i}", item) for i, item in enumerate(items, start=1)]
    fractions = [e["fraction"] for e in entries if e["fraction"] is not None]
    if fractions and len(fractions) != len(entries):
        raise ConfigError(f"{flag}: fraction (TRL's) is set on some entries only: set it on every entry or on none")
    if fractions and any(e["weight"] is not None for e in entries):
        raise ConfigError(
            f"{flag}: both fraction (TRL's: no row repeated) and weight (rows repeated as needed) are set: use one"
        )
    return entries


def _entry(where: str, item: Any) -> dict[str, Any]:
    if isinstance(item, str):
        return {**ENTRY_DEFAULTS, **_from_text(where, item)}
    if not isinstance(item, dict):
        raise ConfigError(f"{where} {item!r} is neither a mapping nor a text: pass {TEXT_FORM}, or mappings")
    unknown = [key for key in item if key not in ENTRY_DEFAULTS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(ENTRY_DEFAULTS)}): fix or remove it")
    entry = {**ENTRY_DEFAULTS, **{k: v for k, v in item.items() if v is not None}}
    if not isinstance(entry["path"], str) or not entry["path"].strip():
        raise ConfigError(f"{where} has no path: give path (a local file or folder, or a hub dataset id)")
    for key in ("name", "data_dir", "split"):
        if entry[key] is not None and not isinstance(entry[key], str):
            raise ConfigError(f"{where} ({entry['path']}): {key} {entry[key]!r} is not a text: quote it")
    if isinstance(entry["columns"], str):
        entry["columns"] = [c.strip() for c in entry["columns"].split(",") if c.strip()]
    if entry["columns"] is not None and not all(isinstance(c, str) for c in entry["columns"]):
        raise ConfigError(f"{where} ({entry['path']}): columns {entry['columns']!r}: pass a list of column names")
    for key in ("weight", "fraction"):
        if entry[key] is not None:
            entry[key] = _positive(f"{where} ({entry['path']}): {key}", entry[key])
    return entry


def _from_text(where: str, text: str) -> dict[str, Any]:
    """``path[@split][:weight]``."""
    given, weight = text.strip(), None
    if ":" in given:
        given, _, number = given.rpartition(":")
        weight = _positive(f"{where} {text!r}: weight", number)
    path, at, split = given.rpartition("@")
    if not at:
        path, split = given, "train"
    if not path.strip() or not split.strip():
        raise ConfigError(f"{where} {text!r} has no path or split: write {TEXT_FORM}")
    return {"path": path.strip(), "split": split.strip(), "weight": weight}


def _positive(what: str, value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not number > 0 or number == float("inf"):
        raise ConfigError(f"{what} {value!r} is not a positive number: pass a share such as 0.7 or 3")
    return number
