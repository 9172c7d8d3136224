# syntax=docker/dockerfile:1
# Two images: the webhook (default, last stage) and the image puller (`docker build --target puller .`).
# Dependencies are built in one stage and copied as a virtual environment into slim runtime stages
# with no compilers and no package manager caches.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY pyproject.toml README.md /src/
COPY webhook /src/webhook
COPY certs/__init__.py certs/authority.py /src/certs/
RUN /opt/venv/bin/pip install /src

# The image-puller image: the same package (for copilot-webhook-pull), the docker CLI and crictl.
FROM docker:27-cli AS docker-cli

FROM python:${PYTHON_VERSION}-slim AS puller
ARG CRICTL_VERSION=v1.31.1
ARG TARGETARCH=amd64
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl ca-certificates \
 && base="https://github.com/kubernetes-sigs/cri-tools/releases/download/${CRICTL_VERSION}" \
 && file="crictl-${CRICTL_VERSION}-linux-${TARGETARCH}.tar.gz" \
 && curl -fsSLo "/tmp/${file}" "${base}/${file}" \
 && curl -fsSLo "/tmp/${file}.sha256" "${base}/${file}.sha256" \
 && echo "$(cat /tmp/${file}.sha256)  /tmp/${file}" | sha256sum -c - \
 && tar -xzf "/tmp/${file}" -C /usr/local/bin crictl \
 && rm -f /tmp/crictl-* \
 && apt-get purge -y curl && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
COPY --from=docker-cli /usr/local/bin/docker /usr/local/bin/docker
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 DOCKER_CONFIG=/tmp/.docker
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
