# syntax=docker/dockerfile:1
# Two images: the webhook (default, last stage) and the image puller (`docker build --target puller .`).
# Dependencies are built in one stage and copied as a virtual environment into slim runtime stages
# with no compilers and no package manager caches.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv && python -m venv /opt/puller
COPY pyproject.toml README.md /src/
COPY webhook /src/webhook
COPY certs /src/certs
RUN /opt/venv/bin/pip install /src \
 && /opt/puller/bin/pip install "/src[puller]"

# containerd's own client, from Debian's package, for registries only the pod network reaches.
FROM python:${PYTHON_VERSION}-slim AS ctr
RUN apt-get update && apt-get install -y --no-install-recommends containerd && rm -rf /var/lib/apt/lists/*

# The image-puller image: the package with grpcio (the CRI client; the Docker Engine API needs nothing
# more than the standard library) and ctr. No docker CLI, no crictl.
FROM python:${PYTHON_VERSION}-slim AS puller
COPY --from=ctr /usr/bin/ctr /usr/bin/ctr
COPY --from=build /opt/puller /opt/puller
ENV PATH=/opt/puller/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="copilot-webhook image puller"
# The pod spec runs it as root (runAsUser: 0) because the runtime socket is root's; nothing else is granted.
ENTRYPOINT ["copilot-webhook-pull"]

# The webhook image, last so that a plain `docker build .` builds it.
FROM python:${PYTHON_VERSION}-slim AS webhook
LABEL org.opencontainers.image.title="copilot-webhook" \
      org.opencontainers.image.description="Mutating admission webhook: Flyte copilot SYS_PTRACE policy" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# A numeric user, so Kubernetes can check runAsNonRoot without a passwd lookup.
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["copilot-webhook"]
CMD ["serve", "--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key"]
