// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * GPU driver time per cgroup: how long the tasks of a cgroup spend inside
 * ioctl() on GPU device files (/dev/nvidia*), as a latency histogram per
 * request class and as wall time during which at least one of its tasks was
 * in such a call ("busy").
 *
 * Loads under lockdown=confidentiality: only per-syscall tracepoints and
 * tp_btf, typed BTF pointer walks, and bpf_probe_read_user; never
 * bpf_probe_read_kernel. That rules out the usual fd -> file -> inode walk at
 * ioctl time, so the set of GPU file descriptors is learned where they are
 * made:
 *
 *   - openat/openat2/open of a path under a configured prefix (default
 *     /dev/nvidia) sets the fd's bit in the process's bitmap;
 *   - close/close_range clear it, exec clears the close-on-exec ones, fork
 *     copies the parent's bitmap to the child;
 *   - userspace seeds the bitmap of processes that opened their device files
 *     before the agent started (it stats the entries of /proc/<pid>/fd against the GPU
 *     character-device majors and writes the bitmap through a pidfd).
 *
 * The bitmap lives in task-local storage of the thread-group leader, so it is
 * per process, costs nothing for processes that never opened a GPU file (the
 * lookup finds no storage and returns), and is freed by the kernel with the
 * process. Only syscalls:sys_enter_ioctl/sys_exit_ioctl run on the hot path;
 * raw_syscalls would run for every syscall of every task.
 *
 * Even the per-syscall tracepoints cost every task on the machine on every
 * syscall, GPU or not: attaching any syscall tracepoint sets
 * SYSCALL_WORK_SYSCALL_TRACEPOINT on all tasks, which sends each of their
 * syscalls through the slow entry and exit path. The default mode
 * ("uprobe mode", at the end of this file) uses none: uprobes on the C
 * library's ioctl(), close(), dup2() and dup3() attached per process, only
 * to the processes that hold a GPU file. The kernel installs those
 * breakpoints in the filtered address spaces alone, so no other process,
 * and no other syscall, pays anything.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "hist.h"
#include "cgroup.h"
#include "cgroup_active.h"
#include "cgroup_storage.h"
#include "cgroup_drain.h"
#include "cgroup_batch.h"
#include "counters.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#include "gpu_driver.h"

#define GPU_FD_WORDS (GPU_FD_BITS / 64)

#define O_CLOEXEC 02000000
#define CLOSE_RANGE_CLOEXEC (1U << 2)

const volatile __u32 n_prefixes = 0;
const volatile __u32 prefix_len[MAX_PREFIXES] = {};
const volatile char prefixes[MAX_PREFIXES][PREFIX_LEN] = {};

struct gpu_fds {
	__u64 open[GPU_FD_WORDS];
	__u64 cloexec[GPU_FD_WORDS];
};

/* Per process (on the thread-group leader): its GPU fds. */
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct gpu_fds);
} gpu_fds SEC(".maps");

/* Per thread: an ioctl or open in flight. */
struct thread_state {
	__u64 ioctl_start; /* ktime ns, 0 = none */
	__u64 cgroup_id;   /* cgroup charged at entry */
	__u32 cmd_slot;
	__u32 opening;	   /* 1 + whether O_CLOEXEC was asked for; 0 = not a GPU path */
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct thread_state);
} thread_state SEC(".maps");

/* Per cgroup; mirrored in probes/gpu_driver.rs. */
struct gpu_cgroup {
	struct hist ioctl[CMD_SLOTS];
	__u64 busy_ns;	  /* closed busy intervals */
	__u64 busy_since; /* ktime ns the current busy interval began */
	__s64 inflight;	  /* tasks of the cgroup inside a GPU ioctl now */
	__u64 epoch;	  /* see cgroup_active.h */
};

CGROUP_STORAGE(gpu_cgroup, struct gpu_cgroup)

CGROUP_DRAIN(gpu_cgroup, struct gpu_cgroup)
/* a tick reads its active cgroups 256 at a time */
CGROUP_BATCH(gpu_cgroup, struct gpu_cgroup, 256)

/* Counters userspace exports as self-metrics, indexed by gpu_driver.h's STAT_*
 * (a call that left another cgroup than it entered in is timed, not counted as busy). */
PROBE_STATS(gpu_stats, STATS)

static __always_inline struct task_struct *leader(void)
{
	return bpf_get_current_task_btf()->group_leader;
}

static __always_inline bool fd_in(__u64 *words, __u64 fd)
{
	if (fd >= GPU_FD_BITS)
		return false;
	return words[fd / 64] & (1ULL << (fd % 64));
}

