"""PyTorch references of the model architectures jspec.models loads (plain torch, sglang's
tensor layout and forward), used as independent oracles in tests. ``eagle3_reference``: the
EAGLE-3 head (``LlamaForCausalLMEagle3``)."""
