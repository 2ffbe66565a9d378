"""Corpora of any size (issue 34): how a run's host memory and its time to the first step grow with the corpus.

    python -m bench.data_scale [--streaming both|on|off] [--base_rows 1000] [--scales 1,10,100] [--stages 100]
    python -m bench.data_scale --rows text --base_rows 2500 --scales 1,10 --repeats 3 --batching padding

Writes JSONL corpora in TRL's conversational format (``{"messages": [user, assistant, ...]}``; ``--rows text``: its
language-modelling format, ``{"text": ...}`` documents of 1-4 paragraphs), synthetic dialogues or documents
of random words from a fixed vocabulary (seeded, lengths varied; each corpus a prefix of the next larger one), and
trains each for --max_steps 3 on 2 processes (``shardtune sft --dataset_name FILE --nproc_per_node 2``, the demo
model, packing, no evaluation: a single file has no test split) with streaming off (tokenised before launch into
the cache, memory-mapped by the ranks) and on (``--dataset_streaming true``: rows read as the steps need them).
Every run gets a fresh ``SHARDTUNE_CACHE`` and ``HF_DATASETS_CACHE``: it pays for the whole preparation of its
data, as a first run does.

While a run goes, the RssAnon (resident anonymous memory: /proc/PID/status) of the command's process (the launcher,
with torchrun's agent) and of all its descendants (the ranks, their data loader workers) is sampled every
--interval seconds, and their Pss_Anon (smaps_rollup: pages a forked worker shares with its rank counted once) every
--pss_interval; the peak of the sum is the run's host memory. The time to the first step is the first step row's
``startup_s`` in metrics.jsonl (the command's start to the moment step 1 begins), beside the CPU seconds all the
run's processes used until then; rank 0's phase line (``--debug``) says where it went. The corpus tokens are those
of the examples the run trains on (the cache entry's offsets; for a streamed-only run, tokenised here with
shardtune's own code). The slope, (peak at the largest scale - peak at the smallest) / (their difference in
tokens), in MiB per million tokens, is compared with the issue's target of 16; with ``--repeats N`` each corpus is
run N times, the slope is that of the mean peaks, and its range (the largest corpus's lowest peak against the
smallest's highest, and the reverse) is the run-to-run spread.

``--stages SCALE`` also runs the launcher's preparation of that corpus (not streamed) in a fresh process and
records its RssAnon around each stage (loading, rows, tokenising, cache write and read), then after gc, after
dropping the loaded dataset and after malloc_trim(0) (which part of what stays is free heap glibc kept);
``--tracemalloc`` adds the allocation sites holding the most when the tokenising returns (slow).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from bench.common import REPO, RESULTS, child_env, machine_info

TARGET_MIB_PER_M_TOKENS = 16.0
MIB = 2**20

# a fixed vocabulary of everyday words: the demo tokenizer (byte-level BPE trained on the synthetic dialogues) gives
# most of them one or two tokens
VOCABULARY = tuple(
    """
    the a an and or but so because if when then than there here this that these those it its we you they he she i me
    my your our their his her them us is are was were be been being have has had do does did will would can could
    should may might must shall not no yes all any some many much more most few less least each every other another
    same new old good great small big long short high low early late first last next best better right left open close
    time day week month year today tomorrow yesterday morning evening night noon hour minute moment weekend monday
    tuesday wednesday thursday friday saturday sunday meet meeting plan plans call message lunch dinner breakfast
    coffee tea cake pizza movie cinema park beach station train bus car bike office home house garden market shop
    store library museum concert party game match team work project report budget idea question answer problem reason
    help thanks sorry please okay sure great fine nice lovely perfect maybe probably really just still already again
    also too very quite almost about around after before during until since while with without for from into onto over
    under between through at on in by of to up down out off go going went come coming came see seen saw look looking
    want need like love think know tell say said ask asked bring brought take took make made get got give gave find
    found keep let put run walk talk read write play watch wait start stop finish leave stay change move try use
    """.split()
)


# -- corpora -----------------------------------------------------------------------------------------------------------
def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(VOCABULARY) for _ in range(words))
    return text[0].upper() + text[1:] + rng.choice((".", "?", "!", "."))


def _turn(rng: random.Random, lo: int, hi: int) -> str:
    """A turn of lo..hi words (log-uniform: most turns short, some long), in sentences of 4-16 words."""
    total = int(round(lo * (hi / lo) ** rng.random()))
    parts = []
    while total > 0:
        n = min(total, rng.randint(4, 16))
        parts.append(_sentence(rng, n))
        total -= n
    return " ".join(parts)


def dialogue(rng: random.Random) -> dict:
    """1-3 exchanges; user turns 8-200 words, assistant turns 4-80 (a row stays well under 1,024 tokens)."""
    messages = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        messages.append({"role": "user", "content": _turn(rng, 8, 200 // max(1, len(messages) // 2 + 1))})
        messages.append({"role": "assistant", "content": _turn(rng, 4, 80 // max(1, len(messages) // 2))})
    return {"messages": messages}


def document(rng: random.Random) -> dict:
    """A language-modelling row: 1-4 paragraphs of 20-400 words (about as many tokens as a dialogue row)."""
    paragraphs = [_turn(rng, 20, 400) for _ in range(rng.choice((1, 1, 2, 2, 3, 4)))]
    return {"text": "\n\n".join(paragraphs)}


ROWS = {"messages": dialogue, "text": document}


def write_corpora(folder: Path, base_rows: int, scales: list[int], seed: int = 0, rows: str = "messages") -> dict:
    """corpus-<scale>x.jsonl for each scale: the first base_rows x scale rows (``rows``: their format) of one seeded
    sequence (each corpus a prefix of the next), written in one pass."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {s: folder / f"corpus-{s}x.jsonl" for s in scales}
    wanted = {"base_rows": base_rows, "scales": scales, "seed": seed, **({"rows": rows} if rows != "messages" else {})}
    if all(p.is_file() for p in paths.values()) and (folder / "done.json").is_file():
        if json.loads((folder / "done.json").read_text()) == wanted:
            return paths
    rng, make = random.Random(seed), ROWS[rows]
    handles = {s: open(p, "w") for s, p in paths.items()}
    try:
        for i in range(base_rows * max(scales)):
            line = json.dumps(make(rng)) + "\n"
            for s, fh in handles.items():
                if i < base_rows * s:
                    fh.write(line)
    finally:
        for fh in handles.values():
            fh.close()
    (folder / "done.json").write_text(json.dumps(wanted))
    return paths


