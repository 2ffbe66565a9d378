"""The parallel dimensions of a run and the ONE device mesh built from them.

The world is ``dp_replicate x dp_shard x cp x sp`` processes (outermost first):

- ``dp_replicate`` x ``dp_shard``: data parallel. Each data-parallel rank trains on its own micro-batches; the data
  sampler sees only these ranks (``dp_rank`` / ``dp_size``). FSDP2 replicates across ``dp_replicate`` (HSDP) and
  shards across ``dp_shard``; DDP and FULL_SHARD have ``dp_replicate = 1`` or ``dp_shard = 1`` as they need.
- ``cp`` (context parallel, ring attention) and ``sp`` (sequence parallel, DeepSpeed-Ulysses): the ranks of one
  ``cp x sp`` group receive the SAME micro-batches and each computes a different slice of their sequence
  (shardtune.parallel.sequence). ``sp`` is innermost, so its all-to-all stays between neighbouring ranks (one
  node); the ring of ``cp`` may span nodes.

FSDP shards parameters over ``dp_shard x cp x sp`` (the sequence ranks hold the same model, so they share its
shards, as torchtitan does with its context-parallel dimension); DeepSpeed ZeRO partitions over the whole world,
which it takes for data parallel (its batch-size bookkeeping then counts the sequence ranks as data-parallel ones:
only a consistency check of its config, it loads no data). Every strategy averages gradients over the whole
world, which is right: each labelled token lives on exactly one rank, so the sum over all ranks is the step's
gradient (train.py multiplies by the world size to undo the mean).

Rank arithmetic lives here and nowhere else; the mesh built by :meth:`ParallelDims.build_mesh` orders the ranks
the same way (``init_device_mesh`` lays out ``arange(world)`` in this shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtune.config.schema import ConfigError, TrainConfig

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "sp")
FSDP_SHARD_DIM = "dp_shard_cp_sp"  # the flattened dimension FSDP shards over


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    sp: int

    def __post_init__(self) -> None:
        for name in MESH_DIM_NAMES:
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel dimension {name} {getattr(self, name)} must be >= 1")

    @classmethod
    def from_config(cls, cfg: TrainConfig, world_size: int, local_world_size: int | None = None) -> ParallelDims:
        """The dimensions of ``cfg`` on ``world_size`` processes (``local_world_size``: processes per node, the
        default HSDP sharding group). Raises ConfigError (one line) when the sizes do not fit the world."""
        cp, sp = cfg.parallel.context_parallel_size, cfg.parallel.sequence_parallel_size
        if cp < 1 or sp < 1:
            raise ConfigError(f"--context_parallel_size {cp} and --sequence_parallel_size {sp} must be >= 1")
        if world_size % (cp * sp):
            raise ConfigError(
                f"--context_parallel_size {cp} x --sequence_parallel_size {sp} = {cp * sp} does not "
                f"divide the world size {world_size}: pick sizes whose product divides {world_size}"
            )
        dp = world_size // (cp * sp)
        replicas = data_parallel_replicas(cfg, world_size, local_world_size or world_size, cp * sp)
        return cls(dp_replicate=replicas, dp_shard=dp // replicas, cp=cp, sp=sp)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.sp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different micro-batches one micro-step trains on."""
        return self.dp_replicate * self.dp_shard

    @property
    def sequence_split(self) -> bool:
        return self.cp * self.sp > 1

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank``: equal for the ranks of one cp x sp group."""
        return rank // (self.cp * self.sp)

    def cp_rank(self, rank: int) -> int:
        return rank // self.sp % self.cp

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The one device mesh of the run, dimensions named MESH_DIM_NAMES (a collective: every rank calls it)."""
        shape = (self.dp_replicate, self.dp_shard, self.cp, self.sp)
        return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)

    def describe(self) -> str:
        return " x ".join(f"{name} {getattr(self, name)}" for name in MESH_DIM_NAMES)


def data_parallel_replicas(cfg: TrainConfig, world_size: int, local_world_size: int, sequence_ranks: int) -> int:
    """How many FSDP replicas (HSDP) the data-parallel ranks form: 1 unless --enable_fsdp replicates.

    NO_SHARD replicates across every data-parallel rank; HYBRID_SHARD shards within groups of sharding_group_size
    processes (default: one node's), which hold whole cp x sp groups, and replicates across the groups.
    """
    dp = world_size // sequence_ranks
    if cfg.parallel.strategy != "fsdp":
        return 1
    fc = cfg.parallel
    if fc.sharding_strategy == "NO_SHARD":
        return dp
    if fc.sharding_strategy != "HYBRID_SHARD":
        return 1
    shard_group = fc.sharding_group_size
    if not shard_group:
        shard_group = world_size // fc.replica_group_size if fc.replica_group_size else local_world_size
    if shard_group % sequence_ranks or world_size % shard_group:
        raise ConfigError(
            f"the HYBRID_SHARD sharding group of {shard_group} processes must hold whole context x "
            f"sequence parallel groups of {sequence_ranks} and divide the world size {world_size}: "
            "set --fsdp_config.sharding_group_size to such a multiple"
        )
    return world_size // shard_group


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh handed to fully_shard: 1-D (pure sharding) with one replica, else 2-D (replicate, shard) for HSDP.
    The shard dimension is dp_shard x cp x sp, flattened (just dp_shard when there is no sequence split)."""
    shard = mesh["dp_shard"] if not dims.sequence_split else mesh["dp_shard", "cp", "sp"]._flatten(FSDP_SHARD_DIM)
    if dims.dp_replicate == 1:
        return shard
    return mesh["dp_replicate", shard.mesh_dim_names[0]]


def check_parallel_dims(cfg: TrainConfig, world_size: int) -> None:
    """Sizes that fit the world, and what cannot run with a split row (one line each, before launch)."""
    dims = ParallelDims.from_config(cfg, world_size)
    if not dims.sequence_split:
        return
    flags = " / ".join(
        f"--{name} {value}"
        for name, value in (("sequence_parallel_size", dims.sp), ("context_parallel_size", dims.cp))
        if value > 1
    )
    if bool(cfg.peft.method) and cfg.peft.method in ("prefix", "llama_adapter"):
        raise ConfigError(
            f"{flags} cannot split rows with --peft_method {cfg.peft.method} (its virtual tokens are "
            "attended outside the split attention): use --peft_method lora, or drop the flag"
        )
    if cfg.model.compile:
        raise ConfigError(
            f"{flags} is not supported with --compile yet (the all-to-all around attention is not "
            "compiled): drop one of them"
        )
