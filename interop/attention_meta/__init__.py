"""Draft-decode attention-metadata interop (mirrors ``jspec.attention_meta``): PyTorch references
(``reference``), jspec behind sglang's signatures (``dropin``) and the comparisons (``compare``).
Importing the package imports neither torch nor jax."""
