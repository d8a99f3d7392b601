{{/* The name of every object of the release; ClusterRoles are cluster-wide, so it includes the release. */}}
{{- define "kvpilot.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains "kvpilot" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvpilot" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The operator pod's selector. component=operator keeps it apart from the engine pods, which
     the operator labels name=kvpilot, instance=<engine>, component=engine. */}}
{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: kvpilot
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* On every object the chart creates. */}}
{{- define "kvpilot.commonLabels" -}}
app.kubernetes.io/part-of: kvpilot
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* On the operator's own objects. */}}
{{- define "kvpilot.labels" -}}
{{ include "kvpilot.selectorLabels" . }}
{{ include "kvpilot.commonLabels" . }}
{{- end -}}

{{/* The example InferenceEngine's name and spec, as YAML: those in the values, or else those of
     examples/engine.yaml (files/example-engine.yaml is a copy). */}}
{{- define "kvpilot.exampleEngine" -}}
{{- $example := .Files.Get "files/example-engine.yaml" | fromYaml -}}
name: {{ .Values.exampleEngine.name | default $example.metadata.name }}
spec:
  {{- toYaml (.Values.exampleEngine.spec | default $example.spec) | nindent 2 }}
{{- end -}}