/* The request class of an NVIDIA ioctl. RM requests are _IOC(dir, 'F', nr,
 * size); UVM requests are plain numbers (type byte 0). The numbers are the
 * driver's ABI (nv_escape.h). */
static __always_inline __u32 cmd_slot(__u32 cmd)
{
	__u32 type = (cmd >> 8) & 0xff, nr = cmd & 0xff;

	if (type == 0)
		return CMD_UVM;
	if (type != 'F')
		return CMD_OTHER;
	switch (nr) {
	case 0x2A: /* NV_ESC_RM_CONTROL */
		return CMD_RM_CONTROL;
	case 0x27: /* NV_ESC_RM_ALLOC_MEMORY */
	case 0x28: /* NV_ESC_RM_ALLOC_OBJECT */
	case 0x2B: /* NV_ESC_RM_ALLOC */
		return CMD_RM_ALLOC;
	case 0x29: /* NV_ESC_RM_FREE */
		return CMD_RM_FREE;
	case 0x4E: /* NV_ESC_RM_MAP_MEMORY */
	case 0x57: /* NV_ESC_RM_MAP_MEMORY_DMA */
		return CMD_RM_MAP;
	case 0x4F: /* NV_ESC_RM_UNMAP_MEMORY */
	case 0x58: /* NV_ESC_RM_UNMAP_MEMORY_DMA */
		return CMD_RM_UNMAP;
	case 0x4A: /* NV_ESC_RM_VID_HEAP_CONTROL */
		return CMD_RM_VID_HEAP;
	default:
		return CMD_OTHER;
	}
}

static __always_inline int ioctl_exit(struct task_struct *task, struct thread_state *ts);

static __always_inline int ioctl_enter(__u64 fd, __u32 cmd)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct gpu_cgroup *cg;
	struct thread_state *ts;
	struct gpu_fds *fds;
	__u64 now;

	fds = bpf_task_storage_get(&gpu_fds, task->group_leader, 0, 0);
	if (!fds || !fd_in(fds->open, fd))
		return 0;
	ts = bpf_task_storage_get(&thread_state, task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	cg = gpu_cgroup_get(task_dfl_cgroup(task), true);
	if (!ts || !cg) {
		bump(STAT_NO_STORAGE);
		return 0;
	}
	/* Uprobe mode: a call still open on this thread lost its return (a
	 * signal handler's ioctl, a longjmp): end it here rather than let the
	 * cgroup's busy interval stay open. */
	if (ts->ioctl_start)
		ioctl_exit(task, ts);
	mark_active(task_dfl_cgroup(task), &cg->epoch);
	now = bpf_ktime_get_ns();
	ts->ioctl_start = now;
	ts->cgroup_id = bpf_get_current_cgroup_id();
	ts->cmd_slot = cmd_slot(cmd);
	/* the first task of the cgroup to enter opens a busy interval */
	if (__sync_fetch_and_add(&cg->inflight, 1) == 0)
		cg->busy_since = now;
	return 0;
}

static __always_inline int ioctl_exit(struct task_struct *task, struct thread_state *ts)
{
	struct gpu_cgroup *cg;
	__u64 now, start, since;
	__u32 slot;

	start = ts->ioctl_start;
	ts->ioctl_start = 0;
	slot = ts->cmd_slot;
	cg = gpu_cgroup_get(task_dfl_cgroup(task), true);
	if (!cg) {
		bump(STAT_NO_STORAGE);
		return 0;
	}
	mark_active(task_dfl_cgroup(task), &cg->epoch);
	now = bpf_ktime_get_ns();
	if (slot < CMD_SLOTS)
		hist_record(&cg->ioctl[slot], now - start);
	if (ts->cgroup_id != bpf_get_current_cgroup_id()) {
		/* moved to another cgroup while inside the call: the entry
		 * cgroup's counter cannot be reached from here */
		bump(STAT_CGROUP_MOVED);
		return 0;
	}
	/* Every task that leaves books the busy time up to now, not only the
	 * last one: a pod whose calls overlap without a gap (a busy
	 * multi-threaded server) would otherwise show no driver time at all
	 * until it pauses. Booking happens before this task leaves, so the
	 * count is at least 1 and no entrant can stamp a new start meanwhile;
	 * concurrent leavers advance the start with a compare-and-swap, each
	 * stretch booked once, and one whose `now` is behind the start has had
	 * its stretch booked by another. */
	for (int i = 0; i < 4; i++) {
		since = cg->busy_since;
		if ((__s64)(now - since) <= 0)
			break;
		if (__sync_val_compare_and_swap(&cg->busy_since, since, now) == since) {
			__sync_fetch_and_add(&cg->busy_ns, now - since);
			break;
		}
	}
	__sync_fetch_and_add(&cg->inflight, -1);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_ioctl")
int gpu_ioctl_enter(struct trace_event_raw_sys_enter *ctx)
{
	return ioctl_enter((__u32)ctx->args[0], (__u32)ctx->args[1]);
}

/* Ends the current thread's GPU call, if it is in one. */
static __always_inline int end_call(void)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct thread_state *ts = bpf_task_storage_get(&thread_state, task, 0, 0);

	if (!ts || !ts->ioctl_start)
		return 0;
	return ioctl_exit(task, ts);
}

