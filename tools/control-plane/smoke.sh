#!/usr/bin/env bash
# Smoke test of the binaries built by build.sh: starts a throw-away control plane
# on 127.0.0.1 (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kwok), registers one fake kwok Node, rolls out a 2-replica Deployment, waits
# for `kubectl rollout status`, prints start-up timings and stops everything.
#
#   tools/control-plane/smoke.sh            # builds first if needed
#   CONTROL_PLANE_BIN=/path/bin smoke.sh    # use these binaries
#   KEEP=1 smoke.sh                         # keep the temp dir (logs, certs, kubeconfig)
#   SOAK_SECONDS=90 smoke.sh                # then idle 90s and re-check node/pods stay Ready
#                                           # (past the 50s node-monitor grace period: kwok's lease renewals)
#
# Needs: openssl, curl, kubectl (KUBECTL=...), python3 or shuf (to pick free ports).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${CONTROL_PLANE_BIN:-$("$here/build.sh" | tail -n1)}
KUBECTL=${KUBECTL:-kubectl}
for tool in openssl curl "$KUBECTL"; do
  command -v "$tool" >/dev/null 2>&1 || { echo "smoke.sh: '$tool' not found" >&2; exit 1; }
done
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok kwok-stages.yaml; do
  [[ -e "$bin/$b" ]] || { echo "smoke.sh: missing $bin/$b (run build.sh)" >&2; exit 1; }
done

now() { date +%s.%N; }
t_start=$(now)
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
log() { echo "[smoke +$(elapsed "$t_start" "$(now)")s] $*" >&2; }

