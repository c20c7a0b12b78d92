"""Structured extraction with the raw ``agentspec.Client``: contact details from an e-mail signature.

    python examples/extraction.py

``response_format=Contact`` compiles the pydantic model's JSON schema into a grammar, so the output
always parses and validates. It is also what makes it fast: the grammar forces the JSON syntax
(``{"name":"``...), and the values are copied from the prompt, which the n-gram drafter proposes;
both are verified in blocks instead of one target forward pass per token.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

import agentspec

EMAIL = """\
Hi team, the signed contract is attached. Let me know if anything is missing.

Best regards,
Maria Gonzalez
Head of Procurement, Northwind Traders
maria.gonzalez@northwind.example | +1 555 0100
"""


class Contact(BaseModel):
    name: str
    email: str
    company: str


MESSAGES = [
    {"role": "system", "content": "Extract the sender's contact details from the e-mail as JSON."},
    {"role": "user", "content": EMAIL},
]


async def main(max_tokens: int = 96, client: agentspec.Client | None = None) -> agentspec.Completion:
    """Extract a ``Contact``; pass a started ``client`` to reuse it, else the embedded model is loaded."""
    if client is None:
        async with agentspec.Client() as own:
            return await main(max_tokens, own)
    done = await client.generate(MESSAGES, response_format=Contact, max_tokens=max_tokens)
    print(done.parsed if done.parsed is not None else f"(cut short: {done.text!r})")
    stats = done.stats
    print(
        f"{stats.output_tokens} tokens in {stats.target_forward_passes} target passes "
        f"({stats.target_forward_passes_saved} saved); acceptance {stats.acceptance_rate:.0%} "
        f"by source {stats.accepted_by_source}"
    )
    return done


if __name__ == "__main__":
    asyncio.run(main())
