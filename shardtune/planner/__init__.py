"""Per-GPU memory and speed of a training configuration, from config.json alone: shapes -> estimate (memory) and
speed (time) -> search (alternatives, the plan) -> render (text). ``dry_run`` shows a real run's shards without
hardware."""
