#!/usr/bin/env bash
# The shared libraries that llmsched's dev extra expects from the system, and
# their installation; the Makefile's set-up runs this before creating .venv.
# Mooncake's transfer engine (the pd extra, Linux x86_64 only) links
# libibverbs, libnuma and libcurl even for its TCP transport and its wheel
# does not ship them.
#
#   tools/system_libs.sh          install the missing ones (apt-get, as root or
#                                 through password-less sudo), else say how
#   tools/system_libs.sh --list   print "soname debian-package" per library
set -euo pipefail

LIBS=(
    "libibverbs.so.1 libibverbs1"
    "libnuma.so.1 libnuma1"
    "libcurl.so.4 libcurl4"
)

if [[ "${1:-}" == "--list" ]]; then
    printf '%s\n' "${LIBS[@]}"
    exit 0
fi
# The pd extra installs nothing elsewhere, so nothing here is needed.
[[ "$(uname -s)" == Linux && "$(uname -m)" == x86_64 ]] || exit 0

# ldconfig lives in sbin, which a non-root PATH often lacks.
PATH="$PATH:/usr/sbin:/sbin"

missing_libs() {
    local known entry
    known=$(ldconfig -p | awk '{print $1}')
    for entry in "${LIBS[@]}"; do
        grep -qxF "${entry%% *}" <<<"$known" || echo "$entry"
    done
}

missing=$(missing_libs)
[[ -z "$missing" ]] && exit 0
sonames=$(awk '{print $1}' <<<"$missing" | xargs)
packages=$(awk '{print $2}' <<<"$missing" | xargs)

if ! command -v apt-get >/dev/null; then
    echo "error: missing system libraries: $sonames (needed by Mooncake's transfer engine," \
        "the pd extra). Install the packages that provide them with this system's package" \
        "manager, then rerun make." >&2
    exit 1
fi
if [[ "$(id -u)" == 0 ]]; then
    as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "error: missing system libraries: $sonames (needed by Mooncake's transfer engine," \
        "the pd extra). As root run: apt-get install -y $packages" \
        "-- then rerun make." >&2
    exit 1
fi

echo "installing system libraries: $packages"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
resolved=()
for pkg in $packages; do
    # Debian 13 and Ubuntu 24.04 renamed some libraries with a t64 suffix.
    if ! apt-cache show "$pkg" >/dev/null 2>&1 && apt-cache show "${pkg}t64" >/dev/null 2>&1; then
        pkg="${pkg}t64"
    fi
    resolved+=("$pkg")
done
"${as_root[@]}" apt-get install -y -qq "${resolved[@]}" >/dev/null

still=$(missing_libs)
if [[ -n "$still" ]]; then
    echo "error: still missing after apt-get install: $(awk '{print $1}' <<<"$still" | xargs)" >&2
    exit 1
fi
