"""Checkpoints: the on-disk layout (layout.py), verified files and manifests (files.py), saving and resuming a run's
full state (checkpointer.py)."""
