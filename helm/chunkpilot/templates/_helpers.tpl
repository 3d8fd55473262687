{{/* Names and labels, as the prometheus-community charts do. */}}
{{- define "chunkpilot.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "chunkpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "chunkpilot.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "chunkpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component (operator | tuner): pass (dict "ctx" $ "component" "operator"). */}}
{{- define "chunkpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "chunkpilot.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "chunkpilot.image" -}}
{{- printf "%s/%s:%s" .ctx.Values.image.repository .component (default .ctx.Chart.AppVersion .ctx.Values.image.tag) -}}
{{- end -}}

{{/* Restricted Pod Security: the container half. */}}
{{- define "chunkpilot.containerSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
