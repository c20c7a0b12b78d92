"""examples/extraction.py: a pydantic response_format extracts fields copied from the prompt."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import agentspec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "extraction.py"


def load_example():
    spec = importlib.util.spec_from_file_location("extraction_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_extraction_example(client: agentspec.Client, capsys) -> None:
    example = load_example()
    done = await example.main(max_tokens=96, client=client)
    contact = done.parsed
    assert isinstance(contact, example.Contact), done.text  # finished inside max_tokens and validated
    assert example.Contact.model_validate_json(done.text) == contact
    assert contact.email == "maria.gonzalez@northwind.example"
    assert contact.name and contact.name in example.EMAIL  # taken from the prompt, not invented
    assert contact.company and contact.company in example.EMAIL
    assert done.stats.target_forward_passes < done.stats.output_tokens  # drafts were accepted
    assert "target passes" in capsys.readouterr().out
