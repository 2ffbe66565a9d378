"""The training configuration: its schema (schema.py), flags and YAML recipes (flags.py), checks of the settings
alone (checks.py), DeepSpeed and Accelerate files. The one list of pre-launch checks is
shardtune.training.engine.checks."""
