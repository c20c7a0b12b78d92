"""``agentspec serve``: an OpenAI-compatible HTTP server over one embedded ``Client``.

Every request shares the client's engine (batched passes). Needs the ``serve`` extra
(``pip install 'agentspec-llm[serve]'``: Starlette and uvicorn)::

    from agentspec.serve import create_app, serve
    await serve(host="127.0.0.1", port=8000, api_key="...")     # until SIGINT/SIGTERM
    app = create_app(started_client, model_name="smollm2")     # or mount the ASGI app yourself

``wire`` is the request and response format; ``app`` the routes; ``run`` the uvicorn server.
"""

try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError as exc:
    raise ModuleNotFoundError(
        f"agentspec serve needs {exc.name}, which is not installed: pip install 'agentspec-llm[serve]'", name=exc.name
    ) from exc

from .app import create_app
from .run import serve

__all__ = ["create_app", "serve"]