# -- memory sampling ---------------------------------------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(root: int) -> list[int]:
    children, out, todo = _children_map(), [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            out.append(child)
            todo.append(child)
    return out


def _field_kib(path: str, field: str) -> int:
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def rss_anon_kib(pid: int) -> int:
    """Resident anonymous pages mapped by the process, shared copy-on-write pages (a forked child's) included."""
    return _field_kib(f"/proc/{pid}/status", "RssAnon:")


def pss_anon_kib(pid: int) -> int:
    """Its proportional share of anonymous pages: a page shared by n processes counts 1/n in each, so the sum over
    processes is their anonymous memory, a forked data loader worker's pages counted once."""
    return _field_kib(f"/proc/{pid}/smaps_rollup", "Pss_Anon:")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process and of its children that have ended and were waited for."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class Sampler(threading.Thread):
    """Every ``interval`` s: the RssAnon and Pss_Anon of ``pid`` (the launcher) and their sums over its descendants
    (the ranks, their data loader workers), and when ``metrics`` first holds a step row (with the CPU seconds of all
    of them until then)."""

    def __init__(self, pid: int, metrics: Path, interval: float, pss_interval: float):
        super().__init__(daemon=True)
        self.pid, self.metrics, self.interval = pid, metrics, interval
        self.pss_interval, self.next_pss = pss_interval, 0.0
        self.start_time = time.monotonic()
        self.samples: list[tuple[float, int, int, int, int]] = []  # s since start; launcher, ranks KiB; Pss_Anon too
        self.first_step_logged_s: float | None = None
        self.cpu_s_to_first_step: float | None = None
        self.max_processes = 0
        self.stop = threading.Event()

    def run(self) -> None:
        pss = (0, 0)
        while not self.stop.is_set():
            now = time.monotonic() - self.start_time
            children = descendants(self.pid)
            launcher, ranks = rss_anon_kib(self.pid), sum(rss_anon_kib(p) for p in children)
            if now >= self.next_pss:  # smaps_rollup walks the page tables (~20 ms a GiB): not every sample
                pss = (pss_anon_kib(self.pid), sum(pss_anon_kib(p) for p in children))
                self.next_pss = now + self.pss_interval
            self.samples.append((now, launcher, ranks, *pss))
            self.max_processes = max(self.max_processes, 1 + len(children))
            if self.first_step_logged_s is None and self.metrics.is_file():
                with open(self.metrics) as fh:
                    if any('"loss"' in line for line in fh):
                        self.first_step_logged_s = now
                        self.cpu_s_to_first_step = cpu_seconds(self.pid) + sum(cpu_seconds(p) for p in children)
            self.stop.wait(self.interval)

    def summary(self) -> dict:
        peak = max(self.samples, key=lambda s: s[1] + s[2])
        pss_peak = max(self.samples, key=lambda s: s[3] + s[4])
        step = max(1, round(0.5 / self.interval))
        return {
            "peak_rss_anon_mib": (peak[1] + peak[2]) / 1024,
            "peak_at_s": peak[0],
            "peak_launcher_part_mib": peak[1] / 1024,
            "peak_ranks_part_mib": peak[2] / 1024,
            "peak_launcher_alone_mib": max(s[1] for s in self.samples) / 1024,
            "peak_ranks_alone_mib": max(s[2] for s in self.samples) / 1024,
            "peak_pss_anon_mib": (pss_peak[3] + pss_peak[4]) / 1024,
            "peak_pss_at_s": pss_peak[0],
            "peak_pss_launcher_part_mib": pss_peak[3] / 1024,
            "peak_pss_ranks_part_mib": pss_peak[4] / 1024,
            "max_processes": self.max_processes,
            "first_step_logged_s": self.first_step_logged_s,
            "cpu_s_to_first_step": self.cpu_s_to_first_step,
            "num_samples": len(self.samples),
            # the whole curve, every ~0.5 s: s, then launcher and ranks RssAnon, launcher and ranks Pss_Anon, MiB
            "timeline": [[round(s[0], 2), *(round(v / 1024, 1) for v in s[1:])] for s in self.samples[::step]],
        }


# -- one run -----------------------------------------------------------------------------------------------------------
def run_once(model: Path, corpus: Path, streaming: bool, work: Path, args) -> dict:
    tag = f"{corpus.stem}-{'stream' if streaming else 'cached'}"
    folder = work / "runs" / tag
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    out, cache, hf_cache = folder / "out", folder / "cache", folder / "hf-datasets"
    argv = [
        sys.executable,
        "-m",
        "shardtune",
        "sft",
        "--model_name",
        str(model),
        "--dataset_name",
        str(corpus),
        "--max_steps",
        str(args.max_steps),
        "--nproc_per_node",
        str(args.nproc),
        "--data.batching",
        args.batching,
        "--output_dir",
        str(out),
        "--save_plots",
        "false",
        "--output.save_model",
        "false",
        "--run.debug",
        "true",
        *(["--dataset_streaming", "true"] if streaming else []),
        *(["--data.sampling", args.sampling] if args.sampling else []),
    ]
    env = child_env(SHARDTUNE_CACHE=str(cache), HF_DATASETS_CACHE=str(hf_cache))
    log = open(folder / "log.txt", "w")
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid, out / "metrics.jsonl", args.interval, args.pss_interval)
    sampler.start()
    try:
        status = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = "timeout"
    wall = time.monotonic() - started
    sampler.stop.set()
    sampler.join()
    log.close()
    text = (folder / "log.txt").read_text()
    if status != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {status}\n{text[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next(r for r in rows if "loss" in r)
    result = {
        "corpus": corpus.name,
        "corpus_bytes": corpus.stat().st_size,
        "streaming": streaming,
        "wall_s": wall,
        "time_to_first_step_s": first.get("startup_s"),
        "phases": next((line.strip() for line in text.splitlines() if "start-up: first step at" in line), ""),
        "data_line": next((line.strip() for line in text.splitlines() if line.startswith("data (train)")), ""),
        # what each step trained on and rank 0's peak (its batches' padded lengths drive the ranks' activations)
        "steps": [
            {k: r.get(k) for k in ("step", "num_tokens", "label_tokens", "peak_memory_bytes")}
            for r in rows
            if "loss" in r
        ],
        **sampler.summary(),
    }
    entries = list((cache / "tokenized").glob("*/offsets.npy")) if (cache / "tokenized").is_dir() else []
    if entries:
        import numpy as np

        offsets = np.load(entries[0])
        result["tokens"] = int(offsets[-1])
        result["examples"] = len(offsets) - 1
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(hf_cache, ignore_errors=True)
    return result


def count_tokens(corpus: Path, model: Path) -> tuple[int, int]:
    """(tokens, examples) of the corpus as a run trains on it: shardtune's own tokenisation (TRL's formats), row by
    row through the streaming reader (nothing held)."""
    from shardtune.config.flags import config_from
    from shardtune.data.report import DataReport
    from shardtune.data.stream_rows import START
    from shardtune.data.streaming import StreamSource
    from shardtune.model.loading import load_tokenizer

    cfg = config_from(model_name=str(model))
    cfg.data.dataset = "trl_dataset"
    cfg.data.trl_dataset.dataset_name = str(corpus)
    cfg.data.streaming = True
    source = StreamSource(cfg, load_tokenizer(str(model)))
    tokens = examples = 0
    for example, _ in source.examples(START, DataReport(source="count")):
        tokens += len(example["input_ids"])
        examples += 1
    return tokens, examples


# -- the launcher's preparation, stage by stage ------------------------------------------------------------------------
# (module, function): wrapped where present, so that the RssAnon before and after each call is recorded
STAGES = (
    ("shardtune.data.trl_loading", "_load"),
    ("shardtune.data.trl_loading", "_dataset_rows"),
    ("shardtune.data.sources", "trl_examples"),  # before --dataset_num_proc: all rows tokenised into lists
    ("shardtune.data.sources", "trl_preparation"),  # since: the rows, and how a chunk of them is tokenised
    ("shardtune.data.cache", "_write"),
    ("shardtune.data.cache", "_write_examples"),  # since: chunks tokenised (in data.num_proc processes) and written
    ("shardtune.data.cache", "_read"),
    ("shardtune.data.cache", "load_examples_cached"),
    ("shardtune.training.objectives.sft.objective", "load_examples_cached"),
)
# where tracemalloc's snapshot is taken: when the examples are all held (before) / when the rows are (since)
TRACE_AT = {("trl_examples", "<-"), ("_write_examples", "->")}


class _Peaks(threading.Thread):
    """In the --stages child: the peaks, since the last ``take()``, of this process's RssAnon and of the sum with its
    descendants (the tokenising processes), and of the Pss_Anon sum (every 0.5 s)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.reset()

    def reset(self) -> None:
        self.own = self.total = self.pss = 0

    def run(self) -> None:
        pid, next_pss = os.getpid(), 0.0
        while not self.stop.is_set():
            children = descendants(pid)
            own = rss_anon_kib(pid)
            total = own + sum(rss_anon_kib(p) for p in children)
            pss = None
            if time.monotonic() >= next_pss:
                pss, next_pss = pss_anon_kib(pid) + sum(pss_anon_kib(p) for p in children), time.monotonic() + 0.5
            with self.lock:
                self.own, self.total = max(self.own, own), max(self.total, total)
                self.pss = max(self.pss, pss or 0)
            self.stop.wait(0.1)

    def take(self) -> tuple[int, int, int]:
        with self.lock:
            peaks = (self.own, self.total, self.pss)
            self.reset()
            return peaks


def stages_child(corpus: Path, model: Path, trace: bool, top: int) -> dict:
    """In a fresh process: shardtune.training.engine.checks.prepare (what the launcher runs before launch) on
    ``corpus``,
    not streamed; this process's RssAnon around each stage of it, and the peaks in between (its own, and with the
    tokenising processes it starts); then after gc, after dropping the loaded dataset (trl_loading._load's cache)
    and after glibc's malloc_trim(0) (what of the rest is free memory the heap kept). ``trace``: tracemalloc's
    allocation sites holding the most at TRACE_AT (slow: ~10x)."""
    import ctypes
    import gc
    import importlib
    import tracemalloc

    began = time.monotonic()
    events: list[dict] = []
    peaks = _Peaks()
    peaks.start()

    def record(what: str) -> None:
        own, total, pss = peaks.take()
        now = rss_anon_kib(os.getpid())
        events.append(
            {
                "at_s": round(time.monotonic() - began, 2),
                "rss_anon_mib": now / 1024,
                "peak_own_mib": max(own, now) / 1024,  # since the previous event
                "peak_with_children_mib": max(total, now) / 1024,
                "peak_pss_with_children_mib": pss / 1024 if pss else None,  # None: not sampled in between
                "what": what,
                **_arrow_pool(),
            }
        )

    from shardtune.config.flags import config_from
    from shardtune.training.engine.checks import prepare

    record("imports")
    sites: dict = {}

    def wrapped(module: str, name: str, real):
        def call(*args, **kwargs):
            if trace and (name, "->") in TRACE_AT:
                sites.update(allocation_sites(tracemalloc.take_snapshot(), top))
            record(f"-> {module}.{name}")
            result = real(*args, **kwargs)
            if trace and (name, "<-") in TRACE_AT:
                sites.update(allocation_sites(tracemalloc.take_snapshot(), top))
            record(f"<- {module}.{name}")
            return result

        return call

    loader = None
    for module, name in STAGES:
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            real = getattr(mod, name)
            loader = real if name == "_load" else loader
            setattr(mod, name, wrapped(module, name, real))
    cfg = config_from(model_name=str(model))
    cfg.data.dataset = "trl_dataset"
    cfg.data.trl_dataset.dataset_name = str(corpus)
    cfg.train.max_steps = 3
    if trace:
        tracemalloc.start(16)
    prepare(cfg, 2)
    if trace:
        tracemalloc.stop()
    record("prepare() returned")
    gc.collect()
    record("gc.collect()")
    if loader is not None and hasattr(loader, "cache_clear"):
        loader.cache_clear()
        gc.collect()
        record("the loaded dataset dropped (trl_loading._load.cache_clear())")
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        record("malloc_trim(0): free heap pages returned to the system")
    peaks.stop.set()
    return {"corpus": corpus.name, "events": events, "allocation_sites": sites}


def _arrow_pool() -> dict:
    """What pyarrow's memory pool holds (allocated, and the most it ever did; the pool's backend keeps freed pages
    for reuse, outside glibc's heap and tracemalloc's view), once pyarrow is loaded."""
    pa = sys.modules.get("pyarrow")
    if pa is None:
        return {}
    pool = pa.default_memory_pool()
    return {
        "arrow_pool": pool.backend_name,
        "arrow_mib": pool.bytes_allocated() / MIB,
        "arrow_max_mib": pool.max_memory() / MIB,
    }


def allocation_sites(snap, top: int) -> dict:
    """The allocation sites holding the most in ``snap``: by line, and by the innermost shardtune frame."""
    by_line = [
        {"mib": stat.size / MIB, "blocks": stat.count, "where": str(stat.traceback[-1])}
        for stat in snap.statistics("lineno")[:top]
    ]
    by_frame: dict[str, list[int]] = {}
    marker = f"{os.sep}shardtune{os.sep}"
    for stat in snap.statistics("traceback"):
        frames = list(stat.traceback)[::-1]  # innermost first
        frame = next((f for f in frames if marker in f.filename), frames[0])
        name = frame.filename
        if marker in name:
            name = "shardtune/" + name.rsplit(marker, 1)[1]
        agg = by_frame.setdefault(f"{name}:{frame.lineno}", [0, 0])
        agg[0] += stat.size
        agg[1] += stat.count
    by_shardtune = [
        {"mib": size / MIB, "blocks": count, "where": key}
        for key, (size, count) in sorted(by_frame.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    return {
        "total_mib": sum(s.size for s in snap.statistics("filename")) / MIB,
        "by_line": by_line,
        "by_shardtune_frame": by_shardtune,
    }


def measure_stages(corpus: Path, model: Path, work: Path, trace: bool, top: int) -> dict:
    folder = work / "stages"
    shutil.rmtree(folder, ignore_errors=True)
    argv = [
        sys.executable,
        "-m",
        "bench.data_scale",
        "--stages_of",
        str(corpus),
        "--model",
        str(model),
        "--top",
        str(top),
        *(["--tracemalloc"] if trace else []),
    ]
    env = child_env(SHARDTUNE_CACHE=str(folder / "cache"), HF_DATASETS_CACHE=str(folder / "hf-datasets"))
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    shutil.rmtree(folder, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- report ------------------------------------------------------------------------------------------------------------
def _ends(runs: list[dict], key: str) -> tuple[list[float], list[float], float] | None:
    """``key`` of the runs at the fewest and at the most tokens, and that difference in millions of tokens."""
    lo, hi = min(r["tokens"] for r in runs), max(r["tokens"] for r in runs)
    if lo == hi:
        return None
    return [r[key] for r in runs if r["tokens"] == lo], [r[key] for r in runs if r["tokens"] == hi], (hi - lo) / 1e6


def slope(runs: list[dict], key: str) -> float | None:
    """(``key`` at the most tokens - at the fewest) / their difference in millions of tokens: MiB per M tokens (the
    mean of the repeated runs at each end)."""
    ends = _ends(runs, key)
    if ends is None:
        return None
    lo, hi, millions = ends
    return (sum(hi) / len(hi) - sum(lo) / len(lo)) / millions


def slope_range(runs: list[dict], key: str) -> tuple[float, float] | None:
    """The slope's range over the repeated runs: the largest corpus's lowest peak against the smallest's highest,
    and its highest against their lowest (what the run-to-run spread alone allows)."""
    ends = _ends(runs, key)
    if ends is None:
        return None
    lo, hi, millions = ends
    return (min(hi) - max(lo)) / millions, (max(hi) - min(lo)) / millions


SLOPES = {
    "peak_rss_anon_mib": "peak RssAnon, launcher + descendants (the run's memory)",
    "peak_pss_anon_mib": "peak Pss_Anon, launcher + descendants (forked loader workers' shared pages once)",
    "peak_launcher_alone_mib": "the launcher's own peak RssAnon (its data preparation)",
    "peak_launcher_part_mib": "the launcher's RssAnon at the run's peak (while the ranks train)",
    "peak_ranks_alone_mib": "the descendants' peak RssAnon (ranks and their loader workers)",
}


def _verdict(value: float) -> str:
    if value <= TARGET_MIB_PER_M_TOKENS:
        return "within the target"
    return f"{value / TARGET_MIB_PER_M_TOKENS:.1f}x the target"


ROWS_DESCRIBED = {
    "messages": "synthetic conversational rows (`messages`: 1-3 user / assistant exchanges of random words from a "
    "fixed vocabulary, seeded)",
    "text": "synthetic language-modelling rows (`text`: documents of 1-4 paragraphs of random words from a fixed "
    "vocabulary, seeded)",
}


def _repeats_described(repeats: int) -> str:
    if repeats < 2:
        return ""
    return (
        f"; each run {repeats} times (a slope is that of the mean peaks; in brackets its range over the runs: the "
        "largest corpus's lowest peak against the smallest's highest, and the reverse)"
    )


def report(results: dict) -> list[str]:
    runs, st = results["runs"], results["settings"]
    load = results["machine"]["load_average_at_start"]
    lines = [
        f"Host memory and time to the first step against corpus size, measured {results['date']} on commit "
        f"{results['commit']} (`python -m bench.data_scale {' '.join(results['argv'])}`; "
        f"{results['machine']['cpu_count']} CPUs, {results['machine']['memory_gib']} GiB; load average "
        f"{load[0]:.1f} at the start, {results['load_average_at_end'][0]:.1f} at the end; total "
        f"{results['total_s'] / 60:.1f} min)",
        "",
        f"`shardtune sft --dataset_name corpus-Nx.jsonl --max_steps {st['max_steps']} --nproc_per_node {st['nproc']} "
        f"--data.batching {st['batching']}{' --data.sampling ' + st['sampling'] if st.get('sampling') else ''}` "
        "(+ `--dataset_streaming true`), the demo model (its tokenizer), fresh "
        f"`SHARDTUNE_CACHE` and `HF_DATASETS_CACHE` per run, no evaluation; corpora of {st['base_rows']:,} x N "
        f"{ROWS_DESCRIBED[st.get('rows', 'messages')]}"
        f"{_repeats_described(st.get('repeats', 1))}. "
        "Peak RssAnon: the peak over the run of the sum of RssAnon (/proc/PID/status) of the "
        "command's process (the launcher, with torchrun's agent) and all its descendants (the ranks and, streaming "
        "off, their data loader workers), sampled every "
        f"{st['interval']} s; Pss_Anon (/proc/PID/smaps_rollup) counts the pages a forked loader worker shares with "
        f"its rank once (sampled every {st['pss_interval']} s: reading it walks the page tables). Time to first "
        "step: metrics.jsonl's `startup_s` (the command's start to the start of step 1); "
        "CPU s: user + system seconds of all the run's processes until step 1 is logged (what the machine's load "
        "does not stretch).",
        "",
        "| streaming | corpus | rows | JSONL MiB | tokens | peak RssAnon MiB (launcher + descendants) | peak Pss_Anon "
        "MiB | launcher's own peak MiB | time to first step s | CPU s to first step | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        cpu = r.get("cpu_s_to_first_step")
        lines.append(
            f"| {'on' if r['streaming'] else 'off'} | {r['scale']}x | {r['rows']:,} | {r['corpus_bytes'] / MIB:.0f} | "
            f"{r['tokens']:,} | {r['peak_rss_anon_mib']:.0f} ({r['peak_launcher_part_mib']:.0f} + "
            f"{r['peak_ranks_part_mib']:.0f}) | {r['peak_pss_anon_mib']:.0f} | {r['peak_launcher_alone_mib']:.0f} | "
            f"{r['time_to_first_step_s']:.1f} | {'-' if cpu is None else f'{cpu:.0f}'} | {r['wall_s']:.1f} |"
        )
    lines += [
        "",
        "Slopes from the smallest to the largest corpus, MiB per million tokens (target of issue 34: the run's memory "
        f"grows by at most {TARGET_MIB_PER_M_TOKENS:g}):",
        "",
        "| streaming | " + " | ".join(SLOPES.values()) + " |",
        "|---|" + "---|" * len(SLOPES),
    ]
    ranges = results.get("slope_ranges_mib_per_m_tokens", {})
    for mode, values in results["slopes_mib_per_m_tokens"].items():
        spread = ranges.get(mode, {})
        cells = [
            f"{values[k]:.2f}"
            + (f" [{spread[k][0]:.1f} to {spread[k][1]:.1f}]" if spread.get(k) and spread[k][0] != spread[k][1] else "")
            + (f" ({_verdict(values[k])})" if k in ("peak_rss_anon_mib", "peak_pss_anon_mib") else "")
            for k in SLOPES
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where the time to the first step went (rank 0's `--debug` phase line; the launcher's preparation "
        "is in its first phase):",
        "",
    ]
    for r in runs:
        lines.append(f"- {'on' if r['streaming'] else 'off'}, {r['scale']}x: `{r['phases']}`")
    lines += _stages_report(results.get("stages"))
    if results.get("notes"):
        lines += ["", *results["notes"]]
    return lines


def _stages_report(stages: dict | None) -> list[str]:
    lines: list[str] = []
    if stages:
        lines += [
            "",
            f"The launcher's preparation stage by stage ({stages['corpus']}, not streamed; `--stages`: "
            "shardtune.training.engine.checks.prepare in a fresh process, its RssAnon around each call):",
            "",
            "| s | RssAnon MiB | change MiB | peak since the line above: own / with its children (RssAnon) / "
            "with its children (Pss_Anon), MiB | stage |",
            "|---|---|---|---|---|",
        ]
        previous = None
        for e in stages["events"]:
            change = "" if previous is None else f"{e['rss_anon_mib'] - previous:+.0f}"
            pss = e["peak_pss_with_children_mib"]
            peak = (
                f"{e['peak_own_mib']:.0f} / {e['peak_with_children_mib']:.0f} / {'-' if pss is None else f'{pss:.0f}'}"
            )
            lines.append(f"| {e['at_s']:.1f} | {e['rss_anon_mib']:.0f} | {change} | {peak} | `{e['what']}` |")
            previous = e["rss_anon_mib"]
        sites = stages.get("allocation_sites")
        if sites:
            lines += [
                "",
                "tracemalloc when the tokenised examples (before --dataset_num_proc) or the rows (since) are held: "
                f"{sites['total_mib']:.0f} MiB traced; by shardtune frame:",
                "",
            ]
            lines += [
                f"- {x['mib']:.1f} MiB, {x['blocks']:,} blocks: `{x['where']}`" for x in sites["by_shardtune_frame"]
            ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streaming", choices=("both", "on", "off"), default="both")
    parser.add_argument("--base_rows", type=int, default=1000, help="rows of the 1x corpus (~320 tokens a row)")
    parser.add_argument("--scales", default="1,10,100")
    parser.add_argument("--rows", choices=tuple(ROWS), default="messages", help="the corpora's format")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each corpus (the spread of the peaks)")
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batching", choices=("packing", "padding"), default="packing")
    parser.add_argument(
        "--sampling",
        choices=("random", "sequential"),
        default="",
        help="--data.sampling (default: the run's own, random); sequential: every corpus trains its first rows, the "
        "same batches at every scale (its prefix)",
    )
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between RssAnon samples")
    parser.add_argument("--pss_interval", type=float, default=1.0, help="seconds between Pss_Anon samples")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    parser.add_argument(
        "--stages",
        type=int,
        default=0,
        help="SCALE: also measure the launcher's preparation of that corpus stage by stage (0: not)",
    )
    parser.add_argument("--tracemalloc", action="store_true", help="with --stages: the allocation sites (slow)")
    parser.add_argument("--top", type=int, default=12, help="with --tracemalloc: allocation sites shown")
    parser.add_argument("--work", default="", help="folder for the corpora and runs (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and the runs' folders")
    parser.add_argument("--name", default="data_scale", help="bench/results/NAME.md and NAME.json")
    parser.add_argument("--results_dir", default=str(RESULTS))
    parser.add_argument("--stages_of", default="", help=argparse.SUPPRESS)  # the --stages child
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stages_of:
        print(json.dumps(stages_child(Path(args.stages_of), Path(args.model), args.tracemalloc, args.top)))
        return
    began = time.monotonic()
    scales = sorted(int(s) for s in args.scales.split(","))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="shardtune-data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(child_env())
    from shardtune.model.loading import init_model

    model = work / "demo"
    if not (model / "config.json").is_file():
        init_model("demo", model, seed=0)
    t0 = time.monotonic()
    corpora = write_corpora(work / f"corpora-{args.rows}", args.base_rows, scales, rows=args.rows)
    print(f"corpora written in {time.monotonic() - t0:.0f} s under {work}", flush=True)
    machine = machine_info()
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.streaming]
    runs = []
    for scale in scales:
        for streaming, repeat in [(s, i) for s in modes for i in range(args.repeats)]:
            result = run_once(model, corpora[scale], streaming, work, args)
            result.update(scale=scale, rows=args.base_rows * scale, repeat=repeat)
            runs.append(result)
            print(
                f"{scale}x streaming {'on' if streaming else 'off'}: peak RssAnon {result['peak_rss_anon_mib']:.0f} "
                f"MiB (launcher {result['peak_launcher_part_mib']:.0f} + descendants "
                f"{result['peak_ranks_part_mib']:.0f}; launcher's own peak {result['peak_launcher_alone_mib']:.0f}), "
                f"Pss_Anon {result['peak_pss_anon_mib']:.0f} MiB, first step {result['time_to_first_step_s']:.1f} s, "
                f"wall {result['wall_s']:.1f} s",
                flush=True,
            )
    for scale in scales:  # a streamed-only run has no cache entry: the cached run's count, or count here
        same = [r for r in runs if r["scale"] == scale]
        known = next((r for r in same if "tokens" in r), None)
        tokens, examples = (known["tokens"], known["examples"]) if known else count_tokens(corpora[scale], model)
        for r in same:
            r.setdefault("tokens", tokens)
            r.setdefault("examples", examples)
    slopes, ranges = (
        {
            mode: {key: fit([r for r in runs if r["streaming"] == flag], key) for key in SLOPES}
            for mode, flag in (("off", False), ("on", True))
            if len({r["tokens"] for r in runs if r["streaming"] == flag}) > 1
        }
        for fit in (slope, slope_range)
    )
    stages = measure_stages(corpora[args.stages], model, work, args.tracemalloc, args.top) if args.stages else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    results = {
        "date": datetime.now().isoformat(timespec="seconds"),
        # a copy of the tree without git (git archive HEAD) says which commit it is in DATA_SCALE_COMMIT
        "commit": commit.stdout.strip() or os.environ.get("DATA_SCALE_COMMIT", "?"),
        "argv": sys.argv[1:],
        "machine": machine,
        "load_average_at_end": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("work", "results_dir", "stages_of", "model")},
        "target_mib_per_m_tokens": TARGET_MIB_PER_M_TOKENS,
        "runs": runs,
        "slopes_mib_per_m_tokens": slopes,
        "slope_ranges_mib_per_m_tokens": ranges,
        "stages": stages,
        "total_s": time.monotonic() - began,
    }
    lines = report(results)
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (results_dir / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
