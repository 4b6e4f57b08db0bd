"""The probe looks less often while its verdicts make no island: the overflows come from elsewhere.

After :data:`FRUITLESS_VERDICTS` verdicts in a row that made no island (the data,
code outside any module, modules it may not change), the probe lets 2 forward
overflows pass before it arms again, then 4, 8, ... They are still skipped and
counted, without lowering the loss scale. A verdict that makes an island, or
steps without overflows, start the count again.
"""

from __future__ import annotations

import logging

import ampguard.messages as messages
from ampguard.log import event_logger

logger = event_logger("island")

FRUITLESS_VERDICTS = 3


class BackOff:
    """Verdicts in a row that made no island, and the forward overflows to let pass before the probe arms again."""

    def __init__(self) -> None:
        self.fruitless = 0  # after one, arming again is not news (said at DEBUG)
        self.skip_arming = 0

    def may_arm(self) -> bool:
        """Whether the probe may arm at this forward overflow (one more let pass when not)."""
        if self.skip_arming:
            self.skip_arming -= 1
            return False
        return True

    def after_verdict(self, made_island: bool, conclusive: bool = False) -> bool:
        """Count a verdict; True when the probe backs off now (it disarms).

        ``conclusive``: the verdict named an existing island (float32 does not fix it): back off at once.
        """
        if conclusive:
            self.fruitless = max(self.fruitless, FRUITLESS_VERDICTS - 1)
        self.fruitless = 0 if made_island else self.fruitless + 1
        if self.fruitless < FRUITLESS_VERDICTS:
            return False
        self.skip_arming = 2 ** (self.fruitless - FRUITLESS_VERDICTS + 1)
        logger.log(
            logging.INFO if self.fruitless == FRUITLESS_VERDICTS else logging.DEBUG,
            messages.PROBE_BACKING_OFF.format(count=self.fruitless, skip=self.skip_arming),
        )
        return True

    def reset(self) -> None:
        """The overflows stopped, or another model trains: the next one is news."""
        self.fruitless = self.skip_arming = 0
