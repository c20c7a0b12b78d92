"""The GGUF snapshot: the first load of a ``.gguf``'s float32 model (``LoadedModel.model``, on
demand) writes it as safetensors, and later loads read it — the same tensors bit for bit, the same
tokenizer and chat encoding, the same stops. Loading the file itself (``module``) writes nothing."""

from __future__ import annotations

import time

import pytest
import torch

from agentspec.model import CACHE_ENV, LoadedModel, default_model_path, read_model, snapshot_path

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich? 東京 too."},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Thanks!"},
]


def assert_same_model(a: LoadedModel, b: LoadedModel) -> None:
    first, second = a.model.state_dict(), b.model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first), "a weight differs"
    assert (a.model.lm_head.weight.data_ptr() == a.model.model.embed_tokens.weight.data_ptr()) == (
        b.model.lm_head.weight.data_ptr() == b.model.model.embed_tokens.weight.data_ptr()
    ), "the LM head's tie to the embeddings changed"
    assert a.chat.encode(MESSAGES) == b.chat.encode(MESSAGES)
    assert (a.name, a.stop_token_ids, a.context_window, a.token_bytes) == (b.name, b.stop_token_ids, b.context_window, b.token_bytes)


def test_snapshot_is_written_once_and_loads_the_same_model(loaded: LoadedModel, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    where = snapshot_path(default_model_path(), torch.float32)
    assert where is not None and where.parent == tmp_path and not where.exists()

    from_gguf = read_model(None, torch.device("cpu"), torch.float32)
    assert not where.exists()  # the file is the model: nothing dequantised, nothing written
    assert from_gguf.module.get_output_embeddings().weight.device.type == "meta"
    assert from_gguf.model is not None  # the float32 model: no snapshot here yet, so read from the GGUF, writing one
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in where.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == [where.name]  # no partial folder left behind
    assert_same_model(from_gguf, loaded)  # the session's model (read from either) is the same

    started = time.perf_counter()
    from_snapshot = read_model(None, torch.device("cpu"), torch.float32)
    from_snapshot.model
    seconds = time.perf_counter() - started
    assert_same_model(from_snapshot, from_gguf)
    assert "gguf" not in from_snapshot.model.config.to_dict().get("quantization_config", {}).get("quant_method", "")
    print(f"load from the snapshot: {seconds:.1f} s")


def test_snapshot_key_and_switch(tmp_path, monkeypatch):
    gguf = default_model_path()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert snapshot_path(gguf, torch.float32) != snapshot_path(gguf, torch.bfloat16)  # a snapshot holds one dtype
    copy = tmp_path / gguf.name
    copy.write_bytes(gguf.read_bytes()[:1024])  # another file of the same name
    assert snapshot_path(copy, torch.float32) != snapshot_path(gguf, torch.float32)
    monkeypatch.setenv(CACHE_ENV, "off")
    assert snapshot_path(gguf, torch.float32) is None


def test_unwritable_cache_still_loads(tmp_path, monkeypatch, caplog):
    pytest.importorskip("gguf")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "models"))  # a file where the folder would be
    loaded = read_model(None, torch.device("cpu"), torch.float32)
    assert "could not write" not in caplog.text  # the file alone writes nothing
    assert loaded.model is not None and "could not write the model snapshot" in caplog.text
