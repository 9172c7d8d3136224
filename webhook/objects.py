"""Names for the kinds of Kubernetes object the webhook reads and writes, as JSON decodes them.

Aliases of a JSON object, not TypedDicts: every object arrives in a request or from the API server and is
read defensively (a field may be missing or of the wrong type, and the code says which), so its type stays
a JSON object; the name says which kind a function takes or returns. A leaf: it imports nothing of ours.
"""

from __future__ import annotations

from typing import Any, TypeAlias

JSONObject: TypeAlias = dict[str, Any]
"""Any JSON object; the names below say which kind."""

Pod: TypeAlias = JSONObject
"""core/v1 Pod."""
ObjectMeta: TypeAlias = JSONObject
"""meta/v1 ObjectMeta: a Pod's, Node's or Namespace's metadata."""
PodSpec: TypeAlias = JSONObject
"""core/v1 PodSpec."""
Container: TypeAlias = JSONObject
"""core/v1 Container (regular, init or ephemeral), or a part of one."""
Volume: TypeAlias = JSONObject
"""core/v1 Volume."""
NodeSelectorTerm: TypeAlias = JSONObject
"""core/v1 NodeSelectorTerm (of a required node affinity)."""
Node: TypeAlias = JSONObject
"""core/v1 Node, or the little of one a Table row carries."""
Namespace: TypeAlias = JSONObject
"""core/v1 Namespace."""
TableRow: TypeAlias = JSONObject
"""meta/v1 TableRow: the cells and the object's metadata (the node cache lists Nodes as a Table)."""
ListPage: TypeAlias = JSONObject
"""One page of a list: a List of items, or a meta/v1 Table of rows."""
WatchEvent: TypeAlias = JSONObject
"""meta/v1 WatchEvent's object: an item, a Table of one row, or a Status."""
WebhookConfiguration: TypeAlias = JSONObject
"""admissionregistration/v1 MutatingWebhookConfiguration."""
MutatingWebhook: TypeAlias = JSONObject
"""admissionregistration/v1 MutatingWebhook: one webhook of the configuration."""
PatchOperation: TypeAlias = JSONObject
"""An RFC 6902 JSON Patch operation."""
AdmissionReview: TypeAlias = JSONObject
"""admission.k8s.io/v1 AdmissionReview: a request the API server sends, or its response."""
