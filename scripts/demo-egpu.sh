#!/usr/bin/env bash
# A recorded Thunderbolt 4 eGPU host, in the kernel's sysfs formats, for the host agent's
# `--root`: root port 00:1c.4 → Thunderbolt controller (05:00.0 → 06:01.0) → tunnel →
# enclosure switch (08:00.0 → 09:01.0) → GPU 0a:00.0 (16.0 GT/s x4, vfio-pci) + its audio
# function. Everything it writes is simulated; nothing here touches the real /sys.
#
#   demo-egpu.sh tree DIR                 write the tree under DIR
#   demo-egpu.sh link DIR SPEED WIDTH     set the GPU link, e.g. "2.5 GT/s PCIe" 1
#   demo-egpu.sh stop POD                 end the POD workload and remove its cgroups
#   demo-egpu.sh cycle DIR PERIOD [POD]   every PERIOD seconds: drop the link to 2.5 GT/s x1
#                                         for PERIOD/2 seconds, then restore 16.0 GT/s x4; with
#                                         POD (a pod-shaped cgroup directory) also run a small
#                                         workload there that is starved of CPU while the link
#                                         is down, as a GPU feeder would stall (simulated)
set -euo pipefail

GPU=pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:01.0/0000:08:00.0/0000:09:01.0/0000:0a:00.0

aer_text() { # names... then TOTAL name
  local total=$1; shift
  for n in "$@"; do echo "$n 0"; done
  echo "$total 0"
}

# write FILE TEXT: via a temporary name and a rename, so a reader never sees half a value
write() {
  mkdir -p "$(dirname "$1")"
  printf '%s\n' "$2" >"$1.tmp~"
  mv "$1.tmp~" "$1"
}

pci() { # root devpath bdf class vendor device speed width max_speed max_width driver removable
  local root=$1 path=$2 bdf=$3 dir="$1/sys/devices/$2"
  mkdir -p "$dir/power"
  write "$dir/class" "$4"
  write "$dir/vendor" "$5"
  write "$dir/device" "$6"
  write "$dir/current_link_speed" "$7"
  write "$dir/current_link_width" "$8"
  write "$dir/max_link_speed" "$9"
  write "$dir/max_link_width" "${10}"
  write "$dir/removable" "${12}"
  write "$dir/power/runtime_status" active
  write "$dir/power_state" D0
  aer_text TOTAL_ERR_COR RxErr BadTLP BadDLLP Rollover Timeout NonFatalErr CorrIntErr HeaderOF >"$dir/aer_dev_correctable"
  local uncor=(Undefined DLP SDES TLP FCP CmpltTO CmpltAbrt UnxCmplt RxOF MalfTLP ECRC UnsupReq ACSViol UncorrIntErr BlockedTLP AtomicOpBlocked TLPBlockedErr PoisonTLPBlocked)
  aer_text TOTAL_ERR_NONFATAL "${uncor[@]}" >"$dir/aer_dev_nonfatal"
  aer_text TOTAL_ERR_FATAL "${uncor[@]}" >"$dir/aer_dev_fatal"
  mkdir -p "$root/sys/bus/pci/drivers/${11}" "$root/sys/bus/pci/devices"
  ln -sfn "$root/sys/bus/pci/drivers/${11}" "$dir/driver"
  ln -sfn "../../../devices/$path" "$root/sys/bus/pci/devices/$bdf"
}

