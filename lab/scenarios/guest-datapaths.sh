#!/bin/bash
# The guest agent on the datapaths the suite's own kernel lacks (it has neither netkit nor
# sch_fq): kubelet-shaped pods on netkit pairs, L3 and L2, with a CNI's programs in netkit's
# hooks on the primary (as Cilium attaches its own); one of them routed the way Cilium's host
# routing does (bpf_redirect_neigh from the peer hook to the node device, the socket kept) and
# shaped there by EDT with fq, as Cilium's bandwidth manager does; a netkit pair the wrong way
# round (its primary in the pod's namespace) and a pod whose namespace goes away. Reports the
# agent's series beside the interfaces', the CNI programs' and the qdisc's own counters; the
# test (lab/tests/guest_datapaths.rs) compares them.
. /payload/lab.sh
agent=/payload/gpufeed-guest
fix=/payload/lab_datapath
port=9750

report kernel "$(uname -r)"
modprobe sch_fq
echo 1 >/proc/sys/net/ipv4/ip_forward

# the node device: a veth into a namespace that stands for the rest of the network
ip netns add remote
ip link add node0 type veth peer name eth0 netns remote
ip addr add 10.219.9.1/24 dev node0
ip link set node0 up
ip -n remote addr add 10.219.9.2/24 dev eth0
ip -n remote link set eth0 up
ip -n remote link set lo up
ip -n remote route add default via 10.219.9.1
ip netns exec remote iperf3 -s -B 10.219.9.2 >/dev/null 2>&1 &
until ip netns exec remote ss -ltn | grep -q '10.219.9.2:5201'; do sleep 0.1; done

# kubelet-shaped pods (systemd driver layout), each with a process in its namespace
cg=/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice
mkdir -p "$cg"
declare -A pod_cg
pod() { # NAME: a namespace, a pod cgroup, a process of the pod in both
	local uid dir
	uid=$(cat /proc/sys/kernel/random/uuid)
	dir="$cg/kubepods-besteffort-pod${uid//-/_}.slice/cri-containerd-$(printf '%064x' "$RANDOM$RANDOM").scope"
	mkdir -p "$dir"
	pod_cg[$1]=$dir
	ip netns add "$1"
	ip -n "$1" link set lo up
	# into the cgroup first: `ip netns exec` mounts a sysfs of its own, without the cgroup tree
	sh -c "echo \$\$ > $dir/cgroup.procs; exec ip netns exec $1 sleep 3600" &
	report pod "$1 $uid"
}
in_pod() { # NAME COMMAND...: runs in the pod's cgroup and namespace
	local name=$1
	shift
	sh -c "echo \$\$ > ${pod_cg[$name]}/cgroup.procs; exec ip netns exec $name \"\$@\"" sh "$@"
}
netkit_pod() { # NAME MODE N: a netkit pair nkN (primary, here) / eth0 (the pod's), 10.219.N.0/30
	pod "$1"
	ip link add "nk$3" type netkit mode "$2" peer name eth0 netns "$1"
	ip addr add "10.219.$3.1/30" dev "nk$3"
	ip link set "nk$3" up
	ip -n "$1" addr add "10.219.$3.2/30" dev eth0
	ip -n "$1" link set eth0 up
	ip -n "$1" route add default via "10.219.$3.1"
}
netkit_pod nkl3 l3 3
netkit_pod nkl2 l2 4
netkit_pod nkedt l3 5
# the CNI's programs, in netkit's hooks on each primary, before the agent starts
$fix netkit /sys/fs/bpf/nkl3 nk3
$fix netkit /sys/fs/bpf/nkl2 nk4
$fix netkit /sys/fs/bpf/nkedt nk5 node0
# a pair the wrong way round: its primary in the pod's namespace, its peer here
pod nkbad
ip -n nkbad link add eth0 type netkit mode l3 peer name nkbad netns 1
ip link set nkbad up
ip -n nkbad link set eth0 up
report links "$(ip -br link | tr '\n' ';')"

report phase agent
$agent run --no-kube --metrics-listen "127.0.0.1:$port" --interval 200ms --probes tc \
	--node-devices node0 >/tmp/agent.log 2>&1 &
agent_pid=$!
metrics() { curl -sf "http://127.0.0.1:$port/metrics" || true; }
gauge() { metrics | awk -v n="$1" '$1 == n { print $2 }'; }
for _ in $(seq 1 1200); do
	kill -0 "$agent_pid" 2>/dev/null || break
	[ "$(gauge gpufeed_tc_interfaces)" = 3 ] && break
	sleep 0.1
done
report interfaces "$(gauge gpufeed_tc_interfaces)"
report netkit_interfaces "$(gauge gpufeed_tc_netkit_interfaces)"

