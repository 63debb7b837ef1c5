#!/bin/bash
# The host agent streaming out of a VM whose kernel owns AER and native PCIe hotplug (q35, a
# PCIe root port with a virtio-net function behind it), for the answer-latency benchmark
# (`lab/examples/answer_latency.rs`): the agent runs as the service does (`gpufeed-host run`,
# the product's intervals) and streams to a guest agent on the machine that runs the VM,
# through QEMU's user network (10.0.2.2 is that machine's loopback). The benchmark injects
# errors and unplugs/replugs the function over QMP. Commands: `clock` (this VM's clocks read
# together, to map the kernel's and the agent's timestamps onto the benchmark's clock),
# `enumerated` (when the kernel enumerated the function, each time), `quit`.
. /payload/lab.sh

dev=""
for d in /sys/bus/pci/devices/*; do
	if [ "$(cat "$d/vendor")" = 0x1af4 ] && [ -e "$d/aer_dev_correctable" ]; then
		dev=$(basename "$d")
		break
	fi
done
[ -n "$dev" ] || { report error "no virtio function with AER counters"; false; }
port=$(basename "$(readlink -f "/sys/bus/pci/devices/$dev/..")")
report device "$dev $port"

# the user-network NIC, known by the MAC the benchmark gave it
nic=""
for n in /sys/class/net/*; do
	[ "$(cat "$n/address")" = "$(cat /payload/mac)" ] && nic=$(basename "$n")
done
[ -n "$nic" ] || { report error "no NIC with $(cat /payload/mac)"; false; }
ip addr add 10.0.2.15/24 dev "$nic"
ip link set "$nic" up

cat >/tmp/host.toml <<EOF
host_id = "$(cat /payload/host-id)"
metrics_listen = "127.0.0.1:9847"
devices = ["$dev"]

[bridge]
enabled = false

[vm]
enabled = false

[host]
enabled = false

[stream]
ca = "/payload/tls/ca.pem"
cert = "/payload/tls/host.pem"
key = "/payload/tls/host-key.pem"
spool_dir = "/var/lib/gpufeed/spool"

[[stream.guests]]
name = "bench"
endpoint = "10.0.2.2:$(cat /payload/guest-port)"
server_name = "127.0.0.1"
EOF
mkdir -p /var/lib/gpufeed
RUST_LOG=info /payload/gpufeed-host run --config /tmp/host.toml >/tmp/agent.log 2>&1 &
pid=$!
up=""
for _ in $(seq 1 600); do
	curl -sf -m 5 http://127.0.0.1:9847/metrics >/dev/null && { up=1; break; }
	kill -0 "$pid" 2>/dev/null || { report error "agent exited: $(tail -n 5 /tmp/agent.log | tr '\n' ' ')"; false; }
	sleep 0.1
done
[ -n "$up" ] || { report error "no /metrics from the agent: $(tail -n 8 /tmp/agent.log | tr '\n' ' ')"; false; }
report ready "$(grep -m1 -o 'tracefs: .*' /tmp/agent.log || echo 'no tracefs line')"

marks=0
while cmd=$(lab_command); do
	case "$cmd" in
	clock)
		# CLOCK_REALTIME (bash's own, no fork) around CLOCK_MONOTONIC (timer_list's "now
		# at"), answered at once: the benchmark brackets the answer with its own clock
		r0=$EPOCHREALTIME
		{ read -r _; read -r _; read -r _ _ mono _; } </proc/timer_list
		r1=$EPOCHREALTIME
		report clock "$r0 $mono $r1"
		# then a kernel log record written right after a realtime reading: its printk stamp
		# gives the kernel log's clock against realtime
		marks=$((marks + 1))
		r2=$EPOCHREALTIME
		echo "gpufeed-lab-clock $marks" >/dev/kmsg
		dmesg >/tmp/dmesg.txt
		report kmsg_clock "$r2 $(sed -n "s/^\[ *\([0-9.]*\)\] gpufeed-lab-clock $marks\$/\1/p" /tmp/dmesg.txt)"
		;;
	enumerated)
		# the kernel's own record of each replug's enumeration ("pci BDF: [1af4:..."): the
		# add uevent follows it; its printk stamps, one line each
		dmesg >/tmp/dmesg.txt
		while read -r l; do
			report enumerated_at "$l"
		done < <(sed -n "s/^\[ *\([0-9.]*\)\] pci $dev: \[1af4:.*/\1/p" /tmp/dmesg.txt)
		report enumerated_end
		;;
	quit) break ;;
	esac
done
while IFS= read -r l; do report agent_log "$l"; done < <(tail -n 20 /tmp/agent.log)
lab_done
