/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * Per-cgroup values, in cgroup-local storage where the kernel can, in a hash map
 * keyed by cgroup id where it cannot.
 *
 * CGROUP_STORAGE(name, value_type) declares
 *  - `name`: BPF_MAP_TYPE_CGRP_STORAGE (6.2): an O(1) lookup cached in the cgroup,
 *    created on first use and freed by the kernel with the cgroup;
 *  - `name_by_id`: a hash map (cgroup id -> value) for kernels without cgroup storage
 *    (Debian 12's 6.1), and for programs whose cgroup pointer the verifier does not
 *    trust for storage (the socket's cgroup, `sk_cgrp_data.cgroup`, on some builds).
 *    It is bounded (`max_entries`, set by the agent), an insert into a full map is
 *    counted by the caller as an allocation failure, and entries leave at
 *    `cgroup_rmdir` (CGROUP_DRAIN);
 *  - `name_get(cg, create)`: the value of a cgroup (NULL when absent, or when it
 *    could not be made).
 * Which one a program uses is `cgroup_storage_by_id`, read-only data the agent sets
 * before load: the verifier removes the branch not taken, so the other map's helper or
 * map type never reaches a kernel that lacks it, and the agent does not create the
 * unused map.
 */
#ifndef GPUFEED_CGROUP_STORAGE_H
#define GPUFEED_CGROUP_STORAGE_H

/* set by the agent before load: true = the hash maps keyed by cgroup id */
const volatile bool cgroup_storage_by_id = false;

#define CGROUP_STORAGE(name, value_type)                                                \
	struct {                                                                        \
		__uint(type, BPF_MAP_TYPE_CGRP_STORAGE);                                \
		__uint(map_flags, BPF_F_NO_PREALLOC);                                   \
		__type(key, int);                                                       \
		__type(value, value_type);                                              \
	} name SEC(".maps");                                                            \
                                                                                        \
	struct {                                                                        \
		__uint(type, BPF_MAP_TYPE_HASH);                                        \
		__uint(map_flags, BPF_F_NO_PREALLOC);                                   \
		__uint(max_entries, 16384); /* the agent sets it */                     \
		__type(key, __u64);                                                     \
		__type(value, value_type);                                              \
	} name##_by_id SEC(".maps");                                                    \
                                                                                        \
	/* a zeroed value to insert from: values are larger than the BPF stack */      \
	struct {                                                                        \
		__uint(type, BPF_MAP_TYPE_ARRAY);                                       \
		__uint(max_entries, 1);                                                 \
		__type(key, __u32);                                                     \
		__type(value, value_type);                                              \
	} name##_zero SEC(".maps");                                                     \
                                                                                        \
	static __always_inline value_type *name##_by_id_get(__u64 id, bool create)      \
	{                                                                               \
		value_type *v = bpf_map_lookup_elem(&name##_by_id, &id), *zero;         \
		__u32 z = 0;                                                            \
                                                                                        \
		if (v || !create)                                                       \
			return v;                                                       \
		zero = bpf_map_lookup_elem(&name##_zero, &z);                           \
		if (!zero)                                                              \
			return 0;                                                       \
		/* another CPU may insert it first (EEXIST): the lookup finds theirs */ \
		bpf_map_update_elem(&name##_by_id, &id, zero, BPF_NOEXIST);             \
		return bpf_map_lookup_elem(&name##_by_id, &id);                         \
	}                                                                               \
                                                                                        \
	static __always_inline value_type *name##_get(struct cgroup *cg, bool create)   \
	{                                                                               \
		if (cgroup_storage_by_id)                                               \
			return name##_by_id_get(cg->kn->id, create);                    \
		return bpf_cgrp_storage_get(&name, cg, 0,                               \
					    create ? BPF_LOCAL_STORAGE_GET_F_CREATE : 0); \
	}

#endif
