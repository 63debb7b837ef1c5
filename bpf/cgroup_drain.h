/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * A cgroup's last numbers, kept past its removal.
 *
 * Userspace reads cgroup-local storage through an open fd of the cgroup's
 * directory, and the kernel refuses that once the cgroup is offline (rmdir).
 * The storage itself lives on until the cgroup is freed, so whatever happened
 * since the agent's last read, or the whole life of a cgroup shorter than one
 * interval, would be lost. CGROUP_DRAIN(storage, value_type) adds a hash map
 * `<storage>_drained` (cgroup id -> the storage value as it was at rmdir) and
 * a program on the cgroup_rmdir tracepoint that fills it; the agent reads and
 * deletes the entries each tick and adds them to the cgroup's owner.
 *
 * With storage keyed by cgroup id (cgroup_storage.h) the entry is also deleted from
 * the id map here: that map is bounded, and a removed cgroup's id never comes back.
 *
 * At cgroup_rmdir the cgroup has no task left (the kernel refuses to remove a
 * populated cgroup), so its run-queue waits are complete; sockets the cgroup
 * created may outlive it, and what they count after the rmdir is not drained.
 *
 * Typed BTF pointers only: the programs also load under lockdown.
 */
#ifndef GPUFEED_CGROUP_DRAIN_H
#define GPUFEED_CGROUP_DRAIN_H

/* Removed cgroups not yet read by the agent (one tick's worth of pod churn at
 * most). Entries are allocated on insert (no prealloc): the map costs nothing
 * while it is empty. */
#define CGROUP_DRAIN_MAX 4096

#define CGROUP_DRAIN(storage, value_type)                                               \
	struct {                                                                        \
		__uint(type, BPF_MAP_TYPE_HASH);                                        \
		__uint(map_flags, BPF_F_NO_PREALLOC);                                   \
		__uint(max_entries, CGROUP_DRAIN_MAX);                                  \
		__type(key, __u64);                                                     \
		__type(value, value_type);                                              \
	} storage##_drained SEC(".maps");                                               \
                                                                                        \
	/* [0] set when an entry was added since the agent last looked: an       \
	 * empty hash map's read still walks every bucket, so a tick without      \
	 * removals reads this word (shared memory) instead */                    \
	struct {                                                                        \
		__uint(type, BPF_MAP_TYPE_ARRAY);                                       \
		__uint(map_flags, BPF_F_MMAPABLE);                                      \
		__uint(max_entries, 1);                                                 \
		__type(key, __u32);                                                     \
		__type(value, __u64);                                                   \
	} storage##_drain_added SEC(".maps");                                           \
                                                                                        \
	SEC("tp_btf/cgroup_rmdir")                                                      \
	int BPF_PROG(storage##_rmdir, struct cgroup *cgrp, const char *path)            \
	{                                                                               \
		value_type *v = storage##_get(cgrp, false);                             \
		__u64 id, *added;                                                       \
		__u32 zero = 0;                                                         \
                                                                                        \
		if (!v)                                                                 \
			return 0;                                                       \
		id = cgrp->kn->id;                                                      \
		bpf_map_update_elem(&storage##_drained, &id, v, BPF_ANY);               \
		if (cgroup_storage_by_id)                                               \
			bpf_map_delete_elem(&storage##_by_id, &id);                     \
		/* after the entry: the agent clears the word, then reads the map */    \
		added = bpf_map_lookup_elem(&storage##_drain_added, &zero);             \
		if (added)                                                              \
			__sync_fetch_and_add(added, 1);                                 \
		return 0;                                                               \
	}

#endif
