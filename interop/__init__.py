"""torch <-> jspec interop, arranged as jspec is (``kv``, ``tree``, ``attention_meta``).

Per package: ``reference*`` (PyTorch references with sglang 0.5.23's signatures, plain torch,
CPU), ``dropin*`` (jspec behind sglang's signatures) and ``compare`` (reference vs drop-in on
random valid worlds). :mod:`interop.registry` is the one list of ops by sglang name;
:mod:`interop.torch_api` re-exports every drop-in under its sglang name; :mod:`interop.compare`
is the harness (``jspec compare``); :mod:`interop.dlpack` the zero-copy shim. Importing
``interop`` itself imports neither torch nor jax."""
