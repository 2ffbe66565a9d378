"""Training: the engine (engine/: the worker that assembles a run, the loop and the optimizer step, evaluation,
checkpoints, metrics and trackers, the checks before launch) and the objectives it trains (objectives/: SFT, DPO,
GRPO), each a plug-in named in shardtune.config.objectives. The engine never imports an objective; objectives never
import each other (the import contracts in pyproject.toml)."""
