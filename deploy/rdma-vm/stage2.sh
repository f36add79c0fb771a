#!/bin/sh
# rdma-vm stage 2 (PID 1 on the overlay root, the host's own /bin/sh, modprobe, ip, rdma): bring up
# Soft-RoCE on one end of a veth pair, run the job's cmd.sh, write its exit status, power off.
# Files in the job folder ($1): cmd.sh (input); ready (uptime when rxe0 was ACTIVE), stdout,
# stderr, status (outputs); setup-error when the device could not be brought up.
job=$1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
grep -q 'frvm.debug=1' /proc/cmdline && set -x
# power off at once; should that fail, PID 1 exits: the kernel panics and qemu (-no-reboot) stops
off() { sync; echo o > /proc/sysrq-trigger; sleep 10; exit 1; }
fail() { { echo "rdma-vm: $*"; echo "mounts:"; cat /proc/mounts; } | tee "$job/setup-error" > /dev/console; off; }

mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /dev/shm /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t devpts devpts /dev/pts
kver=$(uname -r)
# the unpacked kernel's modules, where modprobe looks for them
mods=$(sed -n 's/.*frvm.modules=\([^ ]*\).*/\1/p' /proc/cmdline)
[ -d "$mods" ] || fail "no module tree at frvm.modules=$mods"
mkdir -p "/lib/modules/$kver" && mount --bind "$mods" "/lib/modules/$kver" || fail "cannot bind $mods"
ip link set lo up
modprobe veth || fail "modprobe veth failed"
modprobe rdma_rxe || fail "modprobe rdma_rxe failed"
ip link add veth0 type veth peer name veth1 || fail "cannot create veth0/veth1"
ip addr add 10.55.0.1/24 dev veth0
ip addr add 10.55.0.2/24 dev veth1
ip link set veth1 up
ip link set veth0 up
rdma link add rxe0 type rxe netdev veth0 || fail "rdma link add rxe0 failed"
i=0
until grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null; do
  i=$((i + 1))
  [ $i -gt 300 ] && fail "rxe0 not ACTIVE after 30 s: $(cat /sys/class/infiniband/rxe0/ports/1/state 2>&1)"
  sleep 0.1
done
# GID 1 (RoCE v2, IPv4-mapped) appears once the address is there; wait for it as well
i=0
until [ -n "$(cat /sys/class/infiniband/rxe0/ports/1/gids/1 2>/dev/null | tr -d '0:')" ]; do
  i=$((i + 1))
  [ $i -gt 100 ] && break
  sleep 0.1
done
cut -d' ' -f1 /proc/uptime > "$job/ready.tmp" && mv "$job/ready.tmp" "$job/ready"

sh "$job/cmd.sh" > "$job/stdout" 2> "$job/stderr" < /dev/null
echo $? > "$job/status.tmp"
sync
mv "$job/status.tmp" "$job/status"
off
