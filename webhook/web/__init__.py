"""The web server: the admission protocol every connection speaks (admission, with limits and reading), the
ASGI application (server), stock uvicorn behind it for the human API (relay), the FastAPI part for /preview
and the docs (api), the reloading TLS context (tls), the process that runs them (serve) and its Prometheus
metrics (metrics)."""
