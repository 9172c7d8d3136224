"""A small certificate authority for the webhook's serving certificate (no HTTP, no Kubernetes)."""
