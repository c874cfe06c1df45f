{{- define "loader.labels" -}}
app.kubernetes.io/name: loader-service
app.kubernetes.io/part-of: remote-loader
{{- end -}}

{{- define "loader.selector" -}}
app.kubernetes.io/name: loader-service
{{- end -}}

{{/* The trainers' mean stall fraction over 2 minutes, with the dead band of values.scaling.stall. */}}
{{- define "loader.stallQuery" -}}
{{- $m := printf "namespace=%q" .Release.Namespace -}}
{{- $s := .Values.scaling.stall -}}
{{- $stall := printf "sum(rate(loader_stage_seconds_total{stage=\"client_wait\",%s}[2m]))\n  / clamp_min(sum(loader_clients{%s}), 1)" $m $m -}}
(
  {{ $stall }}
) > {{ $s.up }}
or on() (
  (
    {{ $stall | replace "\n" "\n  " }}
  ) >= {{ $s.low }}
) * 0 + {{ $s.up }}
or on() count(loader_clients{ {{- $m -}} }) * 0 + {{ $s.down }}
or on() vector({{ $s.up }})
{{- end -}}

{{- define "loader.behavior" -}}
scaleUp:
  stabilizationWindowSeconds: 120
  policies:
    - type: Pods
      value: 2
      periodSeconds: 120
scaleDown:
  stabilizationWindowSeconds: 900
  policies:
    - type: Pods
      value: 1
      periodSeconds: 600
{{- end -}}
