#!/usr/bin/env bash
# Creates the certificates KubeVirt's components use to reach each other, as virt-operator
# would: one CA, virt-handler's console-server certificate (server.crt / server.key), the client
# certificate virt-api presents to it (client.crt / client.key), and virt-api's serving
# certificate for its Service (virt-api.crt / virt-api.key). Existing files are kept.
# Usage: hack/pki.sh DIR
set -euo pipefail
dir=${1:?usage: hack/pki.sh DIR}
mkdir -p "$dir"
cd "$dir"
umask 077
[[ -f ca.crt ]] || openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
  -subj "/CN=kubevirt.io@localcluster" -keyout ca.key -out ca.crt 2>/dev/null
issue() {
  local name=$1 subject=$2 usage=$3 san=$4
  [[ -f $name.crt ]] && return
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$subject" \
    -keyout "$name.key" -out "$name.csr" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
    -extfile <(printf 'extendedKeyUsage=%s\nsubjectAltName=%s\n' "$usage" "$san") \
    -out "$name.crt" 2>/dev/null
  rm -f "$name.csr"
}
issue server "/CN=kubevirt.io:system:node:virt-handler" serverAuth "DNS:virt-handler,DNS:localhost,IP:127.0.0.1"
issue client "/CN=kubevirt.io:system:client:virt-handler" clientAuth "DNS:virt-handler"
issue virt-api "/CN=virt-api.kubevirt.pod.cluster.local" serverAuth \
  "DNS:virt-api,DNS:virt-api.kubevirt,DNS:virt-api.kubevirt.svc,DNS:virt-api.kubevirt.svc.cluster.local"
