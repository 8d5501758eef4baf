"""KV bookkeeping interop (mirrors ``jspec.kv``): PyTorch references (``reference``,
``reference_allocator``), jspec behind sglang's signatures (``dropin``, ``dropin_allocator``) and
the comparisons (``compare``). Importing the package imports neither torch nor jax."""
