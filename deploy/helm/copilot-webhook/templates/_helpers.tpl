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
