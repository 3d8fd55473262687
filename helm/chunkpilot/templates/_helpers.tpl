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
{{- $repo := required "image.repository is empty: build the operator, tuner and engine images (docs/helm.md), push them to your registry, and install with --set image.repository=<registry>/<path>" .ctx.Values.image.repository -}}
{{- printf "%s/%s:%s" $repo .component (default .ctx.Chart.AppVersion .ctx.Values.image.tag) -}}
{{- end -}}

{{/* The Prometheus the tuner reads: tuner.prometheusUrl, else the Prometheus Operator's Service in
monitoring.prometheus.namespace (the one value that also admits Prometheus to the engines). */}}
{{- define "chunkpilot.prometheusUrl" -}}
{{- .Values.tuner.prometheusUrl | default (printf "http://prometheus-operated.%s.svc:9090" .Values.monitoring.prometheus.namespace) -}}
{{- end -}}

{{/* Labels every ServiceMonitor and PrometheusRule carries so that the admin's Prometheus selects it:
kube-prometheus-stack's release label, then the admin's own. Pass the extra labels as "labels". */}}
{{- define "chunkpilot.monitorLabels" -}}
{{- $labels := deepCopy (default (dict) .labels) }}
{{- with .ctx.Values.monitoring.prometheus.release }}
{{- $_ := set $labels "release" (get $labels "release" | default .) }}
{{- end }}
{{- with $labels }}{{ toYaml . }}{{ end }}
{{- end -}}

{{/* Refusals of values the schema cannot express, each naming the value to change. */}}
{{- define "chunkpilot.validate" -}}
{{- range $component := list "operator" "tuner" }}
{{- range (index $.Values $component).watchNamespaces }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .) }}
{{- fail (printf "%s.watchNamespaces: %q is not a namespace name; list exact names (wildcards cannot be granted by RoleBindings), or leave the list empty to watch all namespaces" $component .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.tuner.enabled (gt (int .Values.tuner.replicas) 1) (not .Values.tuner.study.existingSecret) }}
{{- fail "tuner.replicas > 1 needs tuner.study.existingSecret (a database URL): the default SQLite study sits on a ReadWriteOnce volume with room for one writer" }}
{{- end }}
{{- end -}}

{{/* The pod half of restricted Pod Security; the user and group come from podSecurityContext (null: the
platform's). Pass (dict "ctx" $ "fsGroup" true) for pods with volumes to own. */}}
{{- define "chunkpilot.podSecurity" -}}
runAsNonRoot: true
{{- with .ctx.Values.podSecurityContext.runAsUser }}
runAsUser: {{ . }}
{{- end }}
{{- if .fsGroup }}
{{- with .ctx.Values.podSecurityContext.fsGroup }}
fsGroup: {{ . }}
{{- end }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Restricted Pod Security: the container half. */}}
{{- define "chunkpilot.containerSecurity" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
