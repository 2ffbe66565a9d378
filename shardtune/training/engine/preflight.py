"""Checks right after rendezvous, before any model is loaded: every node runs the same thing and shares output_dir.

What users lose days to on several nodes is found here in seconds, on every rank alike:

- **Same run everywhere.** Every rank contributes a fingerprint (shardtune's version, git commit and source,
  the versions of torch / transformers / peft / deepspeed, processes per node, device type, every field of the
  resolved config, the training data's fingerprint); the first field in which a rank differs from rank 0 stops
  the job with one line naming the field, both nodes and both values. Nodes that differ would otherwise train
  (a different learning rate, other data) or hang in a collective that one side never calls.
- **Shared output_dir** (several nodes only): rank 0 writes a token file into output_dir and the first
  process of every node looks for it. A node-local output_dir would otherwise surface at the first
  checkpoint or at resume, hours later, as missing shards.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch.distributed as dist

from shardtune.config.flags import flatten_dict, to_dict
from shardtune.config.schema import TrainConfig
from shardtune.config.spellings import default_spelling
from shardtune.data.cache import cache_key
from shardtune.data.chat import apply_tokenizer_options
from shardtune.model.loading import load_tokenizer
from shardtune.runtime.distributed import DistEnv, print0

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the shardtune package
LIBRARIES = ("torch", "transformers", "peft", "deepspeed")
STORAGE_WAIT_S = 5.0  # how long a node looks for rank 0's token (network file systems cache directory entries)


class PreflightError(Exception):
    """The nodes cannot train together; raised on every rank alike with the same message."""


def run_preflight(cfg: TrainConfig, env: DistEnv) -> None:
    """On several nodes: compare every rank's fingerprint with rank 0's, then check that output_dir is shared.

    One node's processes come from one launcher, one command line and one file system: nothing to compare.
    """
    if env.num_nodes == 1:
        return
    fingerprints: list[dict[str, str]] = [{} for _ in range(env.world_size)]
    dist.all_gather_object(fingerprints, fingerprint(cfg, env))
    check_fingerprints(fingerprints)
    check_shared_output_dir(Path(cfg.output.dir), env)
    hosts = list(dict.fromkeys(f["host"] for f in fingerprints))
    print0(
        f"preflight: {env.num_nodes} nodes ({', '.join(hosts)}), {env.world_size} processes agree on code, "
        "library versions, config and data; output_dir is shared"
    )


def fingerprint(cfg: TrainConfig, env: DistEnv) -> dict[str, str]:
    """What must be equal on every rank, in the order mismatches are reported (``host`` only names the node)."""
    fields = {
        "host": socket.gethostname(),
        "shardtune version": package_version("shardtune"),
        "shardtune git commit": git_commit(),
        "shardtune source": source_digest(),
    }
    fields.update({f"{name} version": package_version(name) for name in LIBRARIES})
    fields.update({"processes per node": str(env.local_world_size), "device type": env.device.type})
    # named by the flag users know each setting by (the same on every node, however each node's command spelled it)
    fields.update(
        {f"--{default_spelling(key)}": json.dumps(value) for key, value in flatten_dict(to_dict(cfg)).items()}
    )
    fields["training data"] = data_fingerprint(cfg)
    return fields


def check_fingerprints(fingerprints: list[dict[str, str]]) -> None:
    reference = fingerprints[0]
    for rank, other in enumerate(fingerprints[1:], start=1):
        for name, value in reference.items():
            if name != "host" and other.get(name) != value:
                raise PreflightError(
                    f"preflight: the nodes differ in {name}: {reference['host']} (rank 0) has {value}, "
                    f"{other['host']} (rank {rank}) has {other.get(name)}; start every node with the same "
                    "code, libraries, command and data"
                )


def check_shared_output_dir(output_dir: Path, env: DistEnv) -> None:
    """Rank 0 writes a token into output_dir; the first process of every node must see it."""
    token = [secrets.token_hex(8) if env.is_main else ""]
    if env.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        token_path(output_dir, token[0]).touch()
    try:
        dist.broadcast_object_list(token, src=0)  # after rank 0 wrote the token
        seen = env.local_rank != 0 or wait_for(token_path(output_dir, token[0]), STORAGE_WAIT_S)
        sightings: list[tuple[str, bool]] = [("", True) for _ in range(env.world_size)]
        dist.all_gather_object(sightings, (socket.gethostname(), seen))
    finally:
        if env.is_main:
            token_path(output_dir, token[0]).unlink(missing_ok=True)
    blind = list(dict.fromkeys(host for host, ok in sightings if not ok))
    if blind:
        raise PreflightError(
            f"preflight: --output_dir {output_dir} is not shared: {', '.join(blind)} cannot see the file "
            f"{sightings[0][0]} (rank 0) wrote there, so checkpoints and the model would be split across nodes; "
            "put --output_dir on a file system every node mounts at the same path (NFS, Lustre, ...)"
        )


def token_path(output_dir: Path, token: str) -> Path:
    return output_dir / f".shardtune-shared-{token}"


def wait_for(path: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed" if name != "shardtune" else "source tree (not installed)"


def git_commit() -> str:
    """The commit of the checkout shardtune runs from, or "none" (an installed wheel, no git)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "none"
    return out.stdout.strip() if out.returncode == 0 else "none"


def source_digest() -> str:
    """sha256 of shardtune's own source files: catches edits that share a commit."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def data_fingerprint(cfg: TrainConfig) -> str:
    """The tokenised-data cache key of the training split: dataset settings, data files' contents, tokenizer."""
    tokenizer = apply_tokenizer_options(
        cfg, load_tokenizer(cfg.model.tokenizer or cfg.model.name, cfg.model.trust_remote_code)
    )
    return cache_key(cfg, tokenizer, "train")
