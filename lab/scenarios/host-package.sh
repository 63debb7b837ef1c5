#!/bin/bash
# The host agent's package under a real systemd (PID 1 of this VM): install enables and
# starts it, the unit's sandbox lets it do what it needs (its tracefs instance, /dev/kmsg,
# sysfs, the bridges in another network namespace, the spool), journald gets its structured
# fields, an upgrade restarts it, the watchdog restarts it when a watcher wedges, remove
# stops it and purge leaves nothing. Run as gpufeed-lab.service (lab/guest/).
. /payload/lab.sh
unit=gpufeed-host

report systemd "$(systemctl --version | head -n1)"
report kernel "$(uname -r)"

# what the real systemd thinks of the service, and its main pid
state() { systemctl show -p ActiveState --value "$unit"; }
mainpid() { systemctl show -p MainPID --value "$unit"; }
restarts() { systemctl show -p NRestarts --value "$unit"; }
wait_active() { # SECONDS -> reports the state reached
	local i
	for i in $(seq 1 $(($1 * 10))); do
		[ "$(state)" = active ] && break
		sleep 0.1
	done
	state
}
metrics() { curl -sf http://127.0.0.1:9847/metrics || true; }
metric() { # NAME LABEL=VALUE -> the value of the series with that label (others: any)
	metrics | grep -E "^$1\{(.*,)?$2(,.*)?\} " | awk '{ print $2 }' | head -n1
}

# install: enabled, started (Type=notify: active once it said READY=1)
apt-get install -y -q /payload/gpufeed-host_old.deb >/tmp/apt.log 2>&1 ||
	{ report error "apt install: $(tail -n 5 /tmp/apt.log | tr '\n' ' ')"; false; }
report installed "$(dpkg-query -W -f '${Version}' gpufeed-host)"
report enabled "$(systemctl is-enabled "$unit")"
report started "$(wait_active 60)"

# a Proxmox-shaped host: a bridge in a namespace of its own with a VM's tap on it, a VM
# config, and a stream to a guest that is not there (its events wait in the spool)
ip netns add pvebr
ip -n pvebr link add vmbr0 type bridge
ip -n pvebr link add tap100i0 type veth peer name vm100
ip -n pvebr link set tap100i0 master vmbr0
for l in vmbr0 tap100i0 vm100; do ip -n pvebr link set "$l" up; done
mkdir -p /etc/pve/qemu-server /run/qemu-server
printf 'name: lab\nnet0: virtio=BC:24:11:00:00:01,bridge=vmbr0\n' >/etc/pve/qemu-server/100.conf
/usr/bin/gpufeed-host certs init --out /root/certs --guest-addr 10.0.2.99:7845 --host lab >/dev/null
cp -a /root/certs/hosts/lab/. /etc/gpufeed/
cat >>/etc/gpufeed/host.toml <<'EOF'

[bridge]
netns = "/run/netns/pvebr"
EOF
systemctl restart "$unit"
report configured "$(wait_active 60)"
# the tracepoints watcher and the others, as the running service reports them
for _ in $(seq 1 100); do
	[ -n "$(metric gpufeed_host_watcher_enabled 'watcher="bridge"')" ] && break
	sleep 0.2
done
for w in tracepoints kmsg aer pcie bridge vm; do
	report watcher "$w $(metric gpufeed_host_watcher_enabled "watcher=\"$w\"")"
done
report instance "$(test -d /sys/kernel/tracing/instances/gpufeed && echo present || echo absent)"
report instance_events "$(cat /sys/kernel/tracing/instances/gpufeed/events/ras/aer_event/enable 2>/dev/null)"
report bridge_series "$(metrics | grep -c '^gpufeed_host_bridge_bytes_total{.*port="tap100i0"' || true)"
# the guest's spool, named as `certs init` names the guest: by its address's host part
report spool "$( (ls /var/lib/gpufeed/spool/10.0.2.99 2>/dev/null || true) | tr '\n' ' ')"
report tracefs_log "$(journalctl -u "$unit" -b --no-pager -o cat | grep -m1 -i 'tracefs' || true)"
# structured fields: the unit's records carry WATCHER (and the others) as journal fields
report journal_fields "$(journalctl -u "$unit" -b -o json --no-pager | grep -o '"WATCHER":"[a-z_]*"' | sort -u | tr '\n' ' ')"
report security "$(systemd-analyze security "$unit" 2>/dev/null | tail -n1)"

# upgrade and watchdog: dpkg's restart and systemd's watchdog protocol, the same on every
# systemd; the test asks for them on one variant (/payload/short leaves them out)
if [ ! -e /payload/short ]; then
# upgrade: the new package restarts the running service
before=$(mainpid)
apt-get install -y -q /payload/gpufeed-host_new.deb >/tmp/apt.log 2>&1 ||
	{ report error "apt upgrade: $(tail -n 5 /tmp/apt.log | tr '\n' ' ')"; false; }
report upgraded "$(dpkg-query -W -f '${Version}' gpufeed-host) $(wait_active 60)"
report restarted "$before $(mainpid)"
report config_kept "$(grep -c 'netns = "/run/netns/pvebr"' /etc/gpufeed/host.toml)"

# watchdog: a VM whose pid file is a FIFO nobody writes wedges the VM watcher's poll; the
# pings stop and systemd restarts the service (WatchdogSec)
n=$(restarts)
mkfifo /run/qemu-server/100.pid
for _ in $(seq 1 900); do
	[ "$(restarts)" != "$n" ] && break
	sleep 0.1
done
report watchdog "$n $(restarts)"
report watchdog_log "$(journalctl -u "$unit" -b --no-pager | grep -m1 -i 'watchdog timeout' || true)"
rm -f /run/qemu-server/100.pid
systemctl restart "$unit"
report recovered "$(wait_active 60)"
fi

# remove stops it and keeps the configuration; purge removes that and the spool
apt-get remove -y -q gpufeed-host >/tmp/apt.log 2>&1
report removed "$(systemctl show -p LoadState --value "$unit") $(pgrep -x gpufeed-host >/dev/null && echo running || echo stopped) $(test -e /etc/gpufeed/host.toml && echo config-kept || echo config-gone)"
apt-get purge -y -q gpufeed-host >/tmp/apt.log 2>&1
report purged "$(test -e /etc/gpufeed/host.toml && echo config-kept || echo config-gone) $(test -e /var/lib/gpufeed && echo spool-kept || echo spool-gone)"
lab_done
