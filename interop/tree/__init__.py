"""EAGLE tree interop (mirrors ``jspec.tree``): PyTorch references (``reference``,
``reference_build_tree``, ``reference_layout``), jspec behind sglang's signatures (``dropin``,
``dropin_layout``) and the comparisons (``compare``). Importing the package imports neither
torch nor jax."""