SEC("tracepoint/syscalls/sys_exit_ioctl")
int gpu_ioctl_exit(struct trace_event_raw_sys_exit *ctx)
{
	return end_call();
}

/* Whether a user-space path starts with one of the configured prefixes. */
static __always_inline bool gpu_path(const char *user_path)
{
	char buf[PREFIX_LEN];
	long n;

	n = bpf_probe_read_user_str(buf, sizeof(buf), user_path);
	if (n <= 0)
		return false;
	for (__u32 p = 0; p < MAX_PREFIXES; p++) {
		__u32 len, i;

		if (p >= n_prefixes)
			break;
		len = prefix_len[p];
		if (len == 0 || len >= PREFIX_LEN || len >= n)
			continue;
		for (i = 0; i < PREFIX_LEN; i++) {
			if (i >= len || buf[i] != prefixes[p][i])
				break;
		}
		if (i == len)
			return true;
	}
	return false;
}

static __always_inline int open_enter(const char *path, __u64 flags)
{
	struct thread_state *ts;

	if (!gpu_path(path))
		return 0;
	ts = bpf_task_storage_get(&thread_state, bpf_get_current_task_btf(), 0,
				  BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!ts) {
		bump(STAT_NO_STORAGE);
		return 0;
	}
	ts->opening = 1 + !!(flags & O_CLOEXEC);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_openat")
int gpu_openat_enter(struct trace_event_raw_sys_enter *ctx)
{
	return open_enter((const char *)ctx->args[1], ctx->args[2]);
}

SEC("tracepoint/syscalls/sys_enter_open")
int gpu_open_enter(struct trace_event_raw_sys_enter *ctx)
{
	return open_enter((const char *)ctx->args[0], ctx->args[1]);
}

static __always_inline int openat2_enter(const char *path, const struct open_how *uhow)
{
	struct open_how how = {};

	/* how->flags is user memory; without it the fd is still learned,
	 * only its close-on-exec bit is unknown */
	bpf_probe_read_user(&how, sizeof(how.flags), uhow);
	return open_enter(path, how.flags);
}

SEC("tracepoint/syscalls/sys_enter_openat2")
int gpu_openat2_enter(struct trace_event_raw_sys_enter *ctx)
{
	return openat2_enter((const char *)ctx->args[1], (void *)ctx->args[2]);
}

static __always_inline int learn_fd(struct task_struct *task, struct thread_state *ts, long ret)
{
	struct gpu_fds *fds;
	__u32 opening;
	__u64 bit;

	opening = ts->opening;
	ts->opening = 0;
	if (ret < 0)
		return 0;
	if (ret >= GPU_FD_BITS) {
		bump(STAT_FD_UNTRACKED);
		return 0;
	}
	fds = bpf_task_storage_get(&gpu_fds, task->group_leader, 0,
				   BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!fds) {
		bump(STAT_NO_STORAGE);
		return 0;
	}
	bit = 1ULL << (ret % 64);
	__sync_fetch_and_or(&fds->open[ret / 64], bit);
	if (opening == 2)
		__sync_fetch_and_or(&fds->cloexec[ret / 64], bit);
	else
		__sync_fetch_and_and(&fds->cloexec[ret / 64], ~bit);
	bump(STAT_FD_LEARNED);
	return 0;
}

static __always_inline int open_exit(long ret)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct thread_state *ts = bpf_task_storage_get(&thread_state, task, 0, 0);

	if (!ts || !ts->opening)
		return 0;
	return learn_fd(task, ts, ret);
}

SEC("tracepoint/syscalls/sys_exit_openat")
int gpu_openat_exit(struct trace_event_raw_sys_exit *ctx)
{
	return open_exit(ctx->ret);
}

