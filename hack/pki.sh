#!/usr/bin/env bash
# Creates the certificates virt-handler's console server needs, as virt-operator would: a CA, a
# server certificate signed by it (tls.crt / tls.key) and a client certificate for tools that talk
# to the console server (client.crt / client.key). Existing files are kept.
# Usage: hack/pki.sh DIR
set -euo pipefail
dir=${1:?usage: hack/pki.sh DIR}
mkdir -p "$dir"
cd "$dir"
umask 077
[[ -f ca.crt ]] || openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
  -subj "/CN=kubevirt.io@localcluster" -keyout ca.key -out ca.crt 2>/dev/null
issue() {
  local name=$1 subject=$2 usage=$3
  [[ -f $name.crt ]] && return
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$subject" \
    -keyout "$name.key" -out "$name.csr" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
    -extfile <(printf 'extendedKeyUsage=%s\nsubjectAltName=DNS:virt-handler,DNS:localhost,IP:127.0.0.1\n' "$usage") \
    -out "$name.crt" 2>/dev/null
  rm -f "$name.csr"
}
issue server "/CN=kubevirt.io:system:node:virt-handler" serverAuth
issue client "/CN=kubevirt.io:system:client:virt-handler" clientAuth
