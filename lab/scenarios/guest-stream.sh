#!/bin/bash
# The guest agent in a VM that the host agent (on the test machine) watches as Proxmox runs
# one: its NIC is a tap on a bridge the test made, its QEMU has a pid file and a QMP socket
# where Proxmox keeps them. The guest agent takes the host's event stream over that bridge
# (QUIC, mutual TLS with the certificates `certs init` made) and serves /metrics and
# /events to the test. Commands from the test: `counters` (this NIC's own byte counters),
# `kill-agent`, `start-agent`, `journal` (the sequence numbers the agent accepted), `quit`.
. /payload/lab.sh

nic=""
for n in /sys/class/net/*; do
	[ "$(basename "$n")" = lo ] && continue
	nic=$(basename "$n")
	break
done
[ -n "$nic" ] || { report error "no NIC"; false; }
ip addr add "$(cat /payload/guest-addr)/24" dev "$nic"
ip link set "$nic" up
mkdir -p /var/lib/gpufeed
iperf3 -s >/tmp/iperf.log 2>&1 &
until ss -ltn | grep -q ':5201 '; do sleep 0.1; done

start_agent() {
	/payload/gpufeed-guest run --no-kube --probes sched_latency --interval 500ms \
		--quic-listen 0.0.0.0:7845 --tls-dir /payload/tls --metrics-listen 0.0.0.0:9745 \
		--event-journal /var/lib/gpufeed/events.jsonl >>/tmp/agent.log 2>&1 &
	echo $! >/tmp/agent.pid
	for _ in $(seq 1 1200); do
		curl -sf http://127.0.0.1:9745/metrics >/dev/null && return 0
		sleep 0.1
	done
	report error "the guest agent did not start: $(tail -n 5 /tmp/agent.log | tr '\n' ' ')"
	false
}

start_agent
report ready "$nic"
while cmd=$(lab_command); do
	case "$cmd" in
	counters)
		report counters "$(cat "/sys/class/net/$nic/statistics/rx_bytes") $(cat "/sys/class/net/$nic/statistics/tx_bytes")"
		;;
	kill-agent)
		kill -9 "$(cat /tmp/agent.pid)"
		while kill -0 "$(cat /tmp/agent.pid)" 2>/dev/null; do sleep 0.1; done
		report killed
		;;
	start-agent)
		start_agent
		report started
		;;
	journal)
		while read -r l; do
			report journal "$l"
		done < <(grep -o '"boot":[0-9]*,"seq":[0-9]*' /var/lib/gpufeed/events.jsonl | tr -d '"a-z:' | tr ',' ' ')
		report journal_end "$(wc -l </var/lib/gpufeed/events.jsonl)"
		;;
	quit) break ;;
	esac
done
while IFS= read -r l; do report agent_log "$l"; done < <(tail -n 20 /tmp/agent.log)
lab_done
