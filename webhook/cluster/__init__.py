"""Cluster facts from list+watch caches: nodes (runtime rules) and namespaces (labels). Never on the
request path: requests read the latest immutable snapshot."""
