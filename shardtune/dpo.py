"""``python -m shardtune.dpo``: what torchrun runs for ``shardtune dpo``; the command is shardtune.commands.sft with
the DPO objective."""

import sys

from shardtune.commands.sft import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], objective="dpo"))
