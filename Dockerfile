# One image, both binaries: `sluice-proxy` (the data plane) and `sluice` (controller, CLI).
#   docker build -t sluice .
#   docker run --rm -p 8080:8080 sluice sluice-proxy --redis redis://redis:6379 --service llm \
#       --admin-host 0.0.0.0
#   docker run --rm sluice sluice controller --redis redis://redis:6379
#
# Build args (both optional):
#   BASE_IMAGE  the image to build on; it needs python3 (>= 3.11) with the venv module.
#               Default: the official slim Python image.
#   WHEELHOUSE  a directory of wheels inside the build context; when given, pip installs
#               from it only (--no-index), so the build needs no network. Default: empty,
#               an ordinary install from the package index.
# Either way pip installs the versions pinned in requirements/ci.txt (pip -c).
# tests/image/test_image.sh builds it offline this way and runs it.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG WHEELHOUSE=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/ci.txt ./requirements/ci.txt
COPY proxy ./proxy
COPY controlplane ./controlplane
# Without a wheelhouse this copies requirements/ (two small files) and nothing uses it.
COPY ${WHEELHOUSE:-requirements} /wheelhouse/
RUN python3 -m venv /opt/sluice \
    && if [ -n "${WHEELHOUSE}" ]; then \
           /opt/sluice/bin/pip install --no-cache-dir --no-index --find-links /wheelhouse \
               -c requirements/ci.txt . ; \
       else \
           /opt/sluice/bin/pip install --no-cache-dir -c requirements/ci.txt . ; \
       fi

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/sluice/bin:${PATH} \
    SLUICE_PROXY_ADMIN_PORT=9090
COPY --from=build /opt/sluice /opt/sluice
RUN useradd --create-home --uid 10001 sluice

USER 10001
WORKDIR /home/sluice
# 8080: the proxy; 9090: the proxy's admin listener (/healthz /readyz /metrics /snapshot).
# The admin port is set by SLUICE_PROXY_ADMIN_PORT (read by sluice-proxy and by the
# health check alike): change it with `-e SLUICE_PROXY_ADMIN_PORT=...`, not --admin-port.
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['SLUICE_PROXY_ADMIN_PORT'], timeout=2)"]
ENTRYPOINT []
CMD ["sluice-proxy", "--help"]
