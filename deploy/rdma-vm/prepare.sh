#!/usr/bin/env bash
# Prepare what `fate-rdma vm run` boots: a stock Debian kernel and a small busybox initramfs.
#
#   deploy/rdma-vm/prepare.sh [CACHE_DIR]
#
# CACHE_DIR (default: $FATE_RDMA_VM_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/fate-rdma/vm) receives
#   kernel-<ver>/      the linux-image package unpacked with `dpkg -x` and `depmod -b` (nothing goes
#                      to /boot, the host's kernel is untouched)
#   initramfs-<hash>.cpio.gz   busybox + the modules needed to mount the host's root over 9p, + init
#   vm.env             KVER, VMLINUZ, INITRD, MODULES: what the runner reads
# Needs, from apt: qemu-system-x86 kmod cpio busybox-static (installed here when root and missing),
# and rdma-core + iproute2 on the host root, which the guest uses as its own root.
# Idempotent: a second run with the same kernel and the same init scripts does nothing.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${1:-${FATE_RDMA_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fate-rdma/vm}}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
say() { echo "rdma-vm prepare: $*" >&2; }

need_pkgs=()
command -v qemu-system-x86_64 >/dev/null || need_pkgs+=(qemu-system-x86)
command -v depmod >/dev/null || need_pkgs+=(kmod)
command -v cpio >/dev/null || need_pkgs+=(cpio)
static_busybox() {  # the initramfs has no libc: busybox must be the static build
  [ -x /bin/busybox ] || return 1
  /bin/busybox --list 2>/dev/null | grep -x switch_root >/dev/null || return 1
  { ldd /bin/busybox 2>&1 || true; } | grep -Eq "not a dynamic|statically linked"
}
static_busybox || need_pkgs+=(busybox-static)
command -v rdma >/dev/null || need_pkgs+=(iproute2)
[ -e /usr/sbin/ibv_devinfo ] || [ -e /usr/bin/ibv_devinfo ] || need_pkgs+=(ibverbs-utils rdma-core ibverbs-providers)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${need_pkgs[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
  else
    say "missing: ${need_pkgs[*]}; as root run: apt-get install ${need_pkgs[*]}"
    exit 3
  fi
fi

# The kernel: whatever linux-image-amd64 depends on (a 6.1 kernel on Debian 12; it has rdma_rxe).
kpkg=${FATE_RDMA_VM_KERNEL_PKG:-}
if [ -z "$kpkg" ]; then
  kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
if [ -z "$kpkg" ]; then
  # an offline re-run: keep the kernel already unpacked
  kdir=$(ls -d "$cache"/kernel-* 2>/dev/null | sort -V | tail -n 1 || true)
  [ -n "$kdir" ] || { say "cannot resolve linux-image-amd64 (apt-get update?) and no kernel in $cache"; exit 3; }
  kver=${kdir##*/kernel-}
else
  kver=${kpkg#linux-image-}
  kdir=$cache/kernel-$kver
fi
if [ ! -e "$kdir/.unpacked" ]; then
  say "downloading $kpkg (about 70 MB) into $cache"
  tmp=$(mktemp -d "$cache/dl.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  # apt's sandbox user cannot write into root's cache folder; download from a world-writable one
  chmod 0777 "$tmp"
  (cd "$tmp" && apt-get download -q "$kpkg" 2>&1 | grep -v "unsandboxed" >&2 || true)
  deb=$(ls "$tmp"/*.deb 2>/dev/null | head -n 1)
  [ -n "$deb" ] || { say "apt-get download $kpkg failed"; exit 3; }
  rm -rf "$kdir" && mkdir -p "$kdir"
  dpkg -x "$deb" "$kdir"
  depmod -b "$kdir" "$kver"
  touch "$kdir/.unpacked"
  rm -rf "$tmp"; trap - EXIT
fi
vmlinuz=$kdir/boot/vmlinuz-$kver
[ -r "$vmlinuz" ] || { say "no kernel image at $vmlinuz"; exit 3; }
[ -e "$kdir/lib/modules/$kver/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko" ] || \
  [ -e "$kdir/lib/modules/$kver/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz" ] || \
  { say "kernel $kver has no rdma_rxe module"; exit 3; }

# The initramfs: only what mounting the host's root over virtio-9p with an overlay needs; rxe and
# veth load later from the unpacked tree, with the host's own modprobe.
hash=$(cat "$here/init" "$here/stage2.sh" "$0" | sha256sum | cut -c1-12)
initrd=$cache/initramfs-$kver-$hash.cpio.gz
if [ ! -s "$initrd" ]; then
  say "building $initrd"
  root=$(mktemp -d "$cache/initramfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  mkdir -p "$root"/{bin,proc,sys,dev,mnt/lower,mnt/rw,mnt/job,newroot,modules}
  cp /bin/busybox "$root/bin/busybox"
  : > "$root/modules/order"
  for m in virtio_pci 9pnet_virtio 9p overlay; do
    modprobe -d "$kdir" -S "$kver" --show-depends "$m" | while read -r kw path _; do
      [ "$kw" = insmod ] || continue  # "builtin X" lines need nothing
      base=${path##*/}
      grep -qx "$base" "$root/modules/order" && continue
      cp "$path" "$root/modules/$base"
      echo "$base" >> "$root/modules/order"
    done
  done
  install -m 0755 "$here/init" "$root/init"
  install -m 0755 "$here/stage2.sh" "$root/stage2.sh"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$initrd.tmp"
  mv "$initrd.tmp" "$initrd"
  rm -rf "$root"; trap - EXIT
  # older initramfs images of this kernel are stale now
  find "$cache" -maxdepth 1 -name "initramfs-$kver-*.cpio.gz" ! -name "${initrd##*/}" -delete
fi

cat > "$cache/vm.env.tmp" <<ENV
KVER=$kver
VMLINUZ=$vmlinuz
INITRD=$initrd
MODULES=$kdir/lib/modules/$kver
ENV
mv "$cache/vm.env.tmp" "$cache/vm.env"
echo "$cache/vm.env"
