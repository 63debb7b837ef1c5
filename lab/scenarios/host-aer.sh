#!/bin/bash
# The host agent on a kernel that owns AER and native PCIe hotplug (q35, a PCIe root port
# with a virtio-net function behind it, errors injected from QEMU's monitor by the test):
# `gpufeed-host watch --json` prints what the agent emits while the test injects errors and
# unplugs and replugs the device. The test sends `snapshot NAME` when it wants the agent's
# counters and events so far, `uptime` for the guest clock; `quit` ends the run.
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
# from a file: grep -m1 ends a pipe early, and under pipefail the writer's SIGPIPE would fail it
dmesg >/tmp/boot.log
report aer_owner "$(grep -m1 -o 'AER: enabled with IRQ [0-9]*' /tmp/boot.log || echo none)"
report hotplug_owner "$(grep -m1 -o 'OS now controls \[[A-Za-z ]*\]' /tmp/boot.log || echo none)"
report pci_events "$(ls /sys/kernel/tracing/events/pci 2>/dev/null | tr '\n' ' ' || true)"

cat >/tmp/host.toml <<EOF
host_id = "aerlab"
metrics_listen = "127.0.0.1:9847"
devices = ["$dev"]

[pcie]
poll_interval_ms = 30000

[aer]
poll_interval_ms = 500

[bridge]
enabled = false

[vm]
enabled = false

[host]
enabled = false
EOF
RUST_LOG=info,gpufeed_host::tracefs=debug /payload/gpufeed-host watch --json --config /tmp/host.toml --metrics-listen 127.0.0.1:9847 >/tmp/events.jsonl 2>/tmp/agent.log &
pid=$!
up=""
for _ in $(seq 1 600); do
	curl -sf -m 5 http://127.0.0.1:9847/metrics >/dev/null && { up=1; break; }
	kill -0 "$pid" 2>/dev/null || { report error "agent exited: $(tail -n 5 /tmp/agent.log | tr '\n' ' ')"; false; }
	sleep 0.1
done
[ -n "$up" ] || { report error "no /metrics from the agent: $(tail -n 8 /tmp/agent.log | tr '\n' ' ')"; false; }
sleep 1
report ready "$(grep -m1 -o 'tracefs: .*' /tmp/agent.log || echo 'no tracefs line')"

seen=0
while cmd=$(lab_command); do
	case "$cmd" in
	snapshot\ *)
		name=${cmd#snapshot }
		while read -r line; do
			report "$name-metric" "$line"
		done < <(curl -sf -m 10 http://127.0.0.1:9847/metrics | grep -E '^gpufeed_host_(aer_errors_total|aer_rootport_errors_total|pcie_link_width|events_total|watcher_enabled)' || true)
		total=$(wc -l </tmp/events.jsonl)
		# the lines after those seen, up to the count just taken, by one reader and no pipe: a
		# head that stops early leaves tail a SIGPIPE while events keep arriving, and pipefail
		# fails the scenario on it
		if [ "$total" -gt "$seen" ]; then
			while read -r line; do
				report "$name-event" "$line"
			done < <(sed -n "$((seen + 1)),${total}p" /tmp/events.jsonl)
		fi
		seen=$total
		report "$name-kmsg" "$(dmesg | grep -c 'PCIe Bus Error' || true)"
		report "$name-pciehp" "$(dmesg | grep -i 'pciehp' | tail -n 2 | tr '\n' ' ' || true)"
		while read -r line; do
			report "$name-log" "$line"
		done < <(grep -i 'tracefs' /tmp/agent.log | tail -n 5 || true)
		report "$name" done
		;;
	uptime)
		# the guest's clock (CLOCK_BOOTTIME, the monotonic clock of a VM that never
		# suspends) when the test acts: the events' monotonic_ns are measured against it
		report uptime "$(cut -d' ' -f1 /proc/uptime)"
		;;
	quit) break ;;
	esac
done
while IFS= read -r l; do report agent_log "$l"; done < <(tail -n 20 /tmp/agent.log)
lab_done
