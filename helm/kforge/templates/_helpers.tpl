{{/* The five services: config section, binary, whether it runs on a GPU. */}}
{{- define "kforge.components" -}}
gateway: {binary: kforge-gateway, gpu: false}
orchestrator: {binary: kforge-orchestrator, gpu: false}
reward: {binary: kforge-reward, gpu: false}
evaluator: {binary: kforge-evaluator, gpu: true}
profiler: {binary: kforge-profiler, gpu: true}
{{- end -}}

{{- define "kforge.labels" -}}
app.kubernetes.io/name: kforge
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
{{- end -}}

{{/* Labels of one component; argument: (list $ "gateway"). */}}
{{- define "kforge.componentLabels" -}}
{{ include "kforge.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kforge.selector" -}}
app.kubernetes.io/name: kforge
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Object name of one component; argument: (list $ "gateway"). */}}
{{- define "kforge.name" -}}
{{- printf "%s-%s" (index . 0).Release.Name (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A component's pod selector as a label selector string (k=v,...); argument: (list $ "evaluator"). */}}
{{- define "kforge.selectorString" -}}
{{- $labels := include "kforge.selector" . | fromYaml -}}
{{- $pairs := list -}}
{{- range $key := keys $labels | sortAlpha -}}
{{- $pairs = append $pairs (printf "%s=%s" $key (index $labels $key | toString)) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* Whether the orchestrator balances over the GPU pools through the Kubernetes API ("true" or ""). */}}
{{- define "kforge.discovery" -}}
{{- if .Values.orchestrator.discovery.enabled -}}true{{- end -}}
{{- end -}}

{{/* Whether a component accepts the named callers' tokens ("true" or ""): those clients may call
     (networkPolicy.clients); the profiler is called by the orchestrator and the evaluator only. */}}
{{- define "kforge.takesCallers" -}}
{{- if has . (list "gateway" "orchestrator" "evaluator" "reward") -}}true{{- end -}}
{{- end -}}

{{/* Where a named caller's token is mounted; argument: the caller's name. */}}
{{- define "kforge.callerDir" -}}
{{- printf "/var/run/kforge/callers/%s" . -}}
{{- end -}}

{{- define "kforge.tokenSecret" -}}
{{- default (printf "%s-kforge-token" .Release.Name) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The drain timeout of one component; argument: (list $ "evaluator"). */}}
{{- define "kforge.drain" -}}
{{- $root := index . 0 -}}
{{- $svc := index $root.Values (index . 1) -}}
{{- default $root.Values.drainTimeoutSeconds $svc.drainTimeoutSeconds | int -}}
{{- end -}}

{{/* How clients reach a component: its Service's DNS name, with the scheme TLS calls for. */}}
{{- define "kforge.url" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- printf "%s://%s.%s.svc:%d" (ternary "https" "http" $root.Values.tls.enabled) (include "kforge.name" .) $root.Release.Namespace (int (index $root.Values $name).port) -}}
{{- end -}}

{{/* The [server] table every service gets. */}}
{{- define "kforge.serverTable" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $server := dict "listen" (printf "0.0.0.0:%d" (int (index $root.Values $name).port)) "drain_timeout_secs" (include "kforge.drain" . | int) "auth" (dict "token_file" "/var/run/kforge/token/token") -}}
{{- if $root.Values.tls.enabled -}}
{{- $_ := set $server "tls" (dict "cert_file" "/var/run/kforge/tls/tls.crt" "key_file" "/var/run/kforge/tls/tls.key") -}}
{{- end -}}
{{- /* Named callers (auth.callers): each a token of its own, read from its Secret's mounted file. */ -}}
{{- $callers := list -}}
{{- $seen := dict -}}
{{- range $caller := $root.Values.auth.callers -}}
{{- if hasKey $seen $caller.name -}}
{{- fail (printf "auth.callers: name `%s` appears twice" $caller.name) -}}
{{- end -}}
{{- $_ := set $seen $caller.name true -}}
{{- $callers = append $callers (dict "name" $caller.name "token_file" (printf "%s/token" (include "kforge.callerDir" $caller.name))) -}}
{{- end -}}
{{- if and $callers (include "kforge.takesCallers" $name) -}}
{{- $_ := set $server "callers" $callers -}}
{{- end -}}
{{- toJson $server -}}
{{- end -}}

{{/* A component's whole table (the chart's keys over the values' `config`), as JSON. */}}
{{- define "kforge.table" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $values := index $root.Values $name -}}
{{- $table := deepCopy ($values.config | default dict) -}}
{{- $owned := dict "orchestrator" (list "server" "peers" "store" "instance" "discovery") "evaluator" (list "server" "work_dir" "sandbox") -}}
{{- range $key := (index $owned $name | default (list "server")) -}}
{{- if hasKey $table $key -}}
{{- fail (printf "%s.config.%s is set by the chart (helm/kforge/README.md, \"Keys the chart sets\"); use the chart's values instead" $name $key) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $table "server" (include "kforge.serverTable" . | fromJson) -}}
{{- if eq $name "orchestrator" -}}
{{- $client := dict "auth" (dict "token_file" "/var/run/kforge/token/token") -}}
{{- if $root.Values.tls.enabled -}}
{{- $_ := set $client "tls_ca_file" "/var/run/kforge/tls/ca.crt" -}}
{{- if include "kforge.discovery" $root -}}
{{- /* Discovered pods are called by address: verify the name of the evaluator's Service instead, which the
       release's one certificate covers along with every other service's (tls_domain is one for all peers). */ -}}
{{- $_ := set $client "tls_domain" (printf "%s.%s.svc" (include "kforge.name" (list $root "evaluator")) $root.Release.Namespace) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $table "peers" (dict "gateway" (include "kforge.url" (list $root "gateway")) "evaluator" (include "kforge.url" (list $root "evaluator")) "reward" (include "kforge.url" (list $root "reward")) "profiler" (include "kforge.url" (list $root "profiler")) "client" $client) -}}
{{- if not $values.database.existingSecret -}}
{{- $_ := set $table "store" "sqlite:///var/lib/kforge/orchestrator.db" -}}
{{- end -}}
{{- /* The plain-HTTP port (orchestrator.httpPort; 0: none, an empty listen). The rest of [orchestrator.http] (task_set,
       recipe, turns, kernelgym_results) comes from the values' config. */ -}}
{{- $http := $table.http | default dict -}}
{{- if hasKey $http "listen" -}}
{{- fail "orchestrator.config.http.listen is set by the chart (helm/kforge/README.md, \"Keys the chart sets\"); use orchestrator.httpPort instead" -}}
{{- end -}}
{{- $httpPort := int $values.httpPort -}}
{{- if eq $httpPort (int $values.port) -}}
{{- fail (printf "orchestrator.httpPort %d is the orchestrator's gRPC port: give it another (0: no HTTP port)" $httpPort) -}}
{{- end -}}
{{- $_ := set $http "listen" (ternary (printf "0.0.0.0:%d" $httpPort) "" (gt $httpPort 0)) -}}
{{- $_ := set $table "http" $http -}}
{{- if include "kforge.discovery" $root -}}
{{- /* Each pool: its headless Service's EndpointSlices (port `grpc`) and exactly its pods, in the pod's own
       namespace. Evaluator pods advertise their queue_capacity (kforge.dev/capacity, workloads.yaml), also the
       fallback here; profiler pods advertise none and take the config's default (4). */ -}}
{{- $evaluator := dict "service" (printf "%s-pods" (include "kforge.name" (list $root "evaluator"))) "port" "grpc" "pod_selector" (include "kforge.selectorString" (list $root "evaluator")) "capacity" (dig "queue_capacity" 64 ($root.Values.evaluator.config | default dict) | int) -}}
{{- $profiler := dict "service" (printf "%s-pods" (include "kforge.name" (list $root "profiler"))) "port" "grpc" "pod_selector" (include "kforge.selectorString" (list $root "profiler")) -}}
{{- $_ := set $table "discovery" (dict "evaluator" $evaluator "profiler" $profiler) -}}
{{- end -}}
{{- else if eq $name "evaluator" -}}
{{- $_ := set $table "work_dir" "/var/lib/kforge/evaluator" -}}
{{- $_ := set $table "sandbox" (dict "network_namespace" true "landlock" true "process_limit" true "command_users" true "command_user_base" (int64 $values.sandbox.jobUserBase)) -}}
{{- end -}}
{{- toJson $table -}}
{{- end -}}

{{/*
TOML from a map. Helm reads every number in values as a float, and toToml writes 20 as 20.0, which an integer field
rejects: this writes integral numbers as integers. Argument: (dict "header" "[gateway]" "path" "gateway" "value" map).
*/}}
{{- define "kforge.toml.table" -}}
{{- $path := .path -}}
{{- $value := .value -}}
{{ .header }}
{{- range $key := keys $value | sortAlpha }}
{{- $v := index $value $key }}
{{- if and (not (kindIs "map" $v)) (not (and (kindIs "slice" $v) (gt (len $v) 0) (kindIs "map" (first $v)))) (not (kindIs "invalid" $v)) }}
{{ $key }} = {{ include "kforge.toml.value" $v }}
{{- end }}
{{- end }}
{{- range $key := keys $value | sortAlpha }}
{{- $v := index $value $key }}
{{- if kindIs "map" $v }}

{{ include "kforge.toml.table" (dict "header" (printf "[%s.%s]" $path $key) "path" (printf "%s.%s" $path $key) "value" $v) }}
{{- else if and (kindIs "slice" $v) (gt (len $v) 0) (kindIs "map" (first $v)) }}
{{- range $item := $v }}

{{ include "kforge.toml.table" (dict "header" (printf "[[%s.%s]]" $path $key) "path" (printf "%s.%s" $path $key) "value" $item) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kforge.toml.value" -}}
{{- if kindIs "string" . -}}
{{ toJson . }}
{{- else if kindIs "bool" . -}}
{{ ternary "true" "false" . }}
{{- else if kindIs "float64" . -}}
{{- if and (eq (floor .) .) (lt (. | float64) 9007199254740992.0) (gt (. | float64) -9007199254740992.0) -}}
{{ int64 . }}
{{- else -}}
{{ toString . }}
{{- end -}}
{{- else if kindIs "slice" . -}}
[{{ range $i, $item := . }}{{ if $i }}, {{ end }}{{ include "kforge.toml.value" $item }}{{ end }}]
{{- else -}}
{{ toString . }}
{{- end -}}
{{- end -}}

{{/* The config file of one component. */}}
{{- define "kforge.configFile" -}}
{{- $name := index . 1 -}}
# kforge [{{ $name }}], rendered by the Helm chart from the values' {{ $name }}.config and the chart's own keys.
{{ include "kforge.toml.table" (dict "header" (printf "[%s]" $name) "path" $name "value" (include "kforge.table" . | fromJson)) }}
{{- end -}}

{{- define "kforge.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/* Health probes on grpc.health.v1; with TLS a TCP check, since kubelet's gRPC probe speaks plaintext only. */}}
{{- define "kforge.probe" -}}
{{- if .tls }}
tcpSocket:
  port: grpc
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end -}}
