{{/* The recommended labels on every object and pod, as talos/kubernetes/base sets them. */}}
{{- define "gpufeed.labels" -}}
app.kubernetes.io/component: node-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/name: gpufeed-guest
app.kubernetes.io/part-of: gpufeed
{{- end }}

{{/* The labels components/prometheus-operator sets on its objects. */}}
{{- define "gpufeed.operatorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/name: gpufeed-guest
app.kubernetes.io/part-of: gpufeed
{{- with .Values.prometheusOperator.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A shipped manifest (files/, linked to talos/kubernetes/components/) as an object. */}}
{{- define "gpufeed.file" -}}
{{- $o := .ctx.Files.Get .path | fromYaml -}}
{{- if hasKey $o "Error" }}{{ fail (printf "%s: %s" .path $o.Error) }}{{ end -}}
{{- toYaml $o -}}
{{- end }}
