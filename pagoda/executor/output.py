"""Old import path of ``Draft``, ``SeqStepResult`` and ``ModelOutput``, kept for code written
before they moved to ``pagoda.step`` (the step contracts' one home). New code imports
``pagoda.step``."""
from pagoda.step import Draft, ModelOutput, SeqStepResult

__all__ = ["Draft", "ModelOutput", "SeqStepResult"]
