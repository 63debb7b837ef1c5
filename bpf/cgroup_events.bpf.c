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
 * And what changed in the processes, so that the agent re-reads a pod's
 * process list, and looks at a process's mappings again, only after a change:
 *
 * procs_changed: the id of every cgroup that gained a process (fork, or a
 *       task moved in) or lost one (its last thread exited);
 * maps_changed: the tgid of every process that exec'd or mapped
 *       something at an address of the kernel's choosing (vm_unmapped_area:
 *       how dlopen() maps a library and a driver maps its device file). A
 *       process is marked once per epoch (`changed_epoch`, bumped by the agent
 *       at each read) through its leader's task storage, so a process that
 *       maps often costs one storage lookup per mapping after its first.
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
#include "cgroup.h"
#include "counters.h"

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

/* Two u64 slots that the agent reads without a syscall. */
#define MMAPED_PAIR(name)                          \
	struct {                                   \
		__uint(type, BPF_MAP_TYPE_ARRAY);  \
		__uint(map_flags, BPF_F_MMAPABLE); \
		__uint(max_entries, 2);            \
		__type(key, __u32);                \
		__type(value, __u64);              \
	} name SEC(".maps")

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
 * looked (it then walks the whole hierarchy once), [1] events recorded since
 * the agent last took them: with none it leaves born and died alone (their
 * batch read walks every bucket of the map) */
MMAPED_PAIR(overflow);

/* one scratch entry per CPU: a struct died does not fit the BPF stack */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct died);
} scratch SEC(".maps");

/* [0] the agent's epoch for maps_changed (starts at 1), [1] non-zero when an
 * write to procs_changed or maps_changed failed (a ring was full) since the agent last
 * looked (it then re-reads every list and looks at every process again) */
MMAPED_PAIR(changed_epoch);

/* rings of u64 ids (8 bytes and an 8-byte header each), read by the agent
 * through shared memory (see cgroup_active.h) */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, EVENTS_MAX * 16);
} procs_changed SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, EVENTS_MAX * 16);
} maps_changed SEC(".maps");

/* the epoch in which the process was last put in maps_changed */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} maps_seen SEC(".maps");

static __always_inline void overflowed(void)
{
	slot_set(&overflow, 0, 1);
}

static __always_inline void recorded(void)
{
	slot_add_shared(&overflow, 1, 1);
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
	recorded();
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
	recorded();
	return 0;
}

static __always_inline void changes_lost(void)
{
	slot_set(&changed_epoch, 1, 1);
}

static __always_inline void procs_changed_in(struct cgroup *cgrp)
{
	__u64 id = cgrp->kn->id;

	if (bpf_ringbuf_output(&procs_changed, &id, sizeof(id), BPF_RB_NO_WAKEUP))
		changes_lost();
}

static __always_inline void maps_changed_in(struct task_struct *t)
{
	struct task_struct *leader = t->group_leader;
	__u32 zero = 0;
	__u64 *epoch = bpf_map_lookup_elem(&changed_epoch, &zero), *seen, tgid;

	if (!epoch || !leader)
		return;
	seen = bpf_task_storage_get(&maps_seen, leader, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (seen && *seen == *epoch)
		return;
	if (seen)
		*seen = *epoch;
	tgid = t->tgid;
	if (bpf_ringbuf_output(&maps_changed, &tgid, sizeof(tgid), BPF_RB_NO_WAKEUP))
		changes_lost();
}

/* A new process (not a thread) in its parent's cgroup. */
SEC("tp_btf/sched_process_fork")
int BPF_PROG(procs_fork, struct task_struct *parent, struct task_struct *child)
{
	if (child->pid == child->tgid)
		procs_changed_in(task_dfl_cgroup(child));
	return 0;
}

/* The last thread of a process exits. (The tracepoint fires before the task
 * leaves its cgroup: the agent reads a marked list twice.) */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(procs_exit, struct task_struct *p)
{
	if (p->signal->live.counter == 0)
		procs_changed_in(task_dfl_cgroup(p));
	return 0;
}

/* A task (or a whole process) moved into a cgroup; the cgroup it left keeps
 * the pid in the agent's list until that list's next read. */
SEC("tp_btf/cgroup_attach_task")
int BPF_PROG(procs_attach, struct cgroup *dst, const char *path, struct task_struct *task,
	     bool threadgroup)
{
	if (on_dfl(dst))
		procs_changed_in(dst);
	return 0;
}

/* A new image under the same pid. */
SEC("tp_btf/sched_process_exec")
int BPF_PROG(maps_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	maps_changed_in(p);
	return 0;
}

/* An address chosen by the kernel for a new mapping of the current process.
 * It fires before the mapping exists: the agent looks at a marked process
 * twice. */
SEC("tp_btf/vm_unmapped_area")
int BPF_PROG(maps_new_area, unsigned long addr, struct vm_unmapped_area_info *info)
{
	maps_changed_in(bpf_get_current_task_btf());
	return 0;
}
