"""Layout and exchange selection, shared by the Python API and SGLang's spawned schedulers.

Schedulers are fresh processes, so the choice travels in environment variables:
``SGLANG_FRSPEC_LAYOUT`` (local | balanced) and ``SGLANG_FRSPEC_EXCHANGE`` (full | topk | auto:
per batch size, by ``core.exchange_rule.auto_exchange``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sglang_frspec.core.errors import UnsupportedSetupError
from sglang_frspec.core.exchange_rule import EXCHANGE_CHOICES
from sglang_frspec.core.plan import LAYOUTS

LAYOUT_ENV = "SGLANG_FRSPEC_LAYOUT"
EXCHANGE_ENV = "SGLANG_FRSPEC_EXCHANGE"
DEFAULT_LAYOUT = "balanced"
DEFAULT_EXCHANGE = "full"


@dataclass(frozen=True)
class FrSpecOptions:
    """How the hot head is laid out over the ranks and how its logits are exchanged."""

    layout: str = DEFAULT_LAYOUT
    exchange: str = DEFAULT_EXCHANGE

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise UnsupportedSetupError(
                f"unknown layout {self.layout!r} (from {LAYOUT_ENV} or the API); "
                f"choose one of: {', '.join(LAYOUTS)}"
            )
        if self.exchange not in EXCHANGE_CHOICES:
            raise UnsupportedSetupError(
                f"unknown exchange {self.exchange!r} (from {EXCHANGE_ENV} or the API); "
                f"choose one of: {', '.join(EXCHANGE_CHOICES)}"
            )

    @classmethod
    def from_env(cls) -> FrSpecOptions:
        return cls(
            layout=os.environ.get(LAYOUT_ENV, DEFAULT_LAYOUT).strip().lower(),
            exchange=os.environ.get(EXCHANGE_ENV, DEFAULT_EXCHANGE).strip().lower(),
        )


def set_options(layout: str | None = None, exchange: str | None = None) -> FrSpecOptions:
    """Choose the layout/exchange for engines and servers started later from this process."""
    current = FrSpecOptions.from_env()
    chosen = FrSpecOptions(layout=layout or current.layout, exchange=exchange or current.exchange)
    os.environ[LAYOUT_ENV] = chosen.layout
    os.environ[EXCHANGE_ENV] = chosen.exchange
    return chosen