dir=$(mktemp -d "${TMPDIR:-/tmp}/control-plane-smoke.XXXXXX")
pids=() names=()
stop_procs() {
  local i pid
  # Stop in reverse start order: kwok, scheduler, controller-manager, apiserver, etcd.
  for (( i=${#pids[@]}-1; i>=0; i-- )); do
    pid=${pids[i]}
    if kill -TERM "$pid" 2>/dev/null; then
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      if kill -0 "$pid" 2>/dev/null; then
        echo "[smoke] ${names[i]} (pid $pid) did not stop within 10s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
      fi
    fi
    wait "$pid" 2>/dev/null || true
  done
  pids=() names=()
}
stop_all() {
  local rc=$?
  trap - EXIT INT TERM
  stop_procs
  if (( rc != 0 )); then
    echo "[smoke] FAILED (rc=$rc); last log lines:" >&2
    for f in "$dir"/*.log; do [[ -f $f ]] && { echo "== $f" >&2; tail -n 15 "$f" >&2; }; done
  fi
  if [[ ${KEEP:-0} == 1 || $rc != 0 ]]; then
    echo "[smoke] kept $dir" >&2
  else
    rm -rf "$dir"
  fi
  exit "$rc"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() {  # start NAME CMD... : runs CMD in the background, logs to $dir/NAME.log
  local name=$1; shift
  "$@" >"$dir/$name.log" 2>&1 &
  pids+=("$!"); names+=("$name")
}

wait_for() {  # wait_for DESCRIPTION TIMEOUT_S CMD...
  local what=$1 timeout=$2 deadline i; shift 2
  deadline=$(( $(date +%s) + timeout ))
  until "$@" >/dev/null 2>&1; do
    for i in "${!pids[@]}"; do
      kill -0 "${pids[i]}" 2>/dev/null || { echo "[smoke] ${names[i]} exited while waiting for $what" >&2; return 1; }
    done
    (( $(date +%s) < deadline )) || { echo "[smoke] timed out after ${timeout}s waiting for $what" >&2; return 1; }
    sleep 0.2
  done
}

free_ports() {  # free_ports N: N distinct free TCP ports on 127.0.0.1
  if command -v python3 >/dev/null 2>&1; then
    python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
  else
    shuf -i 20000-40000 -n "$1" | tr '\n' ' '
  fi
}
read -r etcd_port etcd_peer_port api_port kcm_port sched_port < <(free_ports 5)

# ---------------------------------------------------------------- certificates
pki="$dir/pki"; mkdir -p "$pki"
service_cidr=10.96.0.0/16
cat > "$pki/openssl.cnf" <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = placeholder
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
EOF
ossl() { openssl "$@" >>"$pki/openssl.log" 2>&1 || { cat "$pki/openssl.log" >&2; return 1; }; }
# ECDSA P-256 keys: much faster to generate than RSA; Go, kubectl and Python's ssl accept them.
newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1)
new_ca() {  # new_ca NAME CN
  ossl req -x509 -new -nodes "${newkey[@]}" -days 2 -config "$pki/openssl.cnf" -extensions ca \
    -subj "/CN=$2" -keyout "$pki/$1.key" -out "$pki/$1.crt"
}
issue() {  # issue CA NAME SUBJECT EXTENSIONS
  ossl req -new -nodes "${newkey[@]}" -config "$pki/openssl.cnf" -subj "$3" \
    -keyout "$pki/$2.key" -out "$pki/$2.csr"
  ossl x509 -req -in "$pki/$2.csr" -CA "$pki/$1.crt" -CAkey "$pki/$1.key" -CAcreateserial \
    -days 2 -extfile "$pki/openssl.cnf" -extensions "$4" -out "$pki/$2.crt"
}
new_ca ca control-plane-smoke-ca
issue ca apiserver "/CN=kube-apiserver" server
issue ca admin "/O=system:masters/CN=kubernetes-admin" client
# Front proxy (aggregation layer / request-header auth): kube-apiserver publishes this CA in
# kube-system/extension-apiserver-authentication, where controller-manager and scheduler
# (delegated authn) look for it.
new_ca front-proxy-ca control-plane-smoke-front-proxy-ca
issue front-proxy-ca front-proxy-client "/CN=front-proxy-client" client
# service-account token signing key pair (ES256)
ossl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$pki/sa.key"
ossl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"

kubeconfig="$dir/admin.kubeconfig"
kc() { "$KUBECTL" --kubeconfig="$kubeconfig" "$@"; }
kc config set-cluster smoke --server="https://127.0.0.1:$api_port" \
  --certificate-authority="$pki/ca.crt" --embed-certs=true >/dev/null
kc config set-credentials admin --client-certificate="$pki/admin.crt" \
  --client-key="$pki/admin.key" --embed-certs=true >/dev/null
kc config set-context smoke --cluster=smoke --user=admin >/dev/null
kc config use-context smoke >/dev/null
t_pki=$(now)
log "certificates and kubeconfig ready ($dir)"

# ------------------------------------------------------------------------ etcd
start etcd "$bin/etcd" \
  --name=smoke --data-dir="$dir/etcd-data" \
  --listen-client-urls="http://127.0.0.1:$etcd_port" \
  --advertise-client-urls="http://127.0.0.1:$etcd_port" \
  --listen-peer-urls="http://127.0.0.1:$etcd_peer_port" \
  --initial-advertise-peer-urls="http://127.0.0.1:$etcd_peer_port" \
  --initial-cluster="smoke=http://127.0.0.1:$etcd_peer_port" \
  --unsafe-no-fsync=true --quota-backend-bytes=$((2 * 1024 * 1024 * 1024)) \
  --log-level=warn
wait_for "etcd /health" 30 curl -fsS "http://127.0.0.1:$etcd_port/health"
t_etcd=$(now); log "etcd healthy on :$etcd_port"

# -------------------------------------------------------------- kube-apiserver
start kube-apiserver "$bin/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$etcd_port" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$api_port" \
  --endpoint-reconciler-type=none \
  --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
  --client-ca-file="$pki/ca.crt" \
  --requestheader-client-ca-file="$pki/front-proxy-ca.crt" \
  --requestheader-allowed-names=front-proxy-client \
  --requestheader-username-headers=X-Remote-User \
  --requestheader-group-headers=X-Remote-Group \
  --requestheader-extra-headers-prefix=X-Remote-Extra- \
  --proxy-client-cert-file="$pki/front-proxy-client.crt" \
  --proxy-client-key-file="$pki/front-proxy-client.key" \
  --authorization-mode=Node,RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$pki/sa.pub" \
  --service-account-signing-key-file="$pki/sa.key" \
  --service-cluster-ip-range="$service_cidr" \
  --allow-privileged=true
wait_for "kube-apiserver /readyz" 90 kc get --raw /readyz
t_api=$(now); log "kube-apiserver ready on :$api_port"

# ----------------------------------------------------- kube-controller-manager
start kube-controller-manager "$bin/kube-controller-manager" \
  --kubeconfig="$kubeconfig" \
  --authentication-kubeconfig="$kubeconfig" --authorization-kubeconfig="$kubeconfig" \
  --bind-address=127.0.0.1 --secure-port="$kcm_port" \
  --leader-elect=false \
  --controllers='*' \
  --use-service-account-credentials=false \
  --service-account-private-key-file="$pki/sa.key" \
  --root-ca-file="$pki/ca.crt" \
  --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key"

# ------------------------------------------------------------- kube-scheduler
start kube-scheduler "$bin/kube-scheduler" \
  --kubeconfig="$kubeconfig" \
  --authentication-kubeconfig="$kubeconfig" --authorization-kubeconfig="$kubeconfig" \
  --bind-address=127.0.0.1 --secure-port="$sched_port" \
  --leader-elect=false

# ------------------------------------------------------------------------ kwok
# HOME is set to the temp dir so a developer's ~/.kwok/kwok.yaml is not picked up.
start kwok env HOME="$dir" "$bin/kwok" \
  --kubeconfig="$kubeconfig" \
  --config="$bin/kwok-stages.yaml" \
  --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --node-lease-duration-seconds=40 \
  --cidr=10.244.0.0/16 \
  --node-ip=127.0.0.1

wait_for "kube-controller-manager /healthz" 60 curl -fsSk "https://127.0.0.1:$kcm_port/healthz"
wait_for "kube-scheduler /healthz" 60 curl -fsSk "https://127.0.0.1:$sched_port/healthz"
# The serviceaccount controller creates 'default' SAs; pods can't be admitted before.
wait_for "serviceaccount default/default" 60 kc -n default get serviceaccount default
# Service-account tokens: signed with sa.key by the apiserver, accepted back via sa.pub;
# kube-root-ca.crt is published by the controller-manager (--root-ca-file).
sa_token=$(kc -n default create token default --duration=10m)
sa_user=$("$KUBECTL" --server="https://127.0.0.1:$api_port" --certificate-authority="$pki/ca.crt" \
  --token="$sa_token" auth whoami -o jsonpath='{.status.userInfo.username}')
[[ "$sa_user" == system:serviceaccount:default:default ]] \
  || { echo "[smoke] the service account's token authenticates as '$sa_user'" >&2; exit 1; }
wait_for "configmap default/kube-root-ca.crt" 30 kc -n default get configmap kube-root-ca.crt
t_ctrl=$(now); log "controller-manager and scheduler healthy (:$kcm_port, :$sched_port)"

# ------------------------------------------------------ fake node + deployment
kc apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-0
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: kwok-node-0
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
status:
  allocatable: {cpu: "32", memory: 256Gi, pods: "110"}
  capacity: {cpu: "32", memory: 256Gi, pods: "110"}
EOF
wait_for "node kwok-node-0 Ready" 60 kc wait --for=condition=Ready node/kwok-node-0 --timeout=2s
t_node=$(now); log "node kwok-node-0 Ready (kwok)"

kc apply -f - >/dev/null <<'EOF'
apiVersion: apps/v1
kind: Deployment
metadata:
  name: smoke
  namespace: default
spec:
  replicas: 2
  selector:
    matchLabels: {app: smoke}
  template:
    metadata:
      labels: {app: smoke}
    spec:
      containers:
      - name: app
        image: registry.invalid/smoke:1   # never pulled: kwok only fakes the status
EOF
kc -n default rollout status deployment/smoke --timeout=120s >&2
t_rollout=$(now)
kc -n default get pods -o wide >&2

# Scale down to check that kwok also completes pod deletion.
kc -n default scale deployment/smoke --replicas=1 >/dev/null
wait_for "scale down to 1 pod" 60 bash -c \
  "[[ \$('$KUBECTL' --kubeconfig='$kubeconfig' -n default get pods -l app=smoke -o name | wc -l) == 1 ]]"
t_scale=$(now)

if (( ${SOAK_SECONDS:-0} > 0 )); then
  log "soaking ${SOAK_SECONDS}s"
  sleep "$SOAK_SECONDS"
  kc wait --for=condition=Ready node/kwok-node-0 --timeout=1s >/dev/null
  kc -n default wait --for=condition=Ready pod -l app=smoke --timeout=1s >/dev/null
  [[ "$(kc get node kwok-node-0 -o jsonpath='{.spec.taints}')" != *unreachable* ]] \
    || { echo "[smoke] node got an unreachable taint during the soak" >&2; exit 1; }
  log "node and pod still Ready after ${SOAK_SECONDS}s"
fi

server_version=$(kc get --raw /version | sed -nE '/.*"gitVersion": *"([^"]+)".*/{s//\1/p;}' | tail -n1)
t_stop=$(now)
stop_procs
t_stopped=$(now)
cat <<EOF
control-plane smoke test: OK
  binaries:                 $bin
  server version:           ${server_version}
  certificates+kubeconfig:  $(elapsed "$t_start" "$t_pki")s
  etcd healthy:             $(elapsed "$t_pki" "$t_etcd")s
  kube-apiserver ready:     $(elapsed "$t_etcd" "$t_api")s
  controllers+scheduler:    $(elapsed "$t_api" "$t_ctrl")s
  kwok node Ready:          $(elapsed "$t_ctrl" "$t_node")s
  deployment rolled out:    $(elapsed "$t_node" "$t_rollout")s  (2/2 pods Ready)
  scaled down to 1:         $(elapsed "$t_rollout" "$t_scale")s
  start-up (to node Ready): $(elapsed "$t_start" "$t_node")s
  clean stop:               $(elapsed "$t_stop" "$t_stopped")s
  total:                    $(elapsed "$t_start" "$t_stopped")s
EOF