# what each counter says now (PHASE): the pod side's own, the CNI programs', the agent's
snapshot() { # PHASE
	local p s
	local cni i s2
	for p in nkl3 nkl2 nkedt; do
		# the pod side's counters and the CNI programs' read at one moment: read again until
		# no packet crossed between (a stray one, an IPv6 solicitation, counted by one and
		# not yet by the other would be off by one)
		for i in $(seq 1 20); do
			s=$(ip netns exec "$p" sh -c 'cd /sys/class/net/eth0/statistics; echo $(cat tx_bytes rx_bytes tx_packets rx_packets)')
			cni=$($fix seen "/sys/fs/bpf/$p")
			s2=$(ip netns exec "$p" sh -c 'cd /sys/class/net/eth0/statistics; echo $(cat tx_bytes rx_bytes tx_packets rx_packets)')
			[ "$s" = "$s2" ] && break
		done
		# with the moment of the read: a rate over a window is taken from these, not from
		# the clock at the snapshot's end (the snapshot's length varies under emulation)
		report iface "$1 $p $s $(cut -d' ' -f1 /proc/uptime)"
		[ -z "$cni" ] || while read -r s; do report cni "$1 $p $s"; done <<<"$cni"
	done
	report host_rx "$1 $(cat /sys/class/net/nk5/statistics/rx_bytes)"
	while IFS= read -r s; do report metric "$1 $s"; done < <(metrics | grep -E '^(ebpf_tc_|gpufeed_tc_)' || true)
	while IFS= read -r s; do report qdisc "$1 $s"; done < <(tc -s qdisc show dev node0)
	report clock "$1 $(cut -d' ' -f1 /proc/uptime)"
}
settle() { sleep 1.5; } # several of the agent's ticks

report phase netkit
snapshot before
for p in nkl3:3 nkl2:4; do
	in_pod "${p%:*}" iperf3 -c 10.219.9.2 -n 3M >/tmp/up.log 2>&1 || report error "upload ${p%:*}: $(tail -n 3 /tmp/up.log | tr '\n' ' ')"
	in_pod "${p%:*}" iperf3 -c 10.219.9.2 -n 3M -R >/tmp/down.log 2>&1 || report error "download ${p%:*}: $(tail -n 3 /tmp/down.log | tr '\n' ' ')"
done
settle
snapshot after

# EDT: 500,000 bytes/s for the pod on node0, enforced by fq there. A TCP upload parks at
# the rate (its socket travels with the packets to fq: TCP small queues hold it back).
report phase edt
rate=500000
tc qdisc replace dev node0 root fq limit 20000 flow_limit 10000
$fix edt /sys/fs/bpf/edt1 node0 0 "10.219.5.2=$rate"
in_pod nkedt iperf3 -c 10.219.9.2 -t 18 >/tmp/edt.log 2>&1 &
up=$!
sleep 5
snapshot edt_start
sleep 10
snapshot edt_end
wait "$up" || true
settle
# the whole upload, from the quiet before it to the quiet after: the agent's count against
# the pod's own, with nothing in flight at either end
snapshot edt_done
while IFS= read -r l; do report iperf_edt "$l"; done < <(tail -n 4 /tmp/edt.log)

# fq's horizon: 50 ms. A UDP upload at twice the rate: what would leave after the horizon
# is fq's to drop, in the pod's socket's name.
report phase horizon
rm /sys/fs/bpf/edt1_edt
tc qdisc replace dev node0 root fq limit 20000 flow_limit 10000 horizon 50ms horizon_drop
$fix edt /sys/fs/bpf/edt2 node0 50000000 "10.219.5.2=$rate"
settle
snapshot drops_before
in_pod nkedt iperf3 -c 10.219.9.2 -u -b 8M -l 1200 -t 4 >/tmp/udp.log 2>&1 || true
settle
snapshot drops_after
while IFS= read -r l; do report iperf_udp "$l"; done < <(tail -n 4 /tmp/udp.log)

# the agent's own view of the datapath
report phase doctor
out=$($agent doctor --url "http://127.0.0.1:$port" 2>/dev/null) || true
while IFS= read -r l; do report doctor "$l"; done < <(grep -i datapath <<<"$out" || true)

# a pod's namespace goes away: its pair with it
report phase gone
pkill_pod() { # NAME: the pod's processes
	local p
	for p in $(cat "${pod_cg[$1]}/cgroup.procs"); do kill "$p" 2>/dev/null || true; done
}
pkill_pod nkl2
ip netns del nkl2
for _ in $(seq 1 100); do
	[ "$(gauge gpufeed_tc_interfaces)" = 2 ] && break
	sleep 0.1
done
report interfaces_after_gone "$(gauge gpufeed_tc_interfaces)"
report refusals "$(gauge gpufeed_tc_attach_refusals_total)"
kill -0 "$agent_pid" 2>/dev/null && report agent running || report agent exited
while IFS= read -r l; do report agent_log "$l"; done < <(grep -vi ' DEBUG ' /tmp/agent.log | tail -n 30)
lab_done
