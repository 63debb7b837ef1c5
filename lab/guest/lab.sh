# The lab's helpers for scenario scripts (bash), sourced by /payload/init. Sourcing mounts
# what a booted system has (where systemd has not) and opens the lab port.
#   report KEY VALUE...  one line to the test (lab port)
#   lab_command          the next command line from the test (blocks)
#   lab_done             report `done`, flush, power off
# A failing command of the scenario (set -e) reports `error <line>: <command>` and powers off.

set -eEuo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

lab_port() {
	local n
	for n in /sys/class/virtio-ports/*/name; do
		[ -e "$n" ] || continue
		if [ "$(cat "$n")" = lab.0 ]; then
			echo "/dev/$(basename "$(dirname "$n")")"
			return
		fi
	done
	echo /dev/console
}

lab_mount() { # TYPE DIR
	mkdir -p "$2"
	mountpoint -q "$2" || mount -t "$1" "$1" "$2"
}

lab_setup() {
	lab_mount proc /proc
	lab_mount sysfs /sys
	lab_mount tmpfs /run
	lab_mount tmpfs /tmp
	lab_mount cgroup2 /sys/fs/cgroup
	lab_mount tracefs /sys/kernel/tracing
	lab_mount securityfs /sys/kernel/security
	lab_mount bpf /sys/fs/bpf
	lab_mount devpts /dev/pts 2>/dev/null || true
	# process substitution and /dev/stdin need these; devtmpfs has no links
	[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
	[ -e /dev/stdin ] || ln -s /proc/self/fd/0 /dev/stdin
	[ -e /dev/stdout ] || ln -s /proc/self/fd/1 /dev/stdout
	[ -e /dev/stderr ] || ln -s /proc/self/fd/2 /dev/stderr
	ip link set lo up
	hostname lab
	# the controllers a kubelet's cgroups have
	echo "+cpu +memory +pids" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
}

lab_setup
if [ -z "${LAB_PORT:-}" ]; then
	LAB_PORT=$(lab_port)
	export LAB_PORT
	exec 7<>"$LAB_PORT"
fi

report() {
	printf '%s\n' "$*" >&7
}

lab_command() {
	local line
	IFS= read -r line <&7
	printf '%s\n' "$line"
}

lab_poweroff() {
	sync
	if [ -d /run/systemd/system ]; then
		systemctl --no-block poweroff
		sleep 60
	fi
	echo o > /proc/sysrq-trigger
}

lab_done() {
	report done
	lab_poweroff
}

lab_on_error() {
	report "error line ${BASH_LINENO[0]}: ${BASH_COMMAND}"
	lab_poweroff
}
trap lab_on_error ERR
