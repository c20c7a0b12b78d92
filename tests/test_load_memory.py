"""What loading a GGUF file costs in memory: a random Qwen2 file of a few hundred MB built here,
loaded by a fresh process the way a user loads it (``Client(path)``, start, a short answer), its peak
resident memory (VmHWM) read by that process before and after.

The file is the model (``gguf/modules.py``): nothing is dequantised but its float tensors, the
block pass lays each matrix out for the kernels in runs of rows and lets go of the file's pages, and
nothing is written but the compiled kernels. The bound is the issue's: 1.25 times the file plus
300 MB over the process before the load (torch imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from agentspec.model import default_model_path
from agentspec.passes.levels import block_kernels

from .test_families import write_gguf

LOAD = """
import asyncio, json, sys
def peak():
    return int(next(line for line in open('/proc/self/status') if line.startswith('VmHWM')).split()[1]) * 1024
import agentspec
before = peak()
async def main():
    async with agentspec.Client(**json.loads(sys.argv[1])) as client:
        done = await client.generate([{'role': 'user', 'content': 'Say something.'}], max_tokens=8)
        return client.engine.weights.name, type(client.draft_sources.draft_model).__name__, len(done.token_ids)
name, draft, tokens = asyncio.run(main())
print(json.dumps({'before': before, 'after': peak(), 'pass': name, 'draft': draft, 'tokens': tokens}))
"""


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory):
    """A random Qwen2 of Qwen2.5-0.5B's width, 12 layers, its projections, embedding and head in
    Q8_0, on the default model's tokenizer: ~290 MB."""
    import transformers as T

    config = T.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=12, num_attention_heads=14, num_key_value_heads=2,
                           vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("load-memory") / "qwen2-12.Q8_0.gguf"
    write_gguf(model, default_model_path(), path, types={"token_embd.weight": "Q8_0"})
    return path


def load_in_a_process(cache, **client) -> dict:
    """``Client(**client)`` started in a fresh process with ``cache`` as its cache folder, asked for
    a short answer: its peak resident memory before and after (``before``, ``after``), the target's
    pass, the draft model's kind and the tokens it answered with."""
    env = {**os.environ, "AGENTSPEC_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", LOAD, json.dumps(client)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_gguf_load_holds_about_the_file(qwen2_file, tmp_path):
    """A load peaks under 1.25 times the file plus 300 MB over the process before it, runs the
    integer block pass, answers, and writes nothing but kernels where the package has none for this CPU (no float32
    snapshot)."""
    try:
        block_kernels()
    except NotImplementedError as exc:  # no kernels for this CPU or no C compiler: the file is refused (test_gguf_model)
        pytest.skip(f"the block kernels do not run here: {exc}")
    size = qwen2_file.stat().st_size
    run = load_in_a_process(tmp_path, model=str(qwen2_file))
    assert run["pass"] == "gguf-q16" and run["tokens"] > 0, run
    grown = run["after"] - run["before"]
    assert grown < 1.25 * size + 300 * 2**20, (grown, size)
    assert {p.name for p in tmp_path.iterdir()} <= {"kernels"}  # at most kernels compiled here, nothing of the model
    print(f"file {size / 2**20:.0f} MiB: a load +{grown / 2**20:.0f} MiB")
