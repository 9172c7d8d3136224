# syntax=docker/dockerfile:1
# The webhook image: dependencies built in one stage, copied as a virtual environment into a slim,
# non-root runtime stage with no compilers and no package manager caches.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY pyproject.toml README.md /src/
COPY webhook /src/webhook
COPY certs/__init__.py certs/authority.py /src/certs/
RUN /opt/venv/bin/pip install /src

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
