"""The HTTP gateway, ``prefillq serve``: an ASGI app (FastAPI, served by uvicorn) over
`jobs.aio.AsyncPrefillClient`. Installed with ``pip install 'prefillq[gateway]'``; it never
imports MLX. One module per API: `native`, `completions`, `tokenize`, `observe` (``/health``,
``/metrics``); errors are JSON (`jobs.gateway.errors`). docs/gateway.md describes the API.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    # lazy: `prefillq`'s parser imports `jobs.gateway.serve` on installs without the extra
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
