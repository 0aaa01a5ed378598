# One image, both binaries: `sluice-proxy` (the data plane) and `sluice` (controller, CLI).
#   docker build -t sluice .
#   docker run --rm -p 8080:8080 sluice sluice-proxy --redis redis://redis:6379 --service llm \
#       --admin-host 0.0.0.0
#   docker run --rm sluice sluice controller --redis redis://redis:6379
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY controlplane ./controlplane
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 10001 sluice

USER 10001
WORKDIR /home/sluice
# 8080: the proxy; 9090: the proxy's admin listener (/healthz /readyz /metrics /snapshot).
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:9090/healthz', timeout=2); sys.exit(0)"]
ENTRYPOINT []
CMD ["sluice-proxy", "--help"]
