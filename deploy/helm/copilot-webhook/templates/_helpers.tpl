{{- define "cw.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cw.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cw.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of a hook's pod (helm test's verify, uninstall's unregister): the release's, never the webhook's
     selector, so the Service does not route admission to it, the disruption budget does not count it and
     the webhook's NetworkPolicy does not hold it (the hooks' own policy does). Takes (dict "context" $
     "component" "test"). Like the server's own pods, they are never sent to the webhook (its objectSelector). */}}
{{- define "cw.hookPodLabels" -}}
app.kubernetes.io/name: {{ printf "%s-%s" .context.Chart.Name .component }}
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
{{- define "cw.excludedNamespaces" -}}
{{- toJson (concat (list "kube-system" "kube-public" "kube-node-lease") .Values.webhook.excludeNamespaces (list .Release.Namespace) | uniq) -}}
{{- end -}}
