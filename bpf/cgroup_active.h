/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * The set of cgroups whose storage changed since the agent's last read, so
 * that a tick reads the cgroups that had activity, not every cgroup that
 * exists.
 *
 * Userspace bumps `active_epoch[0]` at each tick (through shared memory),
 * then takes the ids out of the ring. A probe calls mark_active() with the
 * `epoch` field of the cgroup's storage value: only the cgroup's first event of an epoch writes
 * its id to the ring; the others cost one inlined array lookup and a compare.
 * If the ring is full, `active_epoch[1]` is set and the agent reads every
 * cgroup once.
 *
 * A ring rather than a hash map: the agent reads it through shared memory,
 * without a syscall, and its cost follows the ids written (a hash map's batch
 * read walks, and locks, every bucket of the map, however few entries it
 * holds). No wakeup: the agent polls it once a tick.
 */
#ifndef GPUFEED_CGROUP_ACTIVE_H
#define GPUFEED_CGROUP_ACTIVE_H

/* [0] the agent's epoch (starts at 1, so fresh zeroed storage is marked),
 * [1] non-zero when an insert failed since the agent last looked */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE); /* the agent reads and writes it without a syscall */
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} active_epoch SEC(".maps");

/* cgroup ids, one record each (8 bytes and an 8-byte header): room for
 * 16384 cgroups marked per tick */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16384 * 16);
} active_cgroups SEC(".maps");

static __always_inline void mark_active(struct cgroup *cg, __u64 *seen)
{
	__u32 zero = 0, one = 1;
	__u64 *epoch = bpf_map_lookup_elem(&active_epoch, &zero), *full, id;

	if (!epoch || *seen == *epoch)
		return;
	*seen = *epoch;
	id = cg->kn->id;
	if (bpf_ringbuf_output(&active_cgroups, &id, sizeof(id), BPF_RB_NO_WAKEUP)) {
		full = bpf_map_lookup_elem(&active_epoch, &one);
		if (full)
			*full = 1;
	}
}

#endif