SEC("tracepoint/syscalls/sys_exit_open")
int gpu_open_exit(struct trace_event_raw_sys_exit *ctx)
{
	return open_exit(ctx->ret);
}

SEC("tracepoint/syscalls/sys_exit_openat2")
int gpu_openat2_exit(struct trace_event_raw_sys_exit *ctx)
{
	return open_exit(ctx->ret);
}

static __always_inline void forget(struct gpu_fds *fds, __u64 fd)
{
	__u64 bit = ~(1ULL << (fd % 64));

	if (fd >= GPU_FD_BITS)
		return;
	__sync_fetch_and_and(&fds->open[fd / 64], bit);
	__sync_fetch_and_and(&fds->cloexec[fd / 64], bit);
}

/* Forgets at entry: a close that fails with EBADF had nothing to forget, and
 * after any other failure the fd is gone anyway (close(2)). */
static __always_inline int close_enter(__u64 fd)
{
	struct gpu_fds *fds = bpf_task_storage_get(&gpu_fds, leader(), 0, 0);

	if (fds)
		forget(fds, fd);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_close")
int gpu_close_enter(struct trace_event_raw_sys_enter *ctx)
{
	return close_enter((__u32)ctx->args[0]);
}

struct range_ctx {
	struct gpu_fds *fds;
	__u64 first, last;
};

static long forget_word(__u32 w, struct range_ctx *c)
{
	__u64 lo = (__u64)w * 64, hi = lo + 63, mask = ~0ULL;

	if (w >= GPU_FD_WORDS)
		return 1;
	if (hi < c->first || lo > c->last)
		return 0;
	if (c->first > lo)
		mask &= ~0ULL << (c->first - lo);
	if (c->last < hi)
		mask &= ~0ULL >> (hi - c->last);
	/* the mask restates the bound for the verifier (GPU_FD_WORDS is a power of 2) */
	__sync_fetch_and_and(&c->fds->open[w & (GPU_FD_WORDS - 1)], ~mask);
	__sync_fetch_and_and(&c->fds->cloexec[w & (GPU_FD_WORDS - 1)], ~mask);
	return 0;
}

static __always_inline int close_range_enter(__u32 first, __u32 last, __u32 flags)
{
	struct range_ctx c = {
		.fds = bpf_task_storage_get(&gpu_fds, leader(), 0, 0),
		.first = first,
		.last = last,
	};

	if (!c.fds || (flags & CLOSE_RANGE_CLOEXEC))
		return 0;
	/* a callback per word keeps the verifier from walking every branch of
	 * 128 unrolled iterations */
	bpf_loop(GPU_FD_WORDS, forget_word, &c, 0);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_close_range")
int gpu_close_range_enter(struct trace_event_raw_sys_enter *ctx)
{
	return close_range_enter(ctx->args[0], ctx->args[1], ctx->args[2]);
}

/*
 * The same hooks without tracefs. Per-syscall tracepoints are attached by the
 * id tracefs gives them, and lockdown=confidentiality removes tracefs; the
 * BTF tracepoints sys_enter/sys_exit (raw_syscalls) need no tracefs but run
 * for every syscall, so they test the syscall number first. Arguments come
 * from the syscall's user registers through typed pointers (no kernel reads).
 */
#if defined(__TARGET_ARCH_x86)
#define NR_ioctl 16
#define NR_open 2
#define NR_close 3
#define NR_openat 257
#elif defined(__TARGET_ARCH_arm64)
#define NR_ioctl 29
#define NR_open -1 /* arm64 has only openat */
#define NR_close 57
#define NR_openat 56
#else
#error "syscall numbers for this architecture are missing"
#endif
#define NR_close_range 436
#define NR_openat2 437

SEC("tp_btf/sys_enter")
int BPF_PROG(gpu_sys_enter, struct pt_regs *regs, long id)
{
	switch (id) {
	case NR_ioctl:
		return ioctl_enter((__u32)PT_REGS_PARM1_SYSCALL(regs),
				   (__u32)PT_REGS_PARM2_SYSCALL(regs));
	case NR_openat:
		return open_enter((const char *)PT_REGS_PARM2_SYSCALL(regs),
				  PT_REGS_PARM3_SYSCALL(regs));
	case NR_open:
		return open_enter((const char *)PT_REGS_PARM1_SYSCALL(regs),
				  PT_REGS_PARM2_SYSCALL(regs));
	case NR_openat2:
		return openat2_enter((const char *)PT_REGS_PARM2_SYSCALL(regs),
				     (void *)PT_REGS_PARM3_SYSCALL(regs));
	case NR_close:
		return close_enter((__u32)PT_REGS_PARM1_SYSCALL(regs));
	case NR_close_range:
		return close_range_enter(PT_REGS_PARM1_SYSCALL(regs), PT_REGS_PARM2_SYSCALL(regs),
					 PT_REGS_PARM3_SYSCALL(regs));
	default:
		return 0;
	}
}

/* Whatever the entry stamped on this thread tells which call is ending. */
SEC("tp_btf/sys_exit")
int BPF_PROG(gpu_sys_exit, struct pt_regs *regs, long ret)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct thread_state *ts = bpf_task_storage_get(&thread_state, task, 0, 0);

	if (!ts)
		return 0;
	if (ts->ioctl_start)
		return ioctl_exit(task, ts);
	if (ts->opening)
		return learn_fd(task, ts, ret);
	return 0;
}

/* exec closes the close-on-exec fds without a close() call. */
SEC("tp_btf/sched_process_exec")
int BPF_PROG(gpu_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	struct gpu_fds *fds = bpf_task_storage_get(&gpu_fds, p->group_leader, 0, 0);

	if (!fds)
		return 0;
	for (__u32 w = 0; w < GPU_FD_WORDS; w++) {
		fds->open[w] &= ~fds->cloexec[w];
		fds->cloexec[w] = 0;
	}
	return 0;
}

/* A new process inherits its parent's fds. Threads share the leader's bitmap. */
SEC("tp_btf/sched_process_fork")
int BPF_PROG(gpu_fork, struct task_struct *parent, struct task_struct *child)
{
	struct gpu_fds *from, *to;

	if (child->pid != child->tgid)
		return 0;
	from = bpf_task_storage_get(&gpu_fds, parent->group_leader, 0, 0);
	if (!from)
		return 0;
	to = bpf_task_storage_get(&gpu_fds, child, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!to) {
		bump(STAT_NO_STORAGE);
		return 0;
	}
	for (__u32 w = 0; w < GPU_FD_WORDS; w++) {
		to->open[w] = from->open[w];
		to->cloexec[w] = from->cloexec[w];
	}
	return 0;
}


/*
 * Uprobe mode. Userspace attaches these to the C library (or, in a static
 * executable, the executable) of each process of a pod that holds a GPU file,
 * filtered to that process, and seeds its bitmap from /proc; fork and exec
 * keep the bitmap as above (tp_btf, once per fork or exec). Arguments are
 * the function's, read from the user registers; no memory is read.
 *
 * The time of a call runs from the ioctl() entry breakpoint to the return
 * breakpoint: the entry trap is outside it, the return trap inside it.
 */
/* An int argument from a user register, zero-extended where the verifier
 * sees it: the register's upper half is undefined for an int, and clang would
 * otherwise bound-check the low half and index with the whole register. */
static __always_inline __u64 fd_arg(__u64 reg)
{
	__u64 fd = (__u32)reg;

	barrier_var(fd);
	return fd;
}

SEC("uprobe")
int gpu_uprobe_ioctl(struct pt_regs *ctx)
{
	return ioctl_enter(fd_arg(PT_REGS_PARM1(ctx)), (__u32)PT_REGS_PARM2(ctx));
}

SEC("uretprobe")
int gpu_uretprobe_ioctl(struct pt_regs *ctx)
{
	return end_call();
}

SEC("uprobe")
int gpu_uprobe_close(struct pt_regs *ctx)
{
	return close_enter(fd_arg(PT_REGS_PARM1(ctx)));
}

/* dup2(old, new) and dup3(old, new, flags) close `new` first. A GPU fd
 * duplicated onto `new` is not learned (CUDA does not dup its device files);
 * userspace's next look at /proc finds it. */
SEC("uprobe")
int gpu_uprobe_dup2(struct pt_regs *ctx)
{
	__u64 oldfd = fd_arg(PT_REGS_PARM1(ctx)), newfd = fd_arg(PT_REGS_PARM2(ctx));

	if (oldfd == newfd)
		return 0;
	return close_enter(newfd);
}

SEC("uprobe")
int gpu_uprobe_close_range(struct pt_regs *ctx)
{
	return close_range_enter((__u32)PT_REGS_PARM1(ctx), (__u32)PT_REGS_PARM2(ctx),
				 (__u32)PT_REGS_PARM3(ctx));
}

/* A thread that dies inside a GPU ioctl (exit_group from another thread, a
 * fatal signal) never returns through the uretprobe: end its call at exit,
 * so that the cgroup's busy interval closes. Once per thread exit. */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(gpu_thread_exit, struct task_struct *p)
{
	return end_call();
}
