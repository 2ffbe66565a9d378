"""A training run: the pre-launch checks (checks.py), the worker that assembles a run (worker.py), the loop
(loop.py), checkpoints, metrics and trackers, profiling and the multi-node preflight."""
