{{/* The name in app.kubernetes.io/name: nameOverride, else the chart's. */}}
{{- define "cw.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The name of every object the chart renders (with a suffix where there are several of a kind): the Service,
     the webhook configuration, the TLS Secret, the certificate's DNS names and the server's --service and
     --webhook-config all derive from it, so they agree whatever the overrides. fullnameOverride, else
     <release>-<name>, or the release name alone when it already holds the name. */}}
{{- define "cw.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "cw.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "cw.labels" -}}
app.kubernetes.io/name: {{ include "cw.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cw.selector" -}}
app.kubernetes.io/name: {{ include "cw.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* A Job's name: at most 63 characters (the Job controller puts it in a label of its pods), so the
     fullname is cut to leave room for the suffix. Takes (dict "context" $ "suffix" "unregister"). */}}
{{- define "cw.jobName" -}}
{{- printf "%s-%s" (include "cw.fullname" .context | trunc (int (sub 62 (len .suffix))) | trimSuffix "-") .suffix -}}
{{- end -}}

{{/* `helm upgrade --reuse-values` renders with the values of the chart a release was installed with, which
     may predate a key: "cw.value" gives values.yaml's default for a missing one. Takes (dict "context" $
     "key" "revisionHistoryLimit" "default" 5). */}}
{{- define "cw.value" -}}
{{- toJson (ternary (index .context.Values .key) .default (hasKey .context.Values .key)) -}}
{{- end -}}

{{/* The pod security context of every pod the chart runs: non-root with RuntimeDefault seccomp always
     (Pod Security "restricted"); the user and groups from podSecurityContext, whose schema admits only
     those. */}}
{{- define "cw.podSecurityContext" -}}
{{- $own := include "cw.value" (dict "context" . "key" "podSecurityContext" "default" (dict "runAsUser" 65532 "runAsGroup" 65532 "fsGroup" 65532)) | fromJson -}}
{{- toYaml (merge (dict "runAsNonRoot" true "seccompProfile" (dict "type" "RuntimeDefault")) $own) -}}
{{- end -}}

{{/* The webhook pods' spread: the chart's soft spread over nodes and zones, where a constraint of
     topologySpreadConstraints on the same topologyKey replaces the chart's; the user's constraints follow.
     One without a labelSelector selects the webhook's own pods. */}}
{{- define "cw.topologySpreadConstraints" -}}
{{- $selector := dict "matchLabels" (include "cw.selector" . | fromYaml) -}}
{{- $own := list -}}
{{- range .Values.topologySpreadConstraints -}}
{{- $own = append $own .topologyKey -}}
{{- end -}}
{{- $constraints := list -}}
{{- range list "kubernetes.io/hostname" "topology.kubernetes.io/zone" -}}
{{- if not (has . $own) -}}
{{- $constraints = append $constraints (dict "maxSkew" 1 "topologyKey" . "whenUnsatisfiable" "ScheduleAnyway") -}}
{{- end -}}
{{- end -}}
{{- range .Values.topologySpreadConstraints -}}
{{- $constraints = append $constraints (deepCopy .) -}}
{{- end -}}
{{- range $constraints -}}
{{- if not .labelSelector -}}
{{- $_ := set . "labelSelector" $selector -}}
{{- end -}}
{{- end -}}
{{- toYaml $constraints -}}
{{- end -}}

