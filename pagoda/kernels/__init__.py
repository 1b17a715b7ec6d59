"""pagoda's compute kernels, apart from the modules that use them: the C++ CPU kernels
(``csrc/``, one library compiled per instruction-set variant, ``build.py``), their Python
wrappers and weight packers (``gemv``, ``attention``, ``fused``, ``moe``, ``woq``, ``amx``,
``panel``), and ``select``, the one place that decides which variant and kernels run here.
Nothing here imports the layers, models or engine."""
