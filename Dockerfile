# Two images: the webhook (default, last stage) and the image puller (`docker build --target puller .`).
# Dependencies are installed in one stage and copied as virtual environments into the runtime stages,
# with no compilers and no package manager caches.
#
# BASE is any Debian-based image with python3 (3.11) and its venv module: python:3.11-slim by default.
# Where public images cannot be pulled, CI builds a stand-in from Debian's packages (mmdebstrap, then
# `docker import`) and installs wheels built beforehand: --build-arg PIP_INSTALL_OPTIONS="--no-index
# --find-links=/src/wheels" with them in ./wheels (harness/image_builds.py).

ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG PIP_INSTALL_OPTIONS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
# The puller's environment holds the package without its server dependencies, and grpcio (the `puller`
# extra of pyproject.toml): the puller imports the standard library and grpcio only.
# Every version is the one requirements/images.lock pins.
RUN python3 -m venv /opt/venv && python3 -m venv /opt/puller \
 && /opt/venv/bin/pip install ${PIP_INSTALL_OPTIONS} -c /src/requirements/images.lock /src \
 && /opt/puller/bin/pip install ${PIP_INSTALL_OPTIONS} --no-deps /src \
 && /opt/puller/bin/pip install ${PIP_INSTALL_OPTIONS} -c /src/requirements/images.lock "grpcio>=1.60"

# containerd's own client, from Debian's package, for registries only the pod network reaches.
FROM ${BASE} AS ctr
RUN apt-get update && apt-get install -y --no-install-recommends containerd && rm -rf /var/lib/apt/lists/*

# The image-puller image: the package with grpcio (the CRI client; the Docker Engine API needs nothing
# more than the standard library) and ctr. No docker CLI, no crictl.
FROM ${BASE} AS puller
COPY --from=ctr /usr/bin/ctr /usr/bin/ctr
COPY --from=build /opt/puller /opt/puller
ENV PATH=/opt/puller/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="copilot-webhook image puller"
# The pod spec runs it as root (runAsUser: 0) because the runtime socket is root's; nothing else is granted.
ENTRYPOINT ["copilot-webhook-pull"]

# The webhook image, last so that a plain `docker build .` builds it.
FROM ${BASE} AS webhook
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
