#!/usr/bin/env bash
# Builds the local control plane's binaries from their pinned Go modules, once, into a cache outside the
# checkout: helm, etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and kwok.
#
#   build.sh [NAME...]   build what is missing or stale (all by default) and check each reports its version
#   build.sh --bin-dir   print the folder the binaries are built into, and exit
#   build.sh --list     print the names of the binaries, and exit
#
# Environment: KVFLEET_CACHE (default ~/.cache/kvfleet), KVFLEET_K8S_BIN (overrides the binary folder),
# KVFLEET_BUILD_JOBS (packages compiled at once, default 2), KVFLEET_BUILD_NICE (default 10).
# A cold build downloads about 1.8 GB of modules and compiles for about ten minutes on 2 cores; a link needs
# about 2 GB of memory, so binaries are built one at a time. Re-running it after a success costs seconds.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache="${KVFLEET_CACHE:-$HOME/.cache/kvfleet}"
bin_dir="${KVFLEET_K8S_BIN:-$cache/k8s/$KUBERNETES_VERSION/bin}"
# helm first: the unit tests' chart checks wait for it alone while the rest builds.
names=(helm etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok)

case "${1:-}" in
--bin-dir)
    echo "$bin_dir"
    exit 0
    ;;
--list)
    printf '%s\n' "${names[@]}"
    exit 0
    ;;
-h | --help)
    sed -n '2,13s/^# \{0,1\}//p' "$0"
    exit 0
    ;;
esac

log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

command -v go >/dev/null || die "the go command is not on PATH; install Go $(sed -n 's/^go //p' "$here/modules/kubernetes/go.mod") or newer"

export CGO_ENABLED=0 GOMAXPROCS="${GOMAXPROCS:-2}"
jobs="${KVFLEET_BUILD_JOBS:-2}"
niceness="${KVFLEET_BUILD_NICE:-10}"

# name -> wrapper module folder, main package, version the binary must report.
module_of() {
    case "$1" in
    etcd) echo etcd ;;
    kwok) echo kwok ;;
    helm) echo helm ;;
    *) echo kubernetes ;;
    esac
}

package_of() {
    case "$1" in
    etcd) echo go.etcd.io/etcd/server/v3 ;;
    kwok) echo sigs.k8s.io/kwok/cmd/kwok ;;
    helm) echo helm.sh/helm/v3/cmd/helm ;;
    *) echo "k8s.io/kubernetes/cmd/$1" ;;
    esac
}

expected_version_of() {
    case "$1" in
    etcd) echo "${ETCD_VERSION#v}" ;;
    kwok) echo "${KWOK_VERSION#v}" ;;
    helm) echo "$HELM_VERSION" ;;
    *) echo "$KUBERNETES_VERSION" ;;
    esac
}

version_output_of() {  # what the built binary says about its version
    case "$1" in
    kubectl) "$bin_dir/kubectl" version --client 2>&1 ;;
    helm) "$bin_dir/helm" version --short 2>&1 ;;
    kwok) "$bin_dir/kwok" --version 2>&1 ;;
    *) "$bin_dir/$1" --version 2>&1 ;;
    esac
}

go_in() {  # run go inside a wrapper module, niced, never touching its go.mod or go.sum
    local module="$1"
    shift
    (cd "$here/modules/$module" && nice -n "$niceness" go "$@")
}

module_version() { go_in "$1" list -mod=readonly -m -f '{{.Version}}' "$2"; }

ldflags_of() {
    case "$1" in
    etcd | kwok)
        # Both keep their version in a constant of the release's source.
        echo "-s -w"
        ;;
    helm)
        # helm checks charts' kubeVersion against the Kubernetes version of its client-go, as its Makefile does.
        local client_go minor
        client_go="$(module_version helm k8s.io/client-go)"
        minor="$(echo "$client_go" | cut -d. -f2)"
        echo "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
            "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor" \
            "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
        ;;
    *)
        # Without these the servers report v0.0.0-master, which breaks kubectl's and helm's version checks.
        # The module carries no commit hash, so the commit is left empty rather than invented.
        local minor build_date flags="-s -w"
        minor="$(echo "$KUBERNETES_VERSION" | cut -d. -f2)"
        build_date="$(go_in kubernetes list -mod=readonly -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)"
        for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
            flags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
            flags+=" -X $pkg.gitCommit= -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
        done
        echo "$flags"
        ;;
    esac
}

