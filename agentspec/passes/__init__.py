"""Target passes: a model's logits for a packed set of positions, row-invariant (synchronous torch and C).

- ``arch.py``     a decoder block described as data, per family (biases, q/k norms, RoPE, windows, ...)
- ``packed.py``   the packed multi-sequence pass over transformers' modules, and its attention
- ``fused.py``    agentspec's own pass for the families of ``arch.py``, on any linear product
- ``static.py``   the GPU pass: a key/value pool allocated once, CUDA graphs per shape
- ``blocks.py``   the GGUF file's blocks and their compiled kernels (``blocks.c``, per ISA level;
  ``blocks.h``, their interface); ``BlockPass``, the decoder layers in one compiled call
- ``weights.py``  which pass runs: by rule on a GGUF file with kernels, else by measurement

The engine (``agentspec.engine``) runs one of them; the keys and values they write are its
``KVBlock``s (``engine/kv.py``).
"""
