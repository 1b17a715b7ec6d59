"""The executor: turns a ``SchedulerOutput`` into a ``ModelOutput``.

``interface.Executor`` is what the engine core sees (``ModelRunner`` in one process,
``TPExecutor`` over tensor-parallel ranks); ``output`` holds the torch-free contracts
(``Draft``, ``ModelOutput``) the scheduler and proposers import, ``input`` the tensors of a
forward pass and their one builder, ``sampler`` the one sampling pipeline, ``rejection`` draft
verification. This package file imports nothing, so ``executor.output`` stays torch-free.
"""
