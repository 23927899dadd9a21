{{- define "kforge.labels" -}}
app.kubernetes.io/name: kforge
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kforge.tokenSecret" -}}
{{- default (printf "%s-kforge-token" .Release.Name) .Values.auth.existingSecret -}}
{{- end -}}
