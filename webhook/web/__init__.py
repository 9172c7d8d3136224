"""The web server: the ASGI application (server), the FastAPI part for /preview and the docs (api), uvicorn's
connections under limits (connections), the reloading TLS context (tls), the process that runs them (serve)
and its Prometheus metrics (metrics)."""
