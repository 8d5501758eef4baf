"""torch <-> jspec interop: DLPack shim (``dlpack``), PyTorch references with sglang's
signatures (``torch_reference``), jspec behind sglang's signatures (``torch_api``) and the
side-by-side comparison harness (``compare``, ``jspec compare``). Importing ``interop`` itself
imports neither torch nor jax."""
