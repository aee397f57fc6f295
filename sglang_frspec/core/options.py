"""Plugin options, shared by the Python API and SGLang's spawned schedulers.

Schedulers are fresh processes, so the choice travels in environment variables:
``SGLANG_FRSPEC_LAYOUT`` (local | balanced), ``SGLANG_FRSPEC_EXCHANGE`` (full | topk | auto:
per batch size, by ``core.exchange_rule.auto_exchange``), ``SGLANG_FRSPEC_COVERAGE`` (1 | 0:
count how many committed tokens the map holds, see ``core.coverage``), ``SGLANG_FRSPEC_COUNTS``
(a file for the per-id counts of the committed tokens; unset: no file), ``SGLANG_FRSPEC_ADAPT``
(1 | 0: the hot ids follow the committed tokens while serving, see ``core.adapt``) and
``SGLANG_FRSPEC_ADAPT_INTERVAL`` (verify steps between two adaptation decisions).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sglang_frspec.core.errors import UnsupportedSetupError
from sglang_frspec.core.exchange_rule import EXCHANGE_CHOICES
from sglang_frspec.core.plan import LAYOUTS

LAYOUT_ENV = "SGLANG_FRSPEC_LAYOUT"
EXCHANGE_ENV = "SGLANG_FRSPEC_EXCHANGE"
COVERAGE_ENV = "SGLANG_FRSPEC_COVERAGE"
COUNTS_ENV = "SGLANG_FRSPEC_COUNTS"
ADAPT_ENV = "SGLANG_FRSPEC_ADAPT"
ADAPT_INTERVAL_ENV = "SGLANG_FRSPEC_ADAPT_INTERVAL"
OPTION_ENVS = (LAYOUT_ENV, EXCHANGE_ENV, COVERAGE_ENV, COUNTS_ENV, ADAPT_ENV, ADAPT_INTERVAL_ENV)
# Chosen by benchmarks/studies/bench_adaptive.py --interval 16 64 256 (docs/benchmarks.md): 16 adapted
# fastest and accepted most in every phase; a decision costs about 0.2% of the steps' time at 16.
DEFAULT_ADAPT_INTERVAL = 16
DEFAULT_LAYOUT = "balanced"
DEFAULT_EXCHANGE = "full"
_SWITCH_VALUES = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


@dataclass(frozen=True)
class FrSpecOptions:
    """How the hot head is laid out and exchanged, and what is measured while serving."""

    layout: str = DEFAULT_LAYOUT
    exchange: str = DEFAULT_EXCHANGE
    coverage: bool = True
    counts_path: str | None = None
    adapt: bool = False
    adapt_interval: int = DEFAULT_ADAPT_INTERVAL

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
        if self.adapt and not self.coverage:
            raise UnsupportedSetupError(
                f"{ADAPT_ENV}=1 follows the counts of the committed tokens, which {COVERAGE_ENV}=0 "
                "turns off; unset one of the two."
            )
        if self.adapt_interval < 1:
            raise UnsupportedSetupError(
                f"{ADAPT_INTERVAL_ENV}={self.adapt_interval}: the number of verify steps between two "
                "adaptation decisions must be at least 1."
            )
        if self.counts_path is not None:
            if not self.coverage:
                raise UnsupportedSetupError(
                    f"{COUNTS_ENV}={self.counts_path} needs the coverage count, which "
                    f"{COVERAGE_ENV}=0 turns off; unset one of the two."
                )
            folder = os.path.dirname(os.path.abspath(self.counts_path))
            if not os.path.isdir(folder):
                raise UnsupportedSetupError(
                    f"{COUNTS_ENV}={self.counts_path}: the folder {folder} does not exist; create it "
                    "or choose another path for the counts file."
                )

    @classmethod
    def from_env(cls) -> FrSpecOptions:
        interval = os.environ.get(ADAPT_INTERVAL_ENV, str(DEFAULT_ADAPT_INTERVAL)).strip()
        if not interval.isdigit():
            raise UnsupportedSetupError(
                f"{ADAPT_INTERVAL_ENV}={interval!r}: give the number of verify steps between two "
                "adaptation decisions (a positive integer)."
            )
        return cls(
            layout=os.environ.get(LAYOUT_ENV, DEFAULT_LAYOUT).strip().lower(),
            exchange=os.environ.get(EXCHANGE_ENV, DEFAULT_EXCHANGE).strip().lower(),
            coverage=_switch(COVERAGE_ENV, "1", "count the committed tokens the map holds"),
            counts_path=os.environ.get(COUNTS_ENV, "").strip() or None,
            adapt=_switch(ADAPT_ENV, "0", "the hot ids follow the committed tokens while serving"),
            adapt_interval=int(interval),
        )


def _switch(name: str, default: str, meaning: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value not in _SWITCH_VALUES:
        raise UnsupportedSetupError(f"{name}={value!r}: use 1 ({meaning}) or 0 (off)")
    return _SWITCH_VALUES[value]


def set_options(
    layout: str | None = None,
    exchange: str | None = None,
    coverage: bool | None = None,
    counts_path: str | None = None,
    adapt: bool | None = None,
    adapt_interval: int | None = None,
) -> FrSpecOptions:
    """Choose the options for engines and servers started later from this process (None keeps
    the current value; the layout and exchange are always written, the others only when given)."""
    current = FrSpecOptions.from_env()
    chosen = FrSpecOptions(
        layout=layout or current.layout,
        exchange=exchange or current.exchange,
        coverage=current.coverage if coverage is None else coverage,
        counts_path=counts_path or current.counts_path,
        adapt=current.adapt if adapt is None else adapt,
        adapt_interval=adapt_interval or current.adapt_interval,
    )
    os.environ[LAYOUT_ENV] = chosen.layout
    os.environ[EXCHANGE_ENV] = chosen.exchange
    if coverage is not None:
        os.environ[COVERAGE_ENV] = "1" if chosen.coverage else "0"
    if counts_path is not None:
        os.environ[COUNTS_ENV] = chosen.counts_path
    if adapt is not None:
        os.environ[ADAPT_ENV] = "1" if chosen.adapt else "0"
    if adapt_interval is not None:
        os.environ[ADAPT_INTERVAL_ENV] = str(chosen.adapt_interval)
    return chosen
