"""Process-wide settings every command applies before it works."""

from __future__ import annotations

import logging


def quiet_libraries() -> None:
    """Our progress bar is the one a user watches; transformers' load/save bars on every rank are noise, and so
    is bitsandbytes' import-time note about an optional CPU kernel package (it is printed on every import)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
