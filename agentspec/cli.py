"""The ``agentspec`` command: ``demo``, ``chat``, ``bench``, ``serve`` and ``train-draft``; ``--version``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

from . import DISTRIBUTION, __version__
from .bench.workloads import WORKLOADS
from .client import Client
from .passes.weights import WEIGHTS
from .errors import AgentSpecError
from .types import Done, Limits, TextDelta

__all__ = ["main"]


async def _demo(args: Any) -> int:
    from .demo import run_demo

    print("Loading the default model (SmolLM2-135M-Instruct) ...", flush=True)
    started = time.perf_counter()
    async with Client(args.model, device=args.device, weights=args.weights) as client:
        weights = client.engine.weights
        kernels = f" on {weights.isa} kernels" if weights.isa else ""
        print(f"Ready in {time.perf_counter() - started:.1f} s: {client.loaded.name} on {client.loaded.device}, "
              f"target pass {weights.name}{kernels}. Streaming verified tokens as they arrive.\n")
        return 0 if await run_demo(client) else 1


async def _chat(args: Any) -> int:
    async with Client(args.model, device=args.device, weights=args.weights) as client:
        print("agentspec chat — empty line or Ctrl-D to quit.")
        history: list[dict[str, str]] = []
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, lambda: input("you> "))
            if not line.strip():
                return 0
            history.append({"role": "user", "content": line})
            reply: list[str] = []
            print("model> ", end="", flush=True)
            async for event in client.stream(history, max_tokens=args.max_tokens):
                if isinstance(event, TextDelta):
                    reply.append(event.text)
                    print(event.text, end="", flush=True)
                elif isinstance(event, Done):
                    print(f"\n  ({event.usage.completion_tokens} tokens, {event.stats.mean_accepted_length:.2f} tokens/pass)")
            history.append({"role": "assistant", "content": "".join(reply)})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentspec", description="Lossless speculative decoding for local agent LLMs.")
    parser.add_argument("--version", action="version", version=f"{DISTRIBUTION} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("demo", "stream three agent requests and compare them with plain decoding"), ("chat", "chat in the terminal"), ("bench", "benchmark against peers")):
        command = sub.add_parser(name, help=text)
        command.add_argument("--model", default=None, help="local folder, .gguf file or cached hub id (default: embedded SmolLM2-135M)")
        command.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
        command.add_argument("--weights", default="auto", choices=WEIGHTS, help="the target pass (auto: on a GGUF file with kernels for this CPU gguf-q16 by rule, else the fastest measured here)")
    sub.choices["chat"].add_argument("--max-tokens", type=int, default=256)
    bench = sub.choices["bench"]
    bench.add_argument("--workloads", default="", help=f"comma-separated subset of: {', '.join(w.name for w in WORKLOADS)}")
    bench.add_argument("--prompts", default=None, metavar="JSONL", help='your own requests instead: one {"name", "messages" or "prompt", "max_tokens", "params"} per line')
    bench.add_argument("--systems", default="", help="comma-separated: hf_plain, hf_prompt_lookup, outlines, agentspec_plain, agentspec, "
                       "or agentspec[S+...] drafting from sources S in grammar, ngram, suffix, model (default: peers, each source, all)")
    bench.add_argument("--draft", default=None, help="agentspec's model source: a draft model (a reference or early-exit:N), head:DIR, or none "
                       "(default: the draft head shipped for the model, if any)")
    bench.add_argument("--max-tokens", type=int, default=None, help="override each workload's max_tokens")
    bench.add_argument("--repeats", type=int, default=1, help="timed runs per cell (median reported)")
    bench.add_argument("--temperature", type=float, default=0.0, help="sample the agentspec rows at this temperature, seeded "
                       "(identical = token for token with agentspec plain); the greedy-only peers do not run")
    bench.add_argument("--concurrency", default=None, metavar="LEVELS", help="e.g. 1,2,4,8: concurrent requests per level; aggregate tok/s, TTFT, TPOT")
    bench.add_argument("--base-url", default=None, metavar="URL", help="also run agentspec's rows on this OpenAI-compatible server "
                       "(e.g. agentspec serve --prefix-cache-mb 0) and compare them with the embedded client's")
    bench.add_argument("--api-key", default=None, help="the --base-url server's API key (default: $AGENTSPEC_API_KEY)")
    bench.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    bench.add_argument("--plot", default=None, metavar="PNG", help="write the chart (needs matplotlib: pip install 'agentspec-llm[bench]')")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs: pip install 'agentspec-llm[serve]')")
    serve.add_argument("--model", default=None, help="local folder, .gguf file or cached hub id (default: embedded SmolLM2-135M)")
    serve.add_argument("--served-model-name", default=None, help="the model id callers send (default: the loaded model's name)")
    serve.add_argument("--draft", default=None, help="a draft model (a reference or early-exit:N), head:DIR, or none (default: the shipped head, if any)")
    serve.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    serve.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    serve.add_argument("--weights", default="auto", choices=WEIGHTS, help="the target pass (auto: on a GGUF file with kernels for this CPU gguf-q16 by rule, else the fastest measured here)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (the ready line names it)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require `Authorization: Bearer KEY` (repeatable: each key a tenant; default: $AGENTSPEC_API_KEY)")
    serve.add_argument("--api-keys-file", default=None, metavar="PATH", help="more keys, one a line ('#' starts a comment): each a tenant")
    serve.add_argument("--share-caches", action="store_true",
                       help="let all keys share the prefix cache and earlier outputs (default: each key's are its own)")
    serve.add_argument("--max-batch", type=int, default=Limits().max_batch, help="requests decoding at once, sharing each pass")
    serve.add_argument("--max-queued", type=int, default=Limits().max_queued, help="requests waiting or running before new ones get HTTP 429")
    serve.add_argument("--prefix-cache-mb", type=float, default=Limits().prefix_cache_mb, help="keys/values kept for prefix reuse, MiB (0: off)")
    serve.add_argument("--max-json-depth", type=int, default=Limits().max_json_depth, help="deepest nesting of a request body (lists and objects); deeper: HTTP 400")
    serve.add_argument("--max-json-values", type=int, default=Limits().max_json_values,
                       help="most JSON values (keys included) a request body may hold, counted before it is parsed; more: HTTP 400")
    serve.add_argument("--max-tags", type=int, default=Limits().max_tags, help="distinct request tags with metric series of their own; later ones count as '(other)'")
    serve.add_argument("--max-grammar-chars", type=int, default=Limits().max_grammar_chars,
                       help="longest regex a schema's or tools' grammar may compile to, bounded before it is built; longer: HTTP 400 grammar_too_large")
    serve.add_argument("--grammar-timeout-s", type=float, default=Limits().grammar_timeout_s, help="seconds a grammar may take to build (then HTTP 400 grammar_timeout)")
    serve.add_argument("--grammar-processes", type=int, default=2,
                       help="grammar indexes built at once, each in a child process killed at --grammar-timeout-s (0: on threads in the server)")
    serve.add_argument("--grammar-cache-mb", type=float, default=Limits().grammar_cache_mb, help="built grammars and their per-state masks kept for later requests, MiB")
    serve.add_argument("--template-timeout-s", type=float, default=Limits().template_timeout_s,
                       help="seconds rendering the chat template and tokenizing a prompt may take (then HTTP 400 template_timeout)")
    serve.add_argument("--shadow-rate", type=float, default=0.0, help="the most of a request's speculative.shadow_rate honoured (default 0: no shadow checks)")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="also answer requests with this Host header (repeatable; '*': any). Default: localhost, 127.0.0.1, [::1], the bound host")
    serve.add_argument("--allow-unauthenticated", action="store_true", help="serve a non-loopback --host without an API key (refused otherwise)")
    serve.add_argument("--limit-concurrency", type=int, default=None, help="open connections before new requests get HTTP 503 (default: --max-queued + 32)")
    serve.add_argument("--max-header-bytes", type=int, default=16 * 2**10, help="largest request line and headers (default 16 KiB)")
    serve.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle connection stays open")
    serve.add_argument("--body-timeout-s", type=float, default=30.0, help="seconds a request body may take to arrive (then HTTP 408)")
    serve.add_argument("--log-level", default="warning", help="uvicorn's log level")
    train = sub.add_parser("train-draft", help="train a draft head on the target's answers to your traffic")
    train.add_argument("--prompts", required=True, metavar="JSONL", help='requests, one {"messages", "tools"?, "tool_choice"?, "response_format"?, "max_tokens"?} per line')
    train.add_argument("--out", required=True, metavar="DIR", help="folder to write head.safetensors and head.json to; use it as Client(draft='head:DIR')")
    train.add_argument("--model", default=None, help="the target: local folder, .gguf file or cached hub id (default: embedded SmolLM2-135M)")
    train.add_argument("--epochs", type=int, default=4, help="passes over the training answers")
    train.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head can draft: the most frequent in the answers")
    train.add_argument("--held-out", type=float, default=0.1, help="share of requests held out to measure the head")
    train.add_argument("--concurrency", type=int, default=8, help="requests the target answers at once")
    train.add_argument("--samples", type=int, default=1, help="answers per request: one greedy, the others sampled (more training text)")
    train.add_argument("--seed", type=int, default=0)
    return parser


def _train_draft(args: Any) -> int:
    from .drafting.train import train_draft_head

    report = train_draft_head(
        args.prompts, args.out, model=args.model, epochs=args.epochs, draft_vocab=args.draft_vocab,
        held_out=args.held_out, concurrency=args.concurrency, samples=args.samples, seed=args.seed,
    )  # fmt: skip
    print(json.dumps(dataclasses.asdict(report), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "train-draft":  # blocking, with its own event loop
        try:
            return _train_draft(args)
        except AgentSpecError as exc:
            print(f"agentspec: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    if args.command == "demo":
        runner = _demo
    elif args.command == "chat":
        runner = _chat
    elif args.command == "serve":
        try:
            from .serve.run import main as runner
        except ModuleNotFoundError as exc:
            print(f"agentspec: {exc}", file=sys.stderr)
            return 1
    else:
        from .bench.cli import main as runner
    try:
        return asyncio.run(runner(args))
    except AgentSpecError as exc:
        print(f"agentspec: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, EOFError):
        return 130


if __name__ == "__main__":
    sys.exit(main())
