"""A GGUF file's model as a module tree holding none of its quantised weights, and the loading of
its float tensors into such a tree (transformers' here; agentspec's own in ``tree.py``).

The passes on a file's blocks (``passes/blocks.py``, ``products.py``) read the model's structure
from transformers' modules (``arch.describe``: which projections, norms, windows, scales), its rotary
tables, and its small float tensors — norms, biases. ``module_tree`` builds that tree with its
parameters on the meta device (shapes, no memory) and loads into it only the file's float tensors
(F32, F16, BF16: the norms and biases, and any matrix the file keeps unquantised), converted to
float32 as transformers' GGUF loader converts them (its tensor processors: Llama's q/k rows
un-interleaved, Gemma's norms less one; ``PROCESSOR_OF`` names the processor of a family it has none
for). Buffers (rotary frequencies, Gemma's embedding scale) are built on the CPU as transformers
builds them. A quantised matrix stays on the meta device: the block pass multiplies the file's own
blocks, and the embedding rows it needs are dequantised from them (``passes/layouts.FileBlocks``),
so no float32 copy of the model exists. ``weights_on_meta`` tells such a tree from a loaded model;
``quantised=frozenset()`` dequantises every matrix into it (the float model of a family transformers
does not read from GGUF). The block passes take ``tree.file_tree``, the same tree built without
importing transformers' modeling code; ``load_float_tensors`` fills both.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError
from .reader import GGML_TYPES, GGUFFile, GGUFTensor

__all__ = ["module_tree", "load_float_tensors", "apply_rope_factors", "ROPE_FACTORS", "float_array", "weights_on_meta", "FLOAT_TYPES"]

FLOAT_TYPES = ("F32", "F16", "BF16")
# transformers' tensor processor of the architectures it has none for (gguf/config.OWN_TABLES): llama.cpp's
# converter writes Gemma's norms as 1 + w as for Gemma 2, and SmolLM3's and Granite's q/k rows as Llama's
PROCESSOR_OF = {"gemma": "gemma2", "smollm3": "llama", "granite": "llama"}


def float_array(tensor: GGUFTensor) -> np.ndarray:
    """A float tensor of the file (F32, F16, BF16) as float32, in the file's shape (outputs first)."""
    data = tensor.data
    if tensor.type_name == "BF16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data if tensor.type_name == "F32" else data.astype(np.float32)  # F32: the mapping's own pages, read-only


def weights_on_meta(model: Any) -> bool:
    """Whether ``model`` is a tree of a file's modules (``module_tree`` with quantised types,
    ``tree.file_tree``): some of its weights are in the file, not in the modules."""
    return any(parameter.device.type == "meta" for parameter in model.parameters())


def _dequantised(tensor: GGUFTensor) -> np.ndarray:
    from gguf import dequantize

    type_id = next(number for number, (name, _, _) in GGML_TYPES.items() if name == tensor.type_name)
    return dequantize(tensor.data, type_id).astype(np.float32, copy=False)


