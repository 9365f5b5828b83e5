{{/*
A Configuration as Akri's chart renders it (deployment/helm/templates/<handler>-configuration.yaml
of project-akri/akri 0.13.x), from one handler's values. Call with
  (dict "root" $ "handler" "<discoveryHandler name>" "c" .Values.<handler>.configuration
        "details" "<discoveryDetails YAML text>")
- a broker only when brokerPod.image.repository (a Pod) or brokerJob.image.repository (a Job)
  is set; the Pod wins when both are;
- its resources ask for one slot: "{{PLACEHOLDER}}", which the controller replaces with the
  Instance's (or Configuration's) resource name, as Akri's does;
- the instance and configuration Services only with a broker Pod (debugEcho: with a Job too,
  as in Akri's chart), each when create*Services is true.
*/}}
{{- define "akri.configuration" -}}
{{- $c := .c }}
{{- $root := .root }}
{{- $pod := $c.brokerPod.image.repository }}
{{- $job := $c.brokerJob.image.repository }}
{{- $services := $pod }}
{{- if eq .handler "debugEcho" }}{{ $services = or $pod $job }}{{ end }}
apiVersion: akri.sh/v0
kind: Configuration
metadata:
  name: {{ $c.name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    app.kubernetes.io/part-of: akri
spec:
  discoveryHandler:
    name: {{ .handler }}
    discoveryDetails: {{ .details | toString | quote }}
    {{- with $c.discoveryProperties }}
    discoveryProperties:
      {{- toYaml . | nindent 6 }}
    {{- end }}
  {{- if or $pod $job }}
  brokerSpec:
    {{- if $pod }}
    brokerPodSpec:
      containers:
        - name: {{ $c.name }}-broker
          image: {{ printf "%s:%s" $pod (toString $c.brokerPod.image.tag) | quote }}
          {{- with $c.brokerPod.image.pullPolicy }}
          imagePullPolicy: {{ . }}
          {{- end }}
          {{- with include "akri.brokerEnv" $c.brokerPod }}{{ . | nindent 10 }}{{ end }}
          {{- if eq .handler "udev" }}
          securityContext:
            {{- if $c.brokerPod.securityContext }}
            {{- toYaml $c.brokerPod.securityContext | nindent 12 }}
            {{- else }}
            privileged: true
            {{- end }}
          {{- end }}
          resources:
            {{- include "akri.brokerResources" $c.brokerPod.resources | nindent 12 }}
          {{- $mounts := $c.brokerPod.volumeMounts | default list }}
          {{- if and (eq .handler "opcua") $c.mountCertificates }}
          {{- $mounts = append $mounts (dict "name" "credentials" "mountPath" "/etc/opcua-certs/client-pki" "readOnly" false) }}
          {{- end }}
          {{- with $mounts }}
          volumeMounts:
            {{- toYaml . | nindent 12 }}
          {{- end }}
      {{- $volumes := $c.brokerPod.volumes | default list }}
      {{- if and (eq .handler "opcua") $c.mountCertificates }}
      {{- $volumes = append $volumes (include "akri.opcuaCredentials" . | fromYaml) }}
      {{- end }}
      {{- with $volumes }}
      volumes:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- else }}
    brokerJobSpec:
      template:
        spec:
          containers:
            - name: {{ $c.name }}-broker
              image: {{ printf "%s:%s" $job (toString $c.brokerJob.image.tag) | quote }}
              {{- with $c.brokerJob.image.pullPolicy }}
              imagePullPolicy: {{ . }}
              {{- end }}
              {{- with $c.brokerJob.command }}
              command:
                {{- toYaml . | nindent 16 }}
              {{- end }}
              {{- with include "akri.brokerEnv" $c.brokerJob }}{{ . | nindent 14 }}{{ end }}
              resources:
                {{- include "akri.brokerResources" $c.brokerJob.resources | nindent 16 }}
              {{- with $c.brokerJob.volumeMounts }}
              volumeMounts:
                {{- toYaml . | nindent 16 }}
              {{- end }}
          {{- with $c.brokerJob.volumes }}
          volumes:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          restartPolicy: {{ $c.brokerJob.restartPolicy }}
          {{- with $root.Values.imagePullSecrets }}
          imagePullSecrets:
            {{- toYaml . | nindent 12 }}
          {{- end }}
      backoffLimit: {{ $c.brokerJob.backoffLimit }}
      parallelism: {{ $c.brokerJob.parallelism }}
      completions: {{ $c.brokerJob.completions }}
    {{- end }}
  {{- end }}
  {{- if $services }}
  {{- if $c.createInstanceServices }}
  instanceServiceSpec:
    {{- include "akri.serviceSpec" (dict "handler" .handler "s" $c.instanceService) | nindent 4 }}
  {{- end }}
  {{- if $c.createConfigurationService }}
  configurationServiceSpec:
    {{- include "akri.serviceSpec" (dict "handler" .handler "s" $c.configurationService) | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- if $c.brokerProperties }}
  brokerProperties:
    {{- range $name, $value := $c.brokerProperties }}
    {{ $name }}: {{ $value | toString | quote }}
    {{- end }}
  {{- else }}
  brokerProperties: {}
  {{- end }}
  capacity: {{ $c.capacity }}
{{- end }}

{{/* A service spec from Akri's instanceService / configurationService values. The port's
name: portName (udev, onvif), "grpc" (opcua), name (debugEcho, custom), as in Akri's chart. */}}
{{- define "akri.serviceSpec" -}}
{{- $s := .s }}
{{- $portName := $s.name }}
{{- if eq .handler "opcua" }}{{ $portName = "grpc" }}{{ else if $s.portName }}{{ $portName = $s.portName }}{{ end -}}
type: {{ $s.type }}
ports:
  - name: {{ $portName }}
    port: {{ $s.port }}
    protocol: {{ $s.protocol }}
    targetPort: {{ $s.targetPort }}
{{- end }}

{{/* The OPC UA client credentials volume of Akri's chart (opcua.configuration.mountCertificates). */}}
{{- define "akri.opcuaCredentials" -}}
name: credentials
secret:
  secretName: opcua-broker-credentials
  items:
    - key: client_certificate
      path: own/certs/AkriBroker.der
    - key: client_key
      path: own/private/AkriBroker.pfx
    - key: ca_certificate
      path: trusted/certs/SomeCA.der
    - key: ca_crl
      path: trusted/crl/SomeCA.crl
{{- end }}
