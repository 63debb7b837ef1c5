// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Run-queue latency per cgroup, attributed to the task being switched *in*
 * (next), not the waker and not the previous task.
 *
 * Two ways to know when the task became runnable:
 *
 * 1. sched_info (default, kernels with CONFIG_SCHED_INFO, which SCHEDSTATS and
 *    TASK_DELAY_ACCT select): the scheduler itself keeps each task's
 *    cumulative run-queue wait, sched_info.run_delay (/proc/<pid>/schedstat),
 *    and stamps sched_info.last_queued with the run-queue clock while the task
 *    waits. The probe follows run_delay itself, per task, so that its sum is
 *    the kernel's by construction:
 *      - at switch-in the wait that ends now is rq->clock - last_queued
 *        (sched_switch fires just before sched_info_arrive() adds exactly that,
 *        with rq->clock already updated);
 *      - a queued task the load balancer moves to another CPU has its wait so
 *        far added to run_delay at the move (sched_info_dequeue() clears
 *        last_queued), so that part shows up as run_delay - what we had seen;
 *    and the task's storage keeps run_delay as it will be once this switch is
 *    accounted. One sample is one switch-in after a wait, its value the whole
 *    wait however many CPUs it spanned. A task first seen by the probe starts
 *    from its run_delay then, or from 0 if it was created after the probe
 *    loaded (started_ns), so waits of tasks older than the agent are not
 *    counted and waits of newer ones are all counted.
 * 2. stamp (fallback): the wakeup, wakeup_new and switch hooks stamp the task in
 *    task-local storage with bpf_ktime_get_ns() when it becomes runnable or is
 *    preempted, and the switch hook measures at switch-in.
 *
 * The histogram lives in cgroup-local storage: an O(1) lookup cached in the
 * cgroup, no hash map on the hot path, and freed by the kernel with the
 * cgroup, so pod churn cannot grow kernel memory.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "hist.h"
#include "cgroup.h"
#include "cgroup_active.h"
#include "cgroup_storage.h"
#include "cgroup_drain.h"
#include "cgroup_batch.h"
#include "counters.h"
#include "sched.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define TASK_RUNNING 0

/* Chosen by userspace before load (it checks the kernel's BTF for
 * task_struct.sched_info and sched_entity.cfs_rq / cfs_rq.rq). */
const volatile bool use_sched_info = false;
/* CLOCK_MONOTONIC (task_struct.start_time's clock) just before attaching:
 * tasks started later have all their run_delay counted. */
const volatile __u64 started_ns = 0;

/* sched_info method: the task's run_delay including the wait ended at its
 * last switch-in, i.e. what has been counted. */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} delay_seen SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64); /* ktime ns when the task became runnable, 0 = none */
} runnable_since SEC(".maps");

struct sched_cgroup {
	struct hist hist;
	__u64 epoch; /* see cgroup_active.h */
};

CGROUP_STORAGE(sched_hist, struct sched_cgroup)

CGROUP_DRAIN(sched_hist, struct sched_cgroup)
/* a tick reads its active cgroups 512 at a time */
CGROUP_BATCH(sched_hist, struct sched_cgroup, 512)

/* Counters userspace exports as self-metrics, indexed by sched.h's STAT_*. */
PROBE_STATS(sched_stats, STATS)

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

static __always_inline void record(struct task_struct *next, __u64 delta)
{
	struct cgroup *cg = task_dfl_cgroup(next);
	struct sched_cgroup *c;

	if ((__s64)delta < 0) {
		bump(STAT_NEGATIVE_DELTA);
		return;
	}
	c = sched_hist_get(cg, true);
	if (!c) {
		bump(STAT_NO_STORAGE);
		return;
	}
	hist_record(&c->hist, delta);
	mark_active(cg, &c->epoch);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	__u64 *ts, now, delta;

	if (use_sched_info) {
		struct rq *rq;
		__u64 queued, run_delay, ending = 0, *seen;

		if (!bpf_core_field_exists(next->sched_info) || next->pid == 0)
			return 0;
		queued = next->sched_info.last_queued;
		if (queued) {
			/* This CPU's run queue, reached through the task: set_task_rq()
			 * keeps se.cfs_rq on the task's CPU for every scheduling class,
			 * and at switch-in that is this CPU. (The per-CPU `runqueues`
			 * symbol would need CONFIG_KALLSYMS_ALL.) */
			if (!bpf_core_field_exists(next->se.cfs_rq))
				return 0;
			rq = next->se.cfs_rq->rq;
			if (!rq)
				return 0;
			ending = rq->clock - queued;
			if ((__s64)ending < 0) {
				bump(STAT_NEGATIVE_DELTA);
				ending = 0;
			}
		}
		run_delay = next->sched_info.run_delay;
		seen = bpf_task_storage_get(&delay_seen, next, 0, 0);
		if (!seen) {
			seen = bpf_task_storage_get(&delay_seen, next, 0,
						    BPF_LOCAL_STORAGE_GET_F_CREATE);
			if (!seen) {
				bump(STAT_NO_STORAGE);
				return 0;
			}
			*seen = next->start_time >= started_ns ? 0 : run_delay;
		}
		/* run_delay - *seen: waits the kernel accounted without a
		 * switch-in (a queued task moved to another CPU) */
		delta = run_delay - *seen;
		if ((__s64)delta < 0) {
			bump(STAT_NEGATIVE_DELTA);
			delta = 0;
		}
		*seen = run_delay + ending;
		delta += ending;
		/* a switch-in after a wait is a sample, a wait of 0 ns too */
		if (queued || delta)
			record(next, delta);
		return 0;
	}

	now = bpf_ktime_get_ns();
	/* A preempted task stays on the run queue: its wait starts now. */
	if ((preempt || prev_state == TASK_RUNNING) && prev->pid != 0) {
		ts = bpf_task_storage_get(&runnable_since, prev, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
		if (ts)
			*ts = now;
	}
	if (next->pid == 0)
		return 0;
	ts = bpf_task_storage_get(&runnable_since, next, 0, 0);
	if (!ts || *ts == 0)
		return 0;
	record(next, now - *ts);
	*ts = 0;
	return 0;
}
