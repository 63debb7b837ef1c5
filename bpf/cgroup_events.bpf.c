// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Creation and removal of cgroups (v2 hierarchy), so that the agent follows
 * the hierarchy without walking it every tick.
 *
 * born: cgroup id -> parent id and depth, for every mkdir since the agent's
 *       last read; the agent lists only the parents' directories.
 * died: cgroup id -> parent id and the cgroup's path, for every rmdir since
 *       the agent's last read. The path names the owner of a cgroup created
 *       and removed between two ticks (a container shorter than one interval)
 *       whose last numbers the probes drained (cgroup_drain.h).
 *
 * The path comes with the tracepoint in a kernel buffer; copying it needs
 * bpf_probe_read_kernel_str, which lockdown=confidentiality forbids, so it is
 * behind `read_paths` (userspace leaves it off under lockdown; the agent then
 * credits such a cgroup to its parent's owner). Everything else walks typed
 * BTF pointers.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define PATH_MAX_LEN 256
#define EVENTS_MAX 16384

const volatile bool read_paths = false;

struct born {
	__u64 parent;
	__u32 level;
	__u32 pad;
};

struct died {
	__u64 parent;
	char path[PATH_MAX_LEN]; /* empty without read_paths */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, EVENTS_MAX);
	__type(key, __u64);
	__type(value, struct born);
} born SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, EVENTS_MAX);
	__type(key, __u64);
	__type(value, struct died);
} died SEC(".maps");

/* [0] non-zero when an event could not be recorded since the agent last
 * looked (it then walks the whole hierarchy once) */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} overflow SEC(".maps");

/* one scratch entry per CPU: a struct died does not fit the BPF stack */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct died);
} scratch SEC(".maps");

static __always_inline void overflowed(void)
{
	__u32 zero = 0;
	__u64 *v = bpf_map_lookup_elem(&overflow, &zero);

	if (v)
		*v = 1;
}

/* The default (v2) hierarchy is the first one the kernel sets up: id 0. */
static __always_inline bool on_dfl(struct cgroup *cgrp)
{
	return cgrp->root->hierarchy_id == 0;
}

static __always_inline __u64 parent_id(struct cgroup *cgrp)
{
	struct cgroup_subsys_state *p = cgrp->self.parent;

	return p ? p->cgroup->kn->id : 0;
}

SEC("tp_btf/cgroup_mkdir")
int BPF_PROG(cgroup_mkdir, struct cgroup *cgrp, const char *path)
{
	struct born b = {};
	__u64 id;

	if (!on_dfl(cgrp))
		return 0;
	id = cgrp->kn->id;
	b.parent = parent_id(cgrp);
	b.level = cgrp->level;
	if (bpf_map_update_elem(&born, &id, &b, BPF_ANY))
		overflowed();
	return 0;
}

SEC("tp_btf/cgroup_rmdir")
int BPF_PROG(cgroup_rmdir, struct cgroup *cgrp, const char *path)
{
	__u32 zero = 0;
	struct died *d;
	__u64 id;

	if (!on_dfl(cgrp))
		return 0;
	d = bpf_map_lookup_elem(&scratch, &zero);
	if (!d)
		return 0;
	id = cgrp->kn->id;
	d->parent = parent_id(cgrp);
	d->path[0] = 0;
	if (read_paths)
		bpf_probe_read_kernel_str(d->path, sizeof(d->path), path);
	/* a cgroup made and removed between two reads needs no listing */
	bpf_map_delete_elem(&born, &id);
	if (bpf_map_update_elem(&died, &id, d, BPF_ANY))
		overflowed();
	return 0;
}
