{{/*
The image of the agent, the controller, `akri handler` and the cleanup hook: one image.
Call with (dict "root" $ "image" <a values image map>).
*/}}
{{- define "akri.image" -}}
{{- $repository := .image.repository | default "ghcr.io/akri-py/akri-agent" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion -}}
{{- printf "%s:%s" $repository (toString $tag) -}}
{{- end }}

{{/* Akri's resources map (memoryRequest, ...) as a container's resources. */}}
{{- define "akri.resources" -}}
requests:
  cpu: {{ .cpuRequest }}
  memory: {{ .memoryRequest }}
limits:
  cpu: {{ .cpuLimit }}
  memory: {{ .memoryLimit }}
{{- end }}

{{/* The broker's resources: the device slot ({{PLACEHOLDER}}, filled by the controller with
the Instance's or Configuration's resource name, as Akri does) and Akri's resources map. */}}
{{- define "akri.brokerResources" -}}
requests:
  "{{`{{PLACEHOLDER}}`}}": "1"
  cpu: {{ .cpuRequest }}
  memory: {{ .memoryRequest }}
limits:
  "{{`{{PLACEHOLDER}}`}}": "1"
  cpu: {{ .cpuLimit }}
  memory: {{ .memoryLimit }}
{{- end }}

{{/* Akri's env map ({NAME: value}) and envFrom map ({secretRef: [names], configMapRef: [names]}). */}}
{{- define "akri.brokerEnv" -}}
{{- if .env }}
env:
{{- range $name, $value := .env }}
  - name: {{ $name }}
    value: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- if .envFrom }}
envFrom:
{{- range $name := .envFrom.secretRef }}
  - secretRef:
      name: {{ $name | quote }}
{{- end }}
{{- range $name := .envFrom.configMapRef }}
  - configMapRef:
      name: {{ $name | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The discovery-handler DaemonSets the release runs (<handler>.discovery.enabled; with
agent.full only custom's: the agent embeds the others), as a JSON list of
{key, handler, name}: discovery-handlers.yaml renders them, the cleanup hook deletes them. */}}
{{- define "akri.discoveryHandlers" -}}
{{- $all := list
  (dict "key" "debugEcho" "handler" "debugEcho" "name" "akri-debug-echo-discovery")
  (dict "key" "udev" "handler" "udev" "name" "akri-udev-discovery")
  (dict "key" "onvif" "handler" "onvif" "name" "akri-onvif-discovery")
  (dict "key" "opcua" "handler" "opcua" "name" "akri-opcua-discovery")
  (dict "key" "custom" "handler" "" "name" .Values.custom.discovery.name) -}}
{{- $enabled := list -}}
{{- range $h := $all -}}
{{- if and (index $.Values $h.key).discovery.enabled (or (eq $h.key "custom") (not $.Values.agent.full)) -}}
{{- $enabled = append $enabled $h -}}
{{- end -}}
{{- end -}}
{{- toJson $enabled -}}
{{- end }}

{{/* The controller's leader-election Lease (its --lease-name default, akri-controller): its
RBAC names it, the cleanup hook deletes it. */}}
{{- define "akri.controllerLease" -}}akri-controller{{- end }}
