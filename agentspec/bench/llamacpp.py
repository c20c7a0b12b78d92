"""llama.cpp as a peer in ``agentspec bench``: llama-cpp-python on the same GGUF file and threads.

What a user running a local agent on a CPU would otherwise pick (directly, or through Ollama). Three
systems, all greedy, with llama.cpp's repetition penalty off:

- ``llamacpp``               plain decoding; under a workload's JSON schema, llama.cpp's own grammar
                             (``LlamaGrammar.from_json_schema``: the schema agentspec compiles)
- ``llamacpp_prompt_lookup`` with its prompt-lookup drafting (``LlamaPromptLookupDecoding``,
                             10 tokens), where there is no grammar

Prompts are agentspec's own token ids (same chat template, same tool section), so only decoding
differs. Each run starts from an empty context (``Llama.reset``): llama.cpp would otherwise reuse
the previous run's keys/values for the shared prefix, which the agentspec rows do not. llama.cpp
reports no target passes, so its rows show 0 (unknown). The package is optional (``make bench``
installs it); without it, or for a model that is not a GGUF file, the rows are skipped with the
reason (``unavailable``).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..model import default_model_path
from ..params import parse_params
from ..structured.tools import with_tool_prompt

if TYPE_CHECKING:
    from ..client import Client
    from .workloads import Workload

__all__ = ["LLAMACPP_SYSTEMS", "PROMPT_LOOKUP_TOKENS", "unavailable", "llamacpp_generate"]

LLAMACPP_SYSTEMS = ("llamacpp", "llamacpp_prompt_lookup")
PROMPT_LOOKUP_TOKENS = 10  # as transformers' prompt lookup row
CONTEXT = 4096
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # GCC 12's AMX kernels die with SIGILL on Sapphire Rapids (as in the Makefile)
INSTALL = f"make bench, or: CMAKE_ARGS='-DCMAKE_C_FLAGS=\"{NO_AMX}\" -DCMAKE_CXX_FLAGS=\"{NO_AMX}\"' pip install 'llama-cpp-python[server]==0.3.36'"


def _gguf_path(client: Client) -> Path | None:
    ref = client.model_ref
    if ref is None:
        return default_model_path()
    path = Path(ref).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def unavailable(client: Client) -> str | None:
    """Why the llama.cpp rows cannot run for this client, or None when they can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed ({INSTALL})"
    if _gguf_path(client) is None:
        return f"the model {client.model_ref!r} is not a GGUF file"
    if client.loaded.device.type != "cpu":
        return "the llama.cpp rows run on the CPU only"
    return None


_MODELS: dict[tuple[str, str], Any] = {}


def _llama(client: Client, system: str) -> Any:
    """One ``Llama`` per (file, system), loaded once: loading is not what the rows time."""
    path = _gguf_path(client)
    assert path is not None
    key = (str(path), system)
    if key not in _MODELS:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS) if system == "llamacpp_prompt_lookup" else None
        threads = torch.get_num_threads()
        llm = _MODELS[key] = Llama(
            model_path=str(path), n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads, draft_model=draft, verbose=False
        )
        atexit.register(llm.close)  # before interpreter teardown, where its finaliser fails noisily
    return _MODELS[key]


def llamacpp_generate(client: Client, system: str, work: Workload, max_tokens: int) -> tuple[str, int]:
    """Run ``system`` on ``work`` (blocking): (text, generated tokens)."""
    from llama_cpp import LlamaGrammar

    loaded = client.loaded
    params = parse_params(work.params, default_spec=client.spec)
    messages = with_tool_prompt(work.messages, list(params.tools)) if params.tools else work.messages
    grammar = LlamaGrammar.from_json_schema(json.dumps(params.schema), verbose=False) if params.schema is not None else None
    llm = _llama(client, system)
    llm.reset()
    result = llm.create_completion(
        loaded.chat.encode(messages),
        max_tokens=max_tokens,
        temperature=0.0,
        repeat_penalty=1.0,
        grammar=grammar,
    )
    return result["choices"][0]["text"], int(result["usage"]["completion_tokens"])
