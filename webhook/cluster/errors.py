"""What the cluster layer raises."""

from __future__ import annotations


class ClusterAccessError(RuntimeError):
    """No way to reach the cluster where one is required (no service account, no kubeconfig, bad credentials)."""


class EnsureError(RuntimeError):
    """The certificate and caBundle could not be brought in step (no webhook configuration, endless conflicts)."""


class Gone(Exception):
    """The resourceVersion we hold has been compacted away: relist."""
