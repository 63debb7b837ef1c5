/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * The set of cgroups whose storage changed since the agent's last read, so
 * that a tick reads the cgroups that had activity, not every cgroup that
 * exists.
 *
 * Userspace bumps `active_epoch[0]` at each tick, then reads and deletes the
 * set. A probe calls mark_active() with the `epoch` field of the cgroup's
 * storage value: only the cgroup's first event of an epoch touches the shared
 * hash map; the others cost one inlined array lookup and a compare. If the set
 * is full, `active_epoch[1]` is set and the agent reads every cgroup once.
 */
#ifndef GPUFEED_CGROUP_ACTIVE_H
#define GPUFEED_CGROUP_ACTIVE_H

/* [0] the agent's epoch (starts at 1, so fresh zeroed storage is marked),
 * [1] non-zero when an insert failed since the agent last looked */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} active_epoch SEC(".maps");

/* cgroup id -> unused; sized by userspace before load */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u8);
} active_cgroups SEC(".maps");

static __always_inline void mark_active(struct cgroup *cg, __u64 *seen)
{
	__u32 zero = 0, one = 1;
	__u64 *epoch = bpf_map_lookup_elem(&active_epoch, &zero), *full, id;
	__u8 v = 1;

	if (!epoch || *seen == *epoch)
		return;
	*seen = *epoch;
	id = cg->kn->id;
	if (bpf_map_update_elem(&active_cgroups, &id, &v, BPF_ANY)) {
		full = bpf_map_lookup_elem(&active_epoch, &one);
		if (full)
			*full = 1;
	}
}

#endif
