{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "kvpool.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name of every object; the release name alone when it already contains the chart name. */}}
{{- define "kvpool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the server pods; never change them on a live release (immutable selector). */}}
{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpool.labels" -}}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Names of the two Services. */}}
{{- define "kvpool.headlessName" -}}
{{- include "kvpool.fullname" . -}}
{{- end -}}
{{- define "kvpool.metricsName" -}}
{{- printf "%s-metrics" (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
One flag value as the server parses it. Helm reads every YAML number as float64, which prints
4294967296 as 4.294967296e+09; whole numbers are printed as integers, fractions as they are.
*/}}
{{- define "kvpool.flagValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq (float64 (int64 .)) . -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* Seconds Kubernetes waits before SIGKILL: preStop sleep + server drain (rounded up) + margin. */}}
{{- define "kvpool.terminationGracePeriodSeconds" -}}
{{- $drain := div (add (int64 .Values.flags.shutdown_grace_ms) 999) 1000 -}}
{{- add (int64 .Values.preStopSleepSeconds) $drain (int64 .Values.terminationGraceMarginSeconds) -}}
{{- end -}}
