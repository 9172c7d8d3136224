"""copilot-webhook: a Kubernetes mutating admission webhook for Flyte copilot pods."""

__version__ = "0.1.0"