{{/* Labels of a hook's pod (helm test's verify, uninstall's unregister): the release's, never the webhook's
     selector, so the Service does not route admission to it, the disruption budget does not count it and
     the webhook's NetworkPolicy does not hold it (the hooks' own policy does). Takes (dict "context" $
     "component" "test"). Like the server's own pods, they are never sent to the webhook (its objectSelector). */}}
{{- define "cw.hookPodLabels" -}}
app.kubernetes.io/name: {{ printf "%s-%s" (include "cw.name" .context) .component }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/component: {{ .component }}
copilot-webhook.io/webhook-release: {{ include "cw.fullname" .context }}
{{- end -}}

{{/* The Secret holding the serving certificate: managed by the server, cert-manager, or the user. */}}
{{- define "cw.tlsSecret" -}}
{{- if eq .Values.tls.mode "secret" -}}
{{- required "tls.secretName is required when tls.mode is secret" .Values.tls.secretName -}}
{{- else -}}
{{- printf "%s-tls" (include "cw.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "cw.matchConditions" -}}
{{- $mc := .Values.webhook.matchConditions -}}
{{- if eq (toString $mc) "auto" -}}
{{- semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version -}}
{{- else -}}
{{- eq (toString $mc) "true" -}}
{{- end -}}
{{- end -}}

{{/* Pod Security "restricted", and a read-only root filesystem. */}}
{{- define "cw.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
readOnlyRootFilesystem: true
runAsNonRoot: true
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The puller's image where the values give none: the image-puller of the chart's own version, never older
than the templates that inject it. */}}
{{- define "cw.pullerImage" -}}
{{- printf "ghcr.io/copilot-webhook/image-puller:%s" .Chart.AppVersion -}}
{{- end -}}

{{/* The image, pinned by digest when one is given. */}}
{{- define "cw.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The failure policy each webhook is declared with, as JSON: {"<webhook name>": "Ignore"|"Fail"}. */}}
{{- define "cw.policies" -}}
{{- $policies := dict "ptrace.copilot-webhook.io" (.Values.webhook.ptrace.failurePolicy | default .Values.webhook.failurePolicy) -}}
{{- if .Values.imagePuller.enabled -}}
{{- $_ := set $policies "image-puller.copilot-webhook.io" (.Values.webhook.imagePuller.failurePolicy | default .Values.webhook.failurePolicy) -}}
{{- end -}}
{{- toJson $policies -}}
{{- end -}}

{{/* "true" when any webhook fails closed. */}}
{{- define "cw.anyFail" -}}
{{- has "Fail" (values (include "cw.policies" . | fromJson)) -}}
{{- end -}}

{{/* The caBundle to render: given (secret mode), or the one already in the cluster (kept across upgrades:
     the server or cert-manager's injector wrote it). "" on a fresh install or without cluster access. */}}
{{- define "cw.caBundle" -}}
{{- if eq .Values.tls.mode "secret" -}}
{{- required "tls.caBundle is required when tls.mode is secret" .Values.tls.caBundle -}}
{{- else -}}
{{- with (lookup "admissionregistration.k8s.io/v1" "MutatingWebhookConfiguration" "" (include "cw.fullname" .)) -}}
{{- (index (.webhooks | default (list dict)) 0).clientConfig.caBundle | default "" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A copilot container in CEL, clause for clause what the server's copilot_role() accepts: a copilot name
     (prefix + role) and Flyte's command or image. Globs become anchored regular expressions. */}}
{{- define "cw.celCopilot" -}}
{{- $names := list -}}
{{- range list "downloader" "uploader" "sidecar" -}}
{{- $names = append $names (printf "%s%s" $.Values.copilot.namePrefix .) -}}
{{- end -}}
{{- $globs := list -}}
{{- range .Values.copilot.imagePatterns -}}
{{- $globs = append $globs (regexQuoteMeta . | replace "\\*" ".*" | replace "\\?" ".") -}}
{{- end -}}
c.name in {{ toJson $names }} && ((has(c.command) && size(c.command) > 0 && c.command[0] in {{ toJson .Values.copilot.commands }})
{{- if $globs }} || (has(c.image) && c.image.matches({{ printf "^(?:%s)$" (join "|" $globs) | toJson }})){{ end }})
{{- end -}}

{{/* A Flyte-owned pod in CEL: what the server's flyte_owned() reads, clause for clause. */}}
{{- define "cw.celFlyteOwned" -}}
(has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, (r.apiVersion.startsWith('flyte.lyft.com/') && r.kind in ['flyteworkflow', 'FlyteWorkflow']) || (r.apiVersion.startsWith('flyte.org/') && r.kind == 'TaskAction'))) || (has(object.metadata.labels) && 'execution-id' in object.metadata.labels && 'node-id' in object.metadata.labels)
{{- end -}}

{{/* Namespaces never sent to the webhook: the control plane's own and ours, whatever excludeNamespaces says. */}}
{{/* The namespaces served, as the server's own check reads copilot-webhook.io/inject (webhook/mutation/vocabulary.py):
     opt-out serves every namespace not switched off (disabled, false); opt-in only those switched on (enabled, true).
     `inject` defaults to opt-out where --reuse-values keeps the values of a chart that predates it. */}}
{{- define "cw.injectSelector" -}}
- key: copilot-webhook.io/inject
{{- if eq (.Values.inject | default "opt-out") "opt-in" }}
  operator: In
  values: [enabled, "true"]
{{- else }}
  operator: NotIn
  values: [disabled, "false"]
{{- end }}
{{- end -}}

{{- define "cw.excludedNamespaces" -}}
{{- toJson (concat (list "kube-system" "kube-public" "kube-node-lease") .Values.webhook.excludeNamespaces (list .Release.Namespace) | uniq) -}}
{{- end -}}

{{/* The preStop pause in seconds: preStopSeconds, or drainSeconds, its former name, when an install still
     sets it (or --reuse-values keeps it from the values of an older chart). */}}
{{- define "cw.preStopSeconds" -}}
{{- if hasKey .Values "drainSeconds" -}}
{{- int .Values.drainSeconds -}}
{{- else -}}
{{- include "cw.value" (dict "context" . "key" "preStopSeconds" "default" 5) | int -}}
{{- end -}}
{{- end -}}

{{/* "true" when the node agent is rendered: the image puller on, in mode agent. --reuse-values of a release
     installed by an older chart keeps that chart's values, which lack the agent's: refused by name. */}}
{{- define "cw.agentMode" -}}
{{- $on := and .Values.imagePuller.enabled (eq (toString (.Values.imagePuller.mode | default "socket")) "agent") -}}
{{- if and $on (not (and .Values.nodeAgent .Values.imagePuller.agent)) -}}
{{- fail "imagePuller.mode agent needs this chart's imagePuller.agent and nodeAgent values, which --reuse-values took from an older chart: upgrade with --reset-then-reuse-values" -}}
{{- end -}}
{{- $on -}}
{{- end -}}

{{/* The name of the agent's DaemonSet, Service, ServiceAccount and roles: FULLNAME-agent, at most 63
     characters (a Service's name is a DNS label). */}}
{{- define "cw.agentName" -}}
{{- include "cw.jobName" (dict "context" . "suffix" "agent") -}}
{{- end -}}

{{/* The agent's pod labels its Service and DaemonSet select on: a name of its own, so the webhook's
     Service, disruption budget and NetworkPolicy never hold an agent pod and the agent's never a webhook's. */}}
{{- define "cw.agentSelector" -}}
app.kubernetes.io/name: {{ printf "%s-agent" (include "cw.name" .) }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The DNS names of the agent's Service, which the webhook's serving certificate also carries (the agent
     serves it), as JSON: the first is the one imagePuller.agent.address names by default. */}}
{{- define "cw.agentDNSNames" -}}
{{- $host := printf "%s.%s.svc" (include "cw.agentName" .) .Release.Namespace -}}
{{- toJson (list $host (printf "%s.cluster.local" $host)) -}}
{{- end -}}
