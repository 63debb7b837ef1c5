/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * Reading many cgroups' storage with one syscall.
 *
 * From userspace, a BPF_MAP_TYPE_CGRP_STORAGE map is keyed by an open fd of
 * the cgroup's directory: one bpf() call per cgroup, and each resolves the fd
 * to its cgroup (fdget, kernfs, css_tryget) before it copies the value. With
 * hundreds of busy pods and a short interval those lookups were a quarter of
 * the agent's CPU. CGROUP_BATCH(storage, value_type, slots) adds a program
 * that does the same work for a whole list of cgroup ids in the kernel:
 *
 *  - `<storage>_batch`, an mmapable array of `slots` slots: the agent writes
 *    the ids it wants (through shared memory, no syscall), then
 *  - runs `<storage>_batch_read` once (BPF_PROG_RUN, a syscall program whose
 *    context is `struct cgroup_batch_args`): for each slot it takes the cgroup
 *    by id, copies its storage value into the slot and sets `found`,
 *  - and reads the values back from the same shared memory.
 *
 * A copy is not atomic against programs updating the value on other CPUs,
 * as with the per-fd lookup it replaces; the counters only grow, so a value
 * read mid-update is a little behind and the next read catches up.
 *
 * Needs the generic kfuncs in syscall programs (bpf_cgroup_from_id); on a
 * kernel without them the agent does not load the program and falls back to
 * one lookup per cgroup (probes/cgroup_batch.rs checks once at start).
 */
#ifndef GPUFEED_CGROUP_BATCH_H
#define GPUFEED_CGROUP_BATCH_H

extern struct cgroup *bpf_cgroup_from_id(__u64 cgid) __ksym __weak;
extern void bpf_cgroup_release(struct cgroup *cgrp) __ksym __weak;

/* BPF_PROG_RUN's context: how many slots the agent filled */
struct cgroup_batch_args {
	__u32 n;
};

/* Copies a value of constant size in pieces: clang expands a constant-size
 * memcpy into loads and stores only up to a limit, and BPF has no memcpy to
 * call for larger ones (a TCP value is 3.6 KiB). */
#define CGROUP_BATCH_PIECE 256

#define CGROUP_BATCH_COPY(dst, src, size)                                               \
	do {                                                                            \
		char *d_ = (char *)(dst);                                               \
		const char *s_ = (const char *)(src);                                   \
		_Pragma("unroll") for (int k_ = 0; k_ < (size) / CGROUP_BATCH_PIECE; k_++) \
			__builtin_memcpy(d_ + k_ * CGROUP_BATCH_PIECE,                  \
					 s_ + k_ * CGROUP_BATCH_PIECE, CGROUP_BATCH_PIECE); \
		__builtin_memcpy(d_ + (size) / CGROUP_BATCH_PIECE * CGROUP_BATCH_PIECE, \
				 s_ + (size) / CGROUP_BATCH_PIECE * CGROUP_BATCH_PIECE, \
				 (size) % CGROUP_BATCH_PIECE);                          \
	} while (0)

#define CGROUP_BATCH(storage, value_type, slots)                                        \
	struct storage##_slot {                                                         \
		__u64 id;    /* in: the cgroup's id (its kernfs node id) */             \
		__u64 found; /* out: 1 when the cgroup exists and has storage */        \
		value_type value;                                                       \
	};                                                                              \
                                                                                        \
	struct {                                                                        \
		__uint(type, BPF_MAP_TYPE_ARRAY);                                       \
		__uint(map_flags, BPF_F_MMAPABLE);                                      \
		__uint(max_entries, slots);                                             \
		__type(key, __u32);                                                     \
		__type(value, struct storage##_slot);                                   \
	} storage##_batch SEC(".maps");                                                 \
                                                                                        \
	static long storage##_batch_one(__u32 i, void *unused)                          \
	{                                                                               \
		struct storage##_slot *s = bpf_map_lookup_elem(&storage##_batch, &i);   \
		struct cgroup *cg;                                                      \
		value_type *v;                                                          \
                                                                                        \
		if (!s)                                                                 \
			return 1;                                                       \
		s->found = 0;                                                           \
		cg = bpf_cgroup_from_id(s->id);                                         \
		if (!cg)                                                                \
			return 0;                                                       \
		v = bpf_cgrp_storage_get(&storage, cg, 0, 0);                           \
		if (v) {                                                                \
			CGROUP_BATCH_COPY(&s->value, v, sizeof(value_type));             \
			s->found = 1;                                                   \
		}                                                                       \
		bpf_cgroup_release(cg);                                                 \
		return 0;                                                               \
	}                                                                               \
                                                                                        \
	SEC("syscall")                                                                  \
	int storage##_batch_read(struct cgroup_batch_args *args)                        \
	{                                                                               \
		__u32 n = args->n;                                                      \
                                                                                        \
		if (n > (slots))                                                        \
			n = (slots);                                                    \
		bpf_loop(n, storage##_batch_one, 0, 0);                                 \
		return 0;                                                               \
	}

#endif
