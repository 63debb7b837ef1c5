// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Run-queue latency per cgroup.
 *
 * A task is stamped when it becomes runnable (wakeup, wakeup_new) and when it is
 * switched out while still runnable (preempted). When it is switched in, the wait
 * since that stamp is recorded in the histogram of *its own* cgroup (the task
 * being scheduled in), not the waker's and not the previous task's.
 *
 * Cost: no hash map on the hot path. The stamp lives in task-local storage and
 * the histogram in cgroup-local storage, both O(1) pointer lookups cached in the
 * task / cgroup. Cgroup storage is freed by the kernel with the cgroup, so pod
 * churn cannot grow kernel memory.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "hist.h"
#include "cgroup.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define TASK_RUNNING 0

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64); /* ktime ns when the task became runnable, 0 = none */
} runnable_since SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_CGRP_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct hist);
} sched_hist SEC(".maps");

/* Stats userspace exports as self-metrics: [0] negative deltas (cross-CPU clock
 * skew) that were dropped, [1] cgroup storage allocation failures. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} sched_stats SEC(".maps");

static __always_inline void bump_stat(__u32 i)
{
	__u64 *v = bpf_map_lookup_elem(&sched_stats, &i);

	if (v)
		*v += 1;
}

static __always_inline void stamp(struct task_struct *p)
{
	__u64 *ts;

	/* pid 0 is the per-CPU idle task: it never waits on a run queue */
	if (p->pid == 0)
		return;
	ts = bpf_task_storage_get(&runnable_since, p, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (ts)
		*ts = bpf_ktime_get_ns();
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(sched_wakeup, struct task_struct *p)
{
	stamp(p);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(sched_wakeup_new, struct task_struct *p)
{
	stamp(p);
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	struct hist *h;
	__u64 *ts, now, delta;

	/* A preempted task stays on the run queue: its wait starts now. */
	if (preempt || prev_state == TASK_RUNNING)
		stamp(prev);

	if (next->pid == 0)
		return 0;
	ts = bpf_task_storage_get(&runnable_since, next, 0, 0);
	if (!ts || *ts == 0)
		return 0;
	now = bpf_ktime_get_ns();
	delta = now - *ts;
	*ts = 0;
	if ((__s64)delta < 0) {
		bump_stat(0);
		return 0;
	}
	h = bpf_cgrp_storage_get(&sched_hist, task_dfl_cgroup(next), 0,
				 BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!h) {
		bump_stat(1);
		return 0;
	}
	hist_record(h, delta);
	return 0;
}
