"""``python -m shardtune.sft``: what torchrun runs (``torchrun ... -m shardtune.sft --flag value``); the command
itself is shardtune.commands.sft."""

import sys

from shardtune.commands.sft import main

if __name__ == "__main__":
    sys.exit(main())
