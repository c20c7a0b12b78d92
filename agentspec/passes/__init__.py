"""Target passes: a model's logits for a packed set of positions, row-invariant (synchronous torch and C).

- ``arch.py``     a decoder block described as data, per family (biases, q/k norms, RoPE, windows, ...)
- ``packed.py``   the packed multi-sequence pass over transformers' modules, and its attention
- ``fused.py``    agentspec's own pass for the families of ``arch.py``, on any linear product
- ``rope.py``     LongRoPE with its table chosen per position (Phi-3.5, Phi-4-mini)
- ``static.py``   the GPU pass: a key/value pool allocated once, CUDA graphs per shape
- ``levels.py``   the kernels' instruction-set levels and their build (``blocks.c``, ``blocks.h``)
- ``layouts.py``  a GGUF matrix's blocks and the kernels' layouts of them, built in runs of rows
- ``products.py`` products on the blocks, and which of a model's weights have them
- ``blocks.py``   ``BlockPass``: the decoder layers in one compiled call
- ``threads.py``  the kernels' thread count, and torch's operations between their calls on the calling thread
- ``weights.py``  which pass runs: by rule on a GGUF file with kernels, else by measurement

The engine (``agentspec.engine``) runs one of them; the keys and values they write are its
``KVBlock``s (``engine/kv.py``).
"""
