"""Patch ``trainer_logs``: ampguard's stats also reach the trainer's own records.

The coqui trainer's log file, the HF Trainer's ``state.log_history`` (and so
TensorBoard, W&B, ...), Lightning's loggers: each as soon as that library is
imported (see :mod:`ampguard.trainer_logs.attach`, docs/trainer-logs.md). ampguard
imports none of them. ``AMPGUARD_DISABLE=trainer_logs`` leaves their records
as they are.
"""

from __future__ import annotations

from types import ModuleType

import ampguard.trainer_logs.attach as integrations
from ampguard.config import Config
from ampguard.patch import Patch


class TrainerLogsPatch(Patch):
    name = "trainer_logs"
    summary = (
        "ampguard's stats also reach the trainer's own records: the coqui trainer's log file, "
        "the HF Trainer's log_history (TensorBoard, W&B, ...), Lightning's loggers"
    )
    requires_torch = ">=2.3"

    def __init__(self) -> None:
        super().__init__()
        self.attached: dict[str, ModuleType] = {}  # trainer module name -> the integration attached to it

    def apply(self, config: Config) -> None:
        integrations.activate(self)

    def revert(self) -> None:
        integrations.deactivate(self)
        super().revert()
