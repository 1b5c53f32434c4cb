#!/usr/bin/env bash
# Builds the Debian package of flexstack with dpkg-deb: the binary (debug info stripped), bash/zsh/fish completions and
# man pages generated from the CLI (`flexstack completions`, `flexstack man`), the README and the example stacks,
# labs and rules under /usr/share/doc/flexstack/examples/. Depends are computed by dpkg-shlibdeps.
#
#   scripts/deb.sh [--binary FILE] [--out DIR] [--check]
#
# --binary FILE  package this build of flexstack (default: `cargo build --release --locked`, target/release/flexstack)
# --out DIR      where the .deb goes (default target/deb); its path is printed last
# --check        then unpack it into a scratch root (dpkg -x: the machine's own install is not touched) and check that
#                `flexstack --help`, `man flexstack` and bash completion work from there
set -euo pipefail
cd "$(dirname "$0")/.."

binary="" out=target/deb check=0
while (($#)); do
  case $1 in
    --binary) binary=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --check) check=1; shift ;;
    *) echo "usage: $0 [--binary FILE] [--out DIR] [--check]" >&2; exit 2 ;;
  esac
done
if [[ -z $binary ]]; then
  cargo build --release --locked --bin flexstack
  binary=target/release/flexstack
fi
[[ -x $binary ]] || { echo "deb: $binary is not an executable" >&2; exit 1; }

meta=$(cargo metadata --no-deps --format-version 1 --offline 2>/dev/null || cargo metadata --no-deps --format-version 1)
field() { python3 -c 'import json,sys; p=[p for p in json.load(sys.stdin)["packages"] if p["name"]=="flexstack"][0]; print(p[sys.argv[1]] or "")' "$1" <<<"$meta"; }
version=$(field version)
description=$(field description)
license=$(field license)
arch=$(dpkg --print-architecture)

work=$(mktemp -d "${TMPDIR:-/tmp}/flexstack-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
install -d "$root/DEBIAN" "$root/usr/bin" "$root/usr/share/man/man1" "$root/usr/share/bash-completion/completions" \
  "$root/usr/share/zsh/vendor-completions" "$root/usr/share/fish/vendor_completions.d" \
  "$root/usr/share/doc/flexstack/examples"
install -m 0755 "$binary" "$root/usr/bin/flexstack"
strip --strip-debug "$root/usr/bin/flexstack"
bin=$root/usr/bin/flexstack
"$bin" completions bash >"$root/usr/share/bash-completion/completions/flexstack"
"$bin" completions zsh >"$root/usr/share/zsh/vendor-completions/_flexstack"
"$bin" completions fish >"$root/usr/share/fish/vendor_completions.d/flexstack.fish"
"$bin" man --dir "$root/usr/share/man/man1"
gzip -9n "$root"/usr/share/man/man1/*.1
doc=$root/usr/share/doc/flexstack
install -m 0644 README.md "$doc/README.md"
cp -r stacks labs "$doc/examples/"
printf 'flexstack %s\nLicense: %s\n' "$version" "$license" >"$doc/copyright"
find "$root/usr/share" -type f -exec chmod 0644 {} +
find "$root" -type d -exec chmod 0755 {} +

# Depends: the shared libraries the binary links against, as dpkg-shlibdeps words them.
mkdir -p "$work/src/debian"
printf 'Source: flexstack\n\nPackage: flexstack\nArchitecture: any\n' >"$work/src/debian/control"
depends=$(cd "$work/src" && dpkg-shlibdeps -O -e"$bin" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat >"$root/DEBIAN/control" <<EOF
Package: flexstack
Version: $version
Architecture: $arch
Maintainer: flexstack developers <flexstack@localhost>
Installed-Size: $size
Depends: ${depends:-libc6}
Recommends: iproute2, nftables, bash-completion, man-db
Section: net
Priority: optional
Homepage: https://github.com/flexstack/flexstack
Description: $description
 flexstack puts a programmable stack between applications and the network:
 modules linked into a graph that can be changed while it runs, a daemon with a
 control API, "flexstack run" for unmodified programs and "flexstack lab" for
 emulated networks. Examples in /usr/share/doc/flexstack/examples.
EOF
mkdir -p "$out"
deb=$out/flexstack_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "deb: $(du -h "$deb" | cut -f1) $(dpkg-deb --contents "$deb" | wc -l) entries, Depends: ${depends:-libc6}" >&2

if ((check)); then
  scratch=$work/installed
  dpkg -x "$deb" "$scratch"
  dpkg-deb --field "$deb" Package Version Depends >&2
  "$scratch/usr/bin/flexstack" --help | grep -q '^Usage: flexstack' || { echo "deb: flexstack --help failed" >&2; exit 1; }
  page=$(MANPATH=$scratch/usr/share/man MANWIDTH=100 man -P cat flexstack 2>&1 | tr -s '[:space:]' ' ')
  grep -q 'NAME flexstack - A user-space, modular, runtime-reconfigurable network stack' <<<"$page" || { echo "deb: man flexstack: $page" >&2; exit 1; }
  MANPATH=$scratch/usr/share/man man -w flexstack-lab-run | grep -q "^$scratch/" ||
    { echo "deb: man flexstack-lab-run is not the package's" >&2; exit 1; }
  # Bash: the installed script defines the completion, and it completes `flexstack la` to `lab`.
  got=$(bash --norc --noprofile -c "source '$scratch/usr/share/bash-completion/completions/flexstack' &&
    complete -p flexstack >&2 && COMP_WORDS=(flexstack la) COMP_CWORD=1 COMP_LINE='flexstack la' COMP_POINT=12 &&
    _flexstack flexstack la flexstack && echo \"\${COMPREPLY[*]}\"")
  [[ $got == lab ]] || { echo "deb: bash completes 'flexstack la' to '$got', not 'lab'" >&2; exit 1; }
  ls "$scratch/usr/share/doc/flexstack/examples/stacks/example.toml" "$scratch/usr/share/doc/flexstack/examples/labs/demo.toml" >/dev/null
  echo "deb: checked in a scratch root: flexstack --help, man flexstack, bash completion, examples" >&2
fi
echo "$deb"