def module_tree(gguf: GGUFFile, config: Any, quantised: frozenset[str] = frozenset()) -> nn.Module:
    """transformers' causal LM of ``config`` with the file's float tensors loaded and its matrices of
    the ``quantised`` types on the meta device (``load_float_tensors``); with none, the float model
    (the families transformers does not read from GGUF). On the block passes agentspec builds its
    own tree instead (``tree.file_tree``: the same modules without transformers' modeling imports)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary tables) built on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_float_tensors(model, gguf, config, quantised)
    return model.eval().requires_grad_(False)


def load_float_tensors(model: nn.Module, gguf: GGUFFile, config: Any, quantised: frozenset[str]) -> None:
    """Load into ``model`` (its parameters on the meta device) the file's float tensors, and its
    matrices of types not in ``quantised`` dequantised to float32, converted as transformers' GGUF
    loader converts them (its tensor processors); tie the LM head where the config says; apply the
    file's rotary factors. A projection's bias in the file is loaded whether or not the module was
    built with one (llama.cpp adds any bias the file has). ``ModelLoadError`` where a shape differs
    or a norm or bias the model needs is not in the file."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(PROCESSOR_OF.get(gguf.architecture, gguf.architecture), TensorProcessor)(config=config.to_dict())
    names = _parameter_names(model, gguf)
    for name, tensor in gguf.tensors.items():
        if tensor.type_name in FLOAT_TYPES:
            weights = float_array(tensor)
        elif tensor.type_name in quantised:
            continue
        else:  # the block passes name these matrices in one warning (products.read_blocks)
            weights = _dequantised(tensor)
        result = processor.process(weights=weights, name=name, tensor_key_mapping=names, parsed_parameters={})
        if result.name not in names:
            continue  # a tensor the model has no parameter for (rope_freqs.weight: apply_rope_factors)
        with warnings.catch_warnings():  # a read-only view of the mapping: nothing writes a parameter
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            value = torch.from_numpy(np.ascontiguousarray(result.weights))
        _assign(model, names[result.name], value)
    if getattr(config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    missing = [name for name, parameter in model.named_parameters() if parameter.device.type == "meta" and parameter.dim() < 2]
    if missing:
        raise ModelLoadError(f"{gguf.path} lacks tensors the {config.model_type} model needs: {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}")
    apply_rope_factors(model, gguf)


ROPE_FACTORS = "rope_freqs.weight"


def apply_rope_factors(model: nn.Module, gguf: GGUFFile) -> None:
    """llama.cpp's rotary frequency factors, where the file has them (``rope_freqs.weight``: Llama
    3.1's and 3.2's long-context scaling, which llama.cpp's converter writes as a tensor of factors
    and not as metadata): each rotary frequency of ``model`` divided by its factor, as llama.cpp's
    RoPE divides the angle. transformers' GGUF reader drops the tensor, and with it the scaling."""
    tensor = gguf.tensors.get(ROPE_FACTORS)
    if tensor is None:
        return
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inverse = getattr(rotary, "inv_freq", None)
    factors = torch.from_numpy(np.array(float_array(tensor), dtype=np.float32)).reshape(-1)
    if inverse is None or inverse.shape != factors.shape or not bool((factors > 0).all()):
        shape = None if inverse is None else tuple(inverse.shape)
        raise ModelLoadError(f"{gguf.path}: its {ROPE_FACTORS} ({tuple(factors.shape)}) does not fit the model's rotary frequencies ({shape}), or is not positive")
    rotary.inv_freq = (inverse.float() / factors.to(inverse.device)).to(inverse.dtype)
    rotary.original_inv_freq = rotary.inv_freq


def _parameter_names(model: nn.Module, gguf: GGUFFile) -> dict[str, str]:
    """{GGUF tensor name: the model's parameter name}, by gguf-py's table of llama.cpp's names (one
    table for the model: transformers' ``get_gguf_hf_weights_map`` builds one per module, 7 s for
    SmolLM2's 30 layers)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == gguf.architecture), None)
    if arch is None:
        raise ModelLoadError(f"{gguf.path}: gguf-py has no tensor names for architecture {gguf.architecture!r}; update the gguf package.")
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for name in model.state_dict():
        base, _, suffix = name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names.setdefault(f"{gguf_name}.{suffix}", name)
    for base, module in model.named_modules():  # a projection built without a bias takes the file's
        gguf_name = table.get_name(base) if isinstance(module, nn.Linear) and module.bias is None else None
        if gguf_name is not None:
            names.setdefault(f"{gguf_name}.bias", f"{base}.bias")
    return names


def _assign(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attribute = name.rpartition(".")
    module = model.get_submodule(owner)
    expected = getattr(module, attribute)
    if expected is None and attribute == "bias":  # a bias the file adds: one per output
        expected = torch.empty(module.weight.shape[0], device="meta")
    if tuple(expected.shape) != tuple(value.shape):
        raise ModelLoadError(f"the file's tensor for {name} has shape {tuple(value.shape)}, the model expects {tuple(expected.shape)}")
    setattr(module, attribute, nn.Parameter(value, requires_grad=False))
