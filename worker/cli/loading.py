"""Model loading for the worker-side commands, reported on stderr as it happens."""

from __future__ import annotations

import sys

from jobs.cli import CLIError


def device_summary() -> str:
    """``gpu`` or ``cpu, N streams`` (`model.runtime.streams.cpu_streams`)."""
    import mlx.core as mx

    from model.runtime.streams import cpu_streams

    if mx.default_device() == mx.gpu:
        return "gpu"
    n = cpu_streams()
    return f"cpu, {n} stream{'' if n == 1 else 's'}"


def load_models(specs: list[str], context_length: int | None) -> dict:
    """Load each model spec (registry name or ``NAME=/path.gguf``); returns them by name.

    Raises:
        CLIError: a spec the registry does not know.
    """
    from model.registry import ModelNotFound, load_model
    from model.runtime.blas import blas_summary

    print(f"BLAS: {blas_summary()}", file=sys.stderr, flush=True)
    models = {}
    for spec in specs:
        print(f"loading {spec} ...", file=sys.stderr, flush=True)
        try:
            loaded = load_model(spec, context_length=context_length)
        except ModelNotFound as e:
            raise CLIError(str(e.args[0])) from e
        print(
            f"loaded {loaded.name} ({loaded.architecture}, {loaded.dtype}, "
            f"context {loaded.context_length}) in {loaded.load_seconds:.1f} s "
            f"on {device_summary()}",
            file=sys.stderr,
            flush=True,
        )
        models[loaded.name] = loaded
    return models
