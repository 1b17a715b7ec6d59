"""Old import path of ``ScheduledSeq`` and ``SchedulerOutput``, kept for code written before
they moved to ``pagoda.step`` (the step contracts' one home). New code imports ``pagoda.step``."""
from pagoda.step import ScheduledSeq, SchedulerOutput

__all__ = ["ScheduledSeq", "SchedulerOutput"]
