#!/usr/bin/env bash
# Makes the TLS test certificates in DIR with openssl (run time, never
# committed): a CA; kvmanager's and kvworker's certificates (serverAuth and
# clientAuth, SAN DNS:localhost and IP:127.0.0.1, the names loopback tests
# dial); a frontend's client certificate (CN frontend); and a rogue CA with
# a certificate named kvworker that the real CA did not sign; and a worker
# certificate whose only SAN is DNS:kvworker.triaxkv.test (as one shared by
# workers that advertise pod IPs).
#
#   tests/tls/make_certs.sh DIR
#
# Files: ca.crt, {manager,worker,client}.{crt,key}, rogue-ca.crt,
# rogue-worker.{crt,key}, named-worker.{crt,key}. EC P-256 keys, valid for 2 days.
set -euo pipefail

dir=${1:?usage: make_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"

ca() {  # NAME CN
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -nodes -keyout "$1.key" -out "$1.crt" -days 2 -subj "/CN=$2" \
    -addext basicConstraints=critical,CA:TRUE \
    -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
}

leaf() {  # NAME CN CA EKU [SAN]
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%s\n' "basicConstraints=CA:FALSE" \
    "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=$4" \
    "subjectAltName=${5:-DNS:localhost,IP:127.0.0.1}" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.crt" -CAkey "$3.key" \
    -CAcreateserial -days 2 -out "$1.crt" -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca triaxkv-test-ca
ca rogue-ca triaxkv-rogue-ca
leaf manager kvmanager ca serverAuth,clientAuth
leaf worker kvworker ca serverAuth,clientAuth
leaf client frontend ca clientAuth
leaf rogue-worker kvworker rogue-ca serverAuth,clientAuth
# Names no address: dialers verify it with --tls_worker_server_name.
leaf named-worker kvworker ca serverAuth,clientAuth DNS:kvworker.triaxkv.test
rm -f ./*.srl
