"""Applications on top of jspec (they may import jspec.models and jspec.engine).

generate.py   ``jspec generate``: checkpoint directories + a prompt -> text
"""
