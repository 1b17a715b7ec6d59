"""The executor: turns a ``SchedulerOutput`` into a ``ModelOutput``.

``interface.Executor`` is what the engine core sees (``ModelRunner`` in one process,
``TPExecutor`` over tensor-parallel ranks); ``input`` holds the tensors of a forward pass and
their one builder, ``sampler`` the one sampling pipeline, ``rejection`` draft verification. The
step's torch-free contracts (``SchedulerOutput``, ``Draft``, ``ModelOutput``) are in
``pagoda.step``, shared with the scheduler and the proposers. This package file imports nothing.
"""