tags_of() {
    case "$1" in
    etcd | kwok | helm) echo "" ;;
    *) echo "selinux,notest,grpcnotrace" ;;  # the tags upstream's release build uses
    esac
}

stamp_of() {  # what the binary was built from; a different stamp means it is stale
    local name="$1" module
    module="$(module_of "$name")"
    {
        go env GOVERSION
        echo "$(package_of "$name") $(tags_of "$name") $(ldflags_of "$name")"
        cat "$here/modules/$module/go.mod" "$here/modules/$module/go.sum"
    } | sha256sum | cut -c1-32
}

is_current() { [[ -x "$bin_dir/$1" && -f "$bin_dir/.$1.stamp" && "$(cat "$bin_dir/.$1.stamp")" == "$2" ]]; }

# Reads `go build -v` output (one import path per compiled package) and prints a progress line every 5%.
progress() {
    local name="$1" total="$2" started="$3"
    awk -v name="$name" -v total="$total" -v started="$started" '
        function stamp() { return strftime("%H:%M:%S") }
        /^[A-Za-z0-9._~\/-]+$/ {
            done++
            pct = int(100 * done / total)
            if (pct >= next_pct) {
                printf "[build %s] %s: %d%% (%d of at most %d packages compiled, %ds)\n", stamp(), name, pct, done, total, systime() - started
                fflush()
                next_pct = pct + 5
            }
            next
        }
        { print; fflush() }
    ' >&2
}

build_one() {
    local name="$1" stamp="$2" module pkg tags ldflags total started
    module="$(module_of "$name")"
    pkg="$(package_of "$name")"
    tags="$(tags_of "$name")"
    ldflags="$(ldflags_of "$name")"
    started="$(date +%s)"
    log "$name: downloading modules and listing packages ($pkg)"
    total="$(go_in "$module" list -mod=readonly -tags "$tags" -deps "$pkg" | wc -l)"
    log "$name: compiling up to $total packages (jobs=$jobs, nice $niceness)"
    rm -f "$bin_dir/.$name.tmp"
    # go build -v names each package on stderr as it compiles it; pipefail keeps go's exit status.
    if ! go_in "$module" build -mod=readonly -trimpath -v -p "$jobs" -tags "$tags" -ldflags "$ldflags" \
        -o "$bin_dir/.$name.tmp" "$pkg" 2>&1 | progress "$name" "$total" "$started"; then
        rm -f "$bin_dir/.$name.tmp"
        die "$name: go build failed (output above)"
    fi
    mv -f "$bin_dir/.$name.tmp" "$bin_dir/$name"
    echo "$stamp" >"$bin_dir/.$name.stamp"
    log "$name: built in $(($(date +%s) - started))s, $(du -m "$bin_dir/$name" | cut -f1) MB"
}

verify_one() {
    local name="$1" expected output
    expected="$(expected_version_of "$name")"
    output="$(version_output_of "$name")" || die "$name: asking for its version failed: $output"
    [[ "$output" == *"$expected"* ]] || die "$name reports '$output', expected $expected"
    log "$name: $(echo "$output" | head -n1)"
}

selected=("$@")
[[ ${#selected[@]} -gt 0 ]] || selected=("${names[@]}")
for name in "${selected[@]}"; do
    [[ " ${names[*]} " == *" $name "* ]] || die "unknown binary '$name'; known: ${names[*]}"
done

mkdir -p "$bin_dir"
all_started="$(date +%s)"
for name in "${selected[@]}"; do
    # Two builds of one binary at once (a test run and `make demo`) would double the memory and fight over
    # its files; a lock per binary lets a build that needs only helm wait for helm alone.
    exec 9>"$bin_dir/.$name.lock"
    if ! flock -n 9; then
        log "another build holds $bin_dir/.$name.lock; waiting for it"
        flock 9
    fi
    stamp="$(stamp_of "$name")"
    if is_current "$name" "$stamp"; then
        log "$name: up to date"
    else
        build_one "$name" "$stamp"
    fi
    verify_one "$name"
    exec 9>&-
done
log "all built in $bin_dir ($(($(date +%s) - all_started))s)"
