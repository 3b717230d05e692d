"""The HTTP gateway, ``prefillq serve``: an ASGI app (FastAPI, served by uvicorn) over
`jobs.aio.AsyncPrefillClient`. Installed with ``pip install 'prefillq[gateway]'``; it never
imports MLX.

- native jobs API (`jobs.gateway.native`): ``/v1/prefill`` submit, status, result, cancel,
  Server-Sent Events, and ``/v1/models``;
- OpenAI-compatible scoring (`jobs.gateway.completions`): ``POST /v1/completions`` with
  ``echo``, ``logprobs`` and ``max_tokens`` of 0 or 1;
- tokenizer endpoints (`jobs.gateway.tokenize`): ``/tokenize``, ``/detokenize``,
  ``/tokenizer_info``;
- ``/health`` and ``/metrics`` (`jobs.gateway.observe`).

Errors are JSON, ``{"error": {"message", "type", "code"}}`` (`jobs.gateway.errors`).
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    # lazy: `prefillq`'s parser imports `jobs.gateway.serve` on installs without the extra
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
