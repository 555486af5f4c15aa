#!/bin/bash
# Builds the Debian packages vmhostd (vmhostd, vmhostctl, units, docs) and vmhost-agent (the static
# guest agent and its unit) with plain dpkg-deb from a staged tree: no debian/rules, no cargo-deb.
#
#   packaging/build-debs.sh [OUTDIR]      # default target/deb; prints the two .deb paths
#
# Builds the release binaries first (cargo reuses target/release); NO_BUILD=1 skips that and uses
# what is there. Needs dpkg-deb, cargo, and strip, objdump and readelf (binutils). See docs/packaging.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/deb}
mkdir -p "$out"
out=$(cd "$out" && pwd)

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
[ -n "$version" ] || { echo "build-debs: no version in Cargo.toml" >&2; exit 1; }
debversion="$version-1"
agent_target=x86_64-unknown-linux-gnu

if [ "${NO_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p vmhostd --bins
    # The same command as the guest-agent README and the test harness: static glibc.
    RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked -p vmhost-agent --target "$agent_target"
fi
for f in target/release/vmhostd target/release/vmhostctl "target/$agent_target/release/vmhost-agent"; do
    [ -x "$f" ] || { echo "build-debs: $f missing (run without NO_BUILD=1)" >&2; exit 1; }
done

stage=$(mktemp -d "$out/stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT

# The newest glibc symbol version the dynamic binaries need, for Depends.
glibc_dep() {
    local v
    v=$(objdump -T "$@" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1)
    echo "libc6 (>= $v), libgcc-s1"
}

# finish DIR NAME DEPENDS: control file, md5sums, maintainer scripts, then the .deb.
finish() {
    local dir=$1 name=$2 shlibs=$3 size
    install -d -m 0755 "$dir/DEBIAN"
    size=$(du -sk --exclude=DEBIAN "$dir" | cut -f1)
    sed -e "s/@VERSION@/$debversion/" -e "s/@SIZE@/$size/" -e "s/@SHLIBS@/$shlibs/" \
        "packaging/debian/$name/control.in" >"$dir/DEBIAN/control"
    for script in postinst prerm postrm; do
        install -m 0755 "packaging/debian/$name/$script" "$dir/DEBIAN/$script"
    done
    (cd "$dir" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | sort -z | xargs -0 md5sum) >"$dir/DEBIAN/md5sums"
    chmod 0644 "$dir/DEBIAN/control" "$dir/DEBIAN/md5sums"
    local deb="$out/${name}_${debversion}_amd64.deb"
    dpkg-deb --root-owner-group -Zxz --build "$dir" "$deb" >/dev/null
    echo "$deb"
}

copyright() {
    cat <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: vmhost

Files: *
Copyright: vmhost developers
License: Apache-2.0
 On Debian systems the full text of the license is in /usr/share/common-licenses/Apache-2.0.
EOF
}

# --- vmhostd ---
d=$stage/vmhostd
install -d -m 0755 "$d/usr/sbin" "$d/usr/bin" "$d/lib/systemd/system" "$d/usr/lib/modules-load.d" \
    "$d/usr/share/vmhostd" "$d/usr/share/doc/vmhostd"
strip -o "$d/usr/sbin/vmhostd" target/release/vmhostd
strip -o "$d/usr/bin/vmhostctl" target/release/vmhostctl
chmod 0755 "$d/usr/sbin/vmhostd" "$d/usr/bin/vmhostctl"
install -m 0644 packaging/systemd/vmhostd.service packaging/systemd/vmhostd.socket \
    packaging/systemd/vmhost-guests.service "$d/lib/systemd/system/"
install -m 0644 packaging/modules-load.d/vmhost.conf "$d/usr/lib/modules-load.d/vmhost.conf"
# The template postinst turns into /etc/vmhost/vmhostd.toml at first installation.
install -m 0644 packaging/vmhostd.toml.in "$d/usr/share/vmhostd/vmhostd.toml.in"
# sandbox.md comes with the daemon's own sandbox; shipped when present.
for doc in packaging security sandbox config access api lifecycle networking passthrough agent; do
    if [ -f "docs/$doc.md" ]; then
        install -m 0644 "docs/$doc.md" "$d/usr/share/doc/vmhostd/$doc.md"
    fi
done
copyright >"$d/usr/share/doc/vmhostd/copyright"
chmod 0644 "$d/usr/share/doc/vmhostd/copyright"
finish "$d" vmhostd "$(glibc_dep target/release/vmhostd target/release/vmhostctl)"

# --- vmhost-agent ---
d=$stage/vmhost-agent
install -d -m 0755 "$d/usr/sbin" "$d/lib/systemd/system" "$d/usr/share/doc/vmhost-agent"
strip -o "$d/usr/sbin/vmhost-agent" "target/$agent_target/release/vmhost-agent"
chmod 0755 "$d/usr/sbin/vmhost-agent"
if readelf -l "$d/usr/sbin/vmhost-agent" | grep -q 'INTERP'; then
    echo "build-debs: vmhost-agent is not static" >&2
    exit 1
fi
install -m 0644 guest-agent/vmhost-agent.service "$d/lib/systemd/system/vmhost-agent.service"
install -m 0644 guest-agent/vmhost-agent-exec.service "$d/lib/systemd/system/vmhost-agent-exec.service"
install -m 0644 guest-agent/README.md "$d/usr/share/doc/vmhost-agent/README.md"
copyright >"$d/usr/share/doc/vmhost-agent/copyright"
chmod 0644 "$d/usr/share/doc/vmhost-agent/copyright"
finish "$d" vmhost-agent ""