tree() {
  local r=$1
  mkdir -p "$r/sys/devices" "$r/sys/bus/pci/devices" "$r/run" "$r/proc" "$r/dev"
  : >"$r/dev/kmsg"
  local rp=pci0000:00/0000:00:1c.4
  pci "$r" $rp 0000:00:1c.4 0x060400 0x8086 0x7ab8 "8.0 GT/s PCIe" 4 "8.0 GT/s PCIe" 4 pcieport fixed
  for f in cor fatal nonfatal; do write "$r/sys/devices/$rp/aer_rootport_total_err_$f" 0; done
  pci "$r" $rp/0000:05:00.0 0000:05:00.0 0x060400 0x8086 0x15ef "8.0 GT/s PCIe" 4 "8.0 GT/s PCIe" 4 pcieport fixed
  pci "$r" $rp/0000:05:00.0/0000:06:01.0 0000:06:01.0 0x060400 0x8086 0x15ef "2.5 GT/s PCIe" 4 "2.5 GT/s PCIe" 4 pcieport fixed
  pci "$r" $rp/0000:05:00.0/0000:06:01.0/0000:08:00.0 0000:08:00.0 0x060400 0x8086 0x1136 "2.5 GT/s PCIe" 4 "2.5 GT/s PCIe" 4 pcieport removable
  pci "$r" $rp/0000:05:00.0/0000:06:01.0/0000:08:00.0/0000:09:01.0 0000:09:01.0 0x060400 0x8086 0x1136 "16.0 GT/s PCIe" 4 "16.0 GT/s PCIe" 4 pcieport removable
  pci "$r" $GPU 0000:0a:00.0 0x030000 0x10de 0x2684 "16.0 GT/s PCIe" 4 "16.0 GT/s PCIe" 4 vfio-pci removable
  pci "$r" ${GPU%.0}.1 0000:0a:00.1 0x040300 0x10de 0x22ba "16.0 GT/s PCIe" 4 "16.0 GT/s PCIe" 4 vfio-pci removable
}

link() {
  write "$1/sys/devices/$GPU/current_link_speed" "$2"
  write "$1/sys/devices/$GPU/current_link_width" "$3"
  # the enclosure's downstream port is the other end of the same link
  write "$1/sys/devices/${GPU%/*}/current_link_speed" "$2"
  write "$1/sys/devices/${GPU%/*}/current_link_width" "$3"
}

# run CGROUP CMD...: CMD in the cgroup directory CGROUP (created), in the background
run_in() {
  mkdir -p "$1"
  local cg=$1; shift
  sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cg" "$@" &
}

# The demo pod: one container that wakes every 2 ms (its run-queue waits are the signal) and,
# while the link is down, a second container of CPU hogs on the same CPU.
workload_start() {
  run_in "$1/feeder" taskset -c 0 perl -e 'select(undef, undef, undef, 0.002) while 1'
}
starve() {
  for _ in 1 2 3 4 5 6; do run_in "$1/hogs" taskset -c 0 sh -c 'while :; do :; done'; done
}
unstarve() {
  [ -f "$1/hogs/cgroup.procs" ] && xargs -r kill <"$1/hogs/cgroup.procs" 2>/dev/null || true
}
stop_all() {
  for c in "$1/hogs" "$1/feeder"; do
    [ -f "$c/cgroup.procs" ] && xargs -r kill -9 <"$c/cgroup.procs" 2>/dev/null || true
  done
  sleep 0.2
  rmdir "$1/hogs" "$1/feeder" "$1" 2>/dev/null || true
}

case "${1:-}" in
  tree) tree "$2" ;;
  link) link "$2" "$3" "$4" ;;
  stop) stop_all "$2" ;;
  cycle)
    half=$(( $3 / 2 ))
    pod=${4:-}
    if [ -n "$pod" ]; then
      trap 'stop_all "$pod"; exit 0' TERM INT EXIT
      workload_start "$pod"
    fi
    while :; do
      sleep "$half"
      echo "demo-egpu: [simulated] GPU link 16.0 GT/s x4 -> 2.5 GT/s x1${pod:+; the demo pod feeder is starved of CPU}"
      link "$2" "2.5 GT/s PCIe" 1
      [ -n "$pod" ] && starve "$pod"
      sleep "$half"
      echo "demo-egpu: [simulated] GPU link restored to 16.0 GT/s x4"
      link "$2" "16.0 GT/s PCIe" 4
      [ -n "$pod" ] && unstarve "$pod"
    done ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
