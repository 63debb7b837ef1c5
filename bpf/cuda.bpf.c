// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * CUDA driver API per cgroup, from uprobes on each container's own
 * libcuda.so.1: device memory reserved (classic allocations and the virtual
 * memory management API), bytes copied between host and device by direction,
 * and kernel launches (kernels and CUDA graphs).
 *
 * Userspace attaches these programs once per distinct library file (device,
 * inode) for all processes; a uprobe binds to (inode, offset), so one attach
 * covers every process and container that maps that file.
 *
 * Loads under lockdown=confidentiality: uprobes, one tp_btf hook, and
 * bpf_probe_read_user for out-parameters (the CUDA API returns pointers and
 * handles through user memory, read at the uretprobe). No kernel reads.
 *
 * Accounting (a signed byte count per cgroup, `vram`):
 *   - cuMemAlloc_v2/AllocPitch_v2/AllocManaged/AllocAsync/AllocFromPoolAsync
 *     add the size at a successful return and remember (tgid, dptr) -> size;
 *     cuMemFree_v2 and cuMemFreeAsync subtract what that pointer holds. A
 *     pool's reservation beyond what it hands out is not visible to the API.
 *   - cuMemCreate is the physical allocation of the VMM API: it adds the size
 *     and remembers (tgid, handle). The memory lives until the handle is
 *     released *and* no mapping uses it (cuMemRelease, cuMemUnmap), so both
 *     are tracked; cuMemMap/cuMemUnmap by themselves add nothing.
 *   - cuMemImportFromShareableHandle yields a handle to memory another
 *     process created (and was counted there): it is tracked with size 0.
 *   - When a process exits, what it still holds is subtracted.
 *
 * Copies: the HtoD/DtoH calls name their direction. cuMemcpy/cuMemcpyAsync
 * (unified addressing) take two plain addresses; the driver knows their kind
 * (cuPointerGetAttribute), a uprobe cannot ask it. The probes keep the device
 * memory each process was handed (allocations, managed allocations, VMM
 * mappings) as address ranges, and an address inside one is device memory,
 * any other host memory (pageable or pinned): device <- host is h2d, host <-
 * device d2h; device-to-device and host-to-host copies cross no host link and
 * are not counted. The synchronous cuMemcpyHtoD_v2 is also timed, entry to
 * return (h2d_copy_ns, h2d_copy_bytes): an asynchronous copy returns before
 * it ends, and a unified-address one is left untimed.
 *
 * Streams: 0 and CU_STREAM_LEGACY are the legacy default stream; in the
 * per-thread-default-stream variants (_ptsz) 0 is the calling thread's own
 * default stream, as CU_STREAM_PER_THREAD is in every call.
 *
 * Busy estimate (with the launch probes on): a stream has outstanding work
 * from a launch on it (a kernel or a graph) until a call shows the work
 * done: the return of cuStreamSynchronize on it, of cuCtxSynchronize (every
 * stream of the process), of cuEventSynchronize on an event recorded on it
 * after its last launch, or a cuStreamQuery / cuEventQuery answering
 * CUDA_SUCCESS. A cgroup is busy while any stream of its processes has
 * outstanding work: the intervals are merged by a count of such streams, as
 * the driver probe merges its calls. Completion is seen when the process
 * looks, so the estimate is an upper bound of the device's busy time: exact
 * when the process waits on its work, longer when it looks late.
 *
 * Feed stall (with the launch probes, on kernels with sched_info): the time
 * the pod's GPU sat idle while a thread that feeds it wanted to run, and how
 * much of it that thread spent on a run queue. A thread's "feed gap" opens
 * when a call of its shows the cgroup's last outstanding work done (the
 * return of a synchronisation, or a query answering CUDA_SUCCESS) and
 * closes at its next launch. At the close, with nothing of the cgroup's in
 * flight:
 *   - feed_cpu_ns += the thread's run_delay growth over the gap, plus what
 *     it grew inside the synchronisation call that opened it (the wait
 *     between the GPU's completion waking it and it running again);
 *   - feed_idle_ns += the gap's wall time if the thread never blocked in it
 *     (its voluntary switch count unchanged: it was running or runnable, so
 *     trying to feed), else only its run-queue part; plus the same
 *     in-synchronisation wait.
 * All of it is read from the current task at the uprobes (sched_info is
 * the scheduler's own account, settled while the task runs): the scheduler
 * hook does no work for it. See docs/metrics.md for what it misses.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include "cgroup.h"
#include "cgroup_active.h"
#include "cgroup_storage.h"
#include "cgroup_drain.h"
#include "cgroup_batch.h"
#include "counters.h"
#include "hist.h"
#include "cuda.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define CUDA_SUCCESS 0

/* Set by userspace before load (--cuda-launches): the launch, record and
 * query probes are attached and the synchronisation calls close busy
 * intervals. Without it the synchronisation probes only time the wait, and
 * no stream map is walked. */
const volatile bool busy_estimate = false;
/* Set by userspace with busy_estimate where the kernel has
 * task_struct.sched_info: the feed-stall accounting (see the top). */
const volatile bool feed_stall = false;
/* Adjacent mappings one cuMemUnmap may cover (it must unmap whole mappings). */
#define MAX_UNMAP_SPAN 32
/* The implicit streams' handles (cuda.h). */
#define CU_STREAM_LEGACY 0x1
#define CU_STREAM_PER_THREAD 0x2

/* Per cgroup; mirrored in probes/cuda.rs. */
struct cuda_cgroup {
	__s64 vram_bytes;
	__u64 h2d_bytes;
	__u64 d2h_bytes;
	__u64 launches;
	__u64 busy_ns;	      /* closed busy-estimate intervals */
	__u64 busy_since;     /* ktime ns the current interval began */
	__s64 busy_streams;   /* streams of the cgroup with outstanding work */
	__u64 feed_cpu_ns;    /* feed stall while a feeding thread waited on a run queue */
	__u64 feed_idle_ns;   /* all feed stall (idle while fed), any cause */
	__u64 h2d_copy_ns;    /* time in synchronous host-to-device copies, entry to return */
	__u64 h2d_copy_bytes; /* the bytes of those copies */
	struct hist sync_wait; /* time blocked in cuStream/Ctx/EventSynchronize */
	__u64 epoch; /* see cgroup_active.h */
};

CGROUP_STORAGE(cuda_cgroup, struct cuda_cgroup)

CGROUP_DRAIN(cuda_cgroup, struct cuda_cgroup)
/* a tick reads its active cgroups 256 at a time */
CGROUP_BATCH(cuda_cgroup, struct cuda_cgroup, 256)

#define KIND_DPTR 0    /* classic allocation: key is the device pointer */
#define KIND_HANDLE 1  /* VMM allocation handle */
#define KIND_MAPPING 2 /* VMM mapping: key is the virtual address */

struct obj_key {
	__u32 tgid;
	__u32 kind;
	__u64 id;
};

struct obj {
	__u64 size;	/* bytes this object holds (0 for imports and mappings) */
	__u64 handle;	/* KIND_MAPPING: the handle mapped */
	__u64 span;	/* KIND_MAPPING: bytes mapped */
	__u32 mappings; /* KIND_HANDLE: live mappings */
	__u32 released; /* KIND_HANDLE: cuMemRelease was called */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 131072);
	__type(key, struct obj_key);
	__type(value, struct obj);
} cuda_objs SEC(".maps");

/* Bytes each process holds, and the cgroup they were charged to, so that
 * its exit can give them back. */
struct proc_vram {
	__s64 bytes;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct proc_vram);
} cuda_procs SEC(".maps");

/* Device memory as address ranges per process, for the direction of unified
 * copies. A range [base, base + size) is stored as the aligned power-of-two
 * blocks that tile it (fewer than 128), keyed by (tgid, block address) with
 * the block's prefix length, so one longest-prefix lookup of (tgid, address)
 * finds the range an address falls in. */
#define MEM_DEVICE 1
#define MEM_MANAGED 2
#define MAX_BLOCKS 128

struct range_key {
	__u32 prefixlen; /* 32 (the tgid) + the block's address bits */
	__u32 tgid;
	__u64 addr; /* big-endian: the trie compares from the first byte */
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct range_key);
	__type(value, __u32);
} cuda_ranges SEC(".maps");

/* A call between its uprobe and its uretprobe, per thread. */
#define CALL_ALLOC 1
#define CALL_PITCH 2
#define CALL_CREATE 3
#define CALL_IMPORT 4
#define CALL_STREAM_SYNC 5
#define CALL_CTX_SYNC 6
#define CALL_EVENT_SYNC 7
#define CALL_STREAM_QUERY 8
#define CALL_EVENT_QUERY 9
#define CALL_MANAGED 10
#define CALL_COPY_H2D 11

struct pending {
	__u64 out;   /* user address of the out-parameter (dptr or handle) */
	__u64 out2;  /* cuMemAllocPitch: user address of *pPitch */
	__u64 size;  /* requested bytes, the height for pitch allocations, or
		      * the entry time (ktime ns) of a synchronisation call */
	__u32 call;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct pending);
} cuda_pending SEC(".maps");

/* A thread's open feed gap (feed_stall): task-local, freed with the thread. */
struct feeder {
	__u64 at;	/* ktime ns the gap opened; 0: none open */
	__u64 run_delay; /* the thread's sched_info.run_delay then */
	__u64 nvcsw;	/* its voluntary context switches then */
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct feeder);
} cuda_feeders SEC(".maps");

/* Streams with outstanding work: (tgid, stream) -> last launch. */
struct stream_key {
	__u32 tgid;
	__u32 pad;
	__u64 stream;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct stream_key);
	__type(value, __u64);
} cuda_streams SEC(".maps");

/* Events recorded: (tgid, event) -> the stream and the time of the record. */
struct event_rec {
	__u64 stream;
	__u64 recorded;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct stream_key);
	__type(value, struct event_rec);
} cuda_events SEC(".maps");

/* Counters userspace exports as self-metrics, indexed by cuda.h's STAT_*
 * (a launch's stream is not tracked when its map is full or the stack unreadable). */
PROBE_STATS(cuda_stats, STATS)

static __always_inline struct cuda_cgroup *my_cgroup(void)
{
	struct cgroup *cgrp = task_dfl_cgroup(bpf_get_current_task_btf());
	struct cuda_cgroup *cg;

	cg = cuda_cgroup_get(cgrp, true);
	if (!cg)
		bump(STAT_NO_STORAGE);
	else
		mark_active(cgrp, &cg->epoch);
	return cg;
}

static __always_inline __u32 tgid(void)
{
	return bpf_get_current_pid_tgid() >> 32;
}

/* Charges `delta` bytes to the calling process and its cgroup. */
static __always_inline void charge(__s64 delta)
{
	struct cuda_cgroup *cg;
	struct proc_vram *pv, zero = {};
	__u32 pid = tgid();

	if (delta == 0)
		return;
	pv = bpf_map_lookup_elem(&cuda_procs, &pid);
	if (!pv) {
		bpf_map_update_elem(&cuda_procs, &pid, &zero, BPF_NOEXIST);
		pv = bpf_map_lookup_elem(&cuda_procs, &pid);
	}
	if (pv)
		__sync_fetch_and_add(&pv->bytes, delta);
	cg = my_cgroup();
	if (cg)
		__sync_fetch_and_add(&cg->vram_bytes, delta);
}

static __always_inline void remember(__u32 kind, __u64 id, struct obj *o)
{
	struct obj_key k = {.tgid = tgid(), .kind = kind, .id = id};

	if (bpf_map_update_elem(&cuda_objs, &k, o, BPF_ANY))
		bump(STAT_OBJECTS_FULL);
}

static __always_inline int stash(__u32 call, __u64 out, __u64 out2, __u64 size)
{
	__u64 id = bpf_get_current_pid_tgid();
	struct pending p = {.out = out, .out2 = out2, .size = size, .call = call};

	bpf_map_update_elem(&cuda_pending, &id, &p, BPF_ANY);
	return 0;
}

/* Takes the call thread `id` stashed at entry; false when there is none (the
 * probes attached while the call was in flight). */
static __always_inline bool take_pending(__u64 id, struct pending *out)
{
	struct pending *p = bpf_map_lookup_elem(&cuda_pending, &id);

	if (!p)
		return false;
	*out = *p;
	bpf_map_delete_elem(&cuda_pending, &id);
	return true;
}

/* The largest power of two not above n (n > 0). */
static __always_inline __u64 pow2_floor(__u64 n)
{
	n |= n >> 1;
	n |= n >> 2;
	n |= n >> 4;
	n |= n >> 8;
	n |= n >> 16;
	n |= n >> 32;
	return n - (n >> 1);
}

/* log2 of a power of two: the number of bits set below it (BPF has no ctz). */
static __always_inline __u32 log2_pow2(__u64 v)
{
	v -= 1;
	v = v - ((v >> 1) & 0x5555555555555555ULL);
	v = (v & 0x3333333333333333ULL) + ((v >> 2) & 0x3333333333333333ULL);
	v = (v + (v >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
	return (v * 0x0101010101010101ULL) >> 56;
}

/* Records [base, base + size) of process `pid` as memory of `kind`, or
 * forgets it (kind 0). A global function: the verifier checks its loop once,
 * not at each caller (cuMemUnmap calls it in a loop of its own). */
__noinline int mark_range(__u32 pid, __u64 base, __u64 size, __u32 kind)
{
	struct range_key k = {.tgid = pid};
	__u32 v = kind;

	for (int i = 0; i < MAX_BLOCKS && size; i++) {
		/* the largest block that starts at base and fits */
		__u64 block = pow2_floor(size), align = base & -base;

		if (align && align < block)
			block = align;
		k.prefixlen = 32 + 64 - log2_pow2(block);
		k.addr = bpf_cpu_to_be64(base);
		if (!kind) {
			bpf_map_delete_elem(&cuda_ranges, &k);
		} else if (bpf_map_update_elem(&cuda_ranges, &k, &v, BPF_ANY)) {
			bump(STAT_OBJECTS_FULL);
			return 0;
		}
		base += block;
		size -= block;
	}
	return 0;
}

/* What `addr` of the calling process is: MEM_DEVICE, MEM_MANAGED, or 0 (host). */
static __always_inline __u32 mem_kind(__u64 addr)
{
	struct range_key k = {.prefixlen = 96, .tgid = tgid(), .addr = bpf_cpu_to_be64(addr)};
	__u32 *v = bpf_map_lookup_elem(&cuda_ranges, &k);

	return v ? *v : 0;
}

/* CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) */
SEC("uprobe")
int BPF_UPROBE(cu_mem_alloc, __u64 *dptr, __u64 bytesize)
{
	return stash(CALL_ALLOC, (__u64)dptr, 0, bytesize);
}

/* CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) */
SEC("uprobe")
int BPF_UPROBE(cu_mem_alloc_managed, __u64 *dptr, __u64 bytesize)
{
	return stash(CALL_MANAGED, (__u64)dptr, 0, bytesize);
}

/* CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream),
 * cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
 *                         CUstream hStream) and their _ptsz variants */
SEC("uprobe")
int BPF_UPROBE(cu_mem_alloc_async, __u64 *dptr, __u64 bytesize)
{
	return stash(CALL_ALLOC, (__u64)dptr, 0, bytesize);
}

/* CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
 *                             size_t Height, unsigned int ElementSizeBytes) */
SEC("uprobe")
int BPF_UPROBE(cu_mem_alloc_pitch, __u64 *dptr, __u64 *pitch, __u64 width, __u64 height)
{
	return stash(CALL_PITCH, (__u64)dptr, (__u64)pitch, height);
}

/* CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
 *                      const CUmemAllocationProp *prop, unsigned long long flags) */
SEC("uprobe")
int BPF_UPROBE(cu_mem_create, __u64 *handle, __u64 size)
{
	return stash(CALL_CREATE, (__u64)handle, 0, size);
}

/* CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
 *                                         void *osHandle, CUmemAllocationHandleType type) */
SEC("uprobe")
int BPF_UPROBE(cu_mem_import, __u64 *handle)
{
	return stash(CALL_IMPORT, (__u64)handle, 0, 0);
}

/* One uretprobe for every call stashed above. */
SEC("uretprobe")
int BPF_URETPROBE(cu_alloc_ret, int ret)
{
	__u64 out = 0, pitch = 0, size;
	struct obj o = {};
	struct pending p;

	if (!take_pending(bpf_get_current_pid_tgid(), &p))
		return 0;
	size = p.size;
	if (ret != CUDA_SUCCESS || bpf_probe_read_user(&out, sizeof(out), (void *)p.out))
		return 0;
	if (p.call == CALL_PITCH) {
		if (bpf_probe_read_user(&pitch, sizeof(pitch), (void *)p.out2))
			return 0;
		size = pitch * size; /* pitch x height */
	}
	if (p.call == CALL_IMPORT)
		size = 0; /* counted by the process that created it */
	o.size = size;
	if (p.call == CALL_CREATE || p.call == CALL_IMPORT) {
		remember(KIND_HANDLE, out, &o);
	} else {
		remember(KIND_DPTR, out, &o);
		mark_range(tgid(), out, size, p.call == CALL_MANAGED ? MEM_MANAGED : MEM_DEVICE);
	}
	charge(size);
	return 0;
}

static __always_inline struct obj *find(__u32 kind, __u64 id, struct obj_key *k)
{
	k->tgid = tgid();
	k->kind = kind;
	k->id = id;
	return bpf_map_lookup_elem(&cuda_objs, k);
}

static __always_inline int free_dptr(__u64 dptr)
{
	struct obj_key k;
	struct obj *o = find(KIND_DPTR, dptr, &k);
	__u64 size;

	if (!o) {
		bump(STAT_UNKNOWN_FREE);
		return 0;
	}
	size = o->size;
	/* whoever deletes the entry gives its bytes back, once */
	if (!bpf_map_delete_elem(&cuda_objs, &k)) {
		charge(-(__s64)size);
		mark_range(k.tgid, dptr, size, 0);
	}
	return 0;
}

/* CUresult cuMemFree_v2(CUdeviceptr dptr) */
SEC("uprobe")
int BPF_UPROBE(cu_mem_free, __u64 dptr)
{
	return free_dptr(dptr);
}

/* CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) and its _ptsz variant */
SEC("uprobe")
int BPF_UPROBE(cu_mem_free_async, __u64 dptr)
{
	return free_dptr(dptr);
}

/* Gives a handle's memory back once it is released and unmapped everywhere
 * in this process. */
static __always_inline void settle(struct obj *h, struct obj_key *k)
{
	__u64 size;

	if (!h->released || h->mappings)
		return;
	size = h->size;
	/* a release and the last unmap on two threads may both get here */
	if (!bpf_map_delete_elem(&cuda_objs, k))
		charge(-(__s64)size);
}

/* CUresult cuMemRelease(CUmemGenericAllocationHandle handle) */
SEC("uprobe")
int BPF_UPROBE(cu_mem_release, __u64 handle)
{
	struct obj_key k;
	struct obj *h = find(KIND_HANDLE, handle, &k);

	if (!h) {
		bump(STAT_UNKNOWN_FREE);
		return 0;
	}
	h->released = 1;
	settle(h, &k);
	return 0;
}

/* CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
 *                   CUmemGenericAllocationHandle handle, unsigned long long flags) */
SEC("uprobe")
int BPF_UPROBE(cu_mem_map, __u64 ptr, __u64 size, __u64 offset, __u64 handle)
{
	struct obj_key k;
	struct obj *h = find(KIND_HANDLE, handle, &k);
	struct obj m = {.handle = handle, .span = size};

	if (!h) {
		bump(STAT_UNKNOWN_FREE);
		return 0;
	}
	__sync_fetch_and_add(&h->mappings, 1);
	remember(KIND_MAPPING, ptr, &m);
	mark_range(k.tgid, ptr, size, MEM_DEVICE);
	return 0;
}

/* CUresult cuMemUnmap(CUdeviceptr ptr, size_t size): the range must consist of
 * whole mappings, possibly several adjacent ones. */
SEC("uprobe")
int BPF_UPROBE(cu_mem_unmap, __u64 ptr, __u64 size)
{
	__u64 end = ptr + size;

	for (int i = 0; i < MAX_UNMAP_SPAN && ptr < end; i++) {
		struct obj_key mk, hk;
		struct obj *m = find(KIND_MAPPING, ptr, &mk), *h;
		__u64 handle, span;

		if (!m) {
			bump(STAT_UNKNOWN_FREE);
			return 0;
		}
		handle = m->handle;
		span = m->span;
		bpf_map_delete_elem(&cuda_objs, &mk);
		mark_range(mk.tgid, ptr, span, 0);
		h = find(KIND_HANDLE, handle, &hk);
		if (h) {
			if (h->mappings)
				__sync_fetch_and_sub(&h->mappings, 1);
			settle(h, &hk);
		}
		if (!span)
			return 0;
		ptr += span;
	}
	return 0;
}

static __always_inline int copied(__u64 bytes, bool to_device)
{
	struct cuda_cgroup *cg = my_cgroup();

	if (!cg)
		return 0;
	if (to_device)
		__sync_fetch_and_add(&cg->h2d_bytes, bytes);
	else
		__sync_fetch_and_add(&cg->d2h_bytes, bytes);
	return 0;
}

/* CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
 * and cuMemcpyHtoDAsync_v2(..., CUstream hStream), and their _ptds/_ptsz variants */
SEC("uprobe")
int BPF_UPROBE(cu_memcpy_htod, __u64 dst, __u64 src, __u64 bytes)
{
	return copied(bytes, true);
}

/* cuMemcpyHtoD_v2 and its _ptds variant: synchronous, so the call's time is
 * the copy's (the join weighs it against the host link's full speed: the
 * feed stall's pcie_link cause). Timed to the return, cu_copy_ret. */
SEC("uprobe")
int BPF_UPROBE(cu_memcpy_htod_sync, __u64 dst, __u64 src, __u64 bytes)
{
	copied(bytes, true);
	return stash(CALL_COPY_H2D, 0, bytes, bpf_ktime_get_ns());
}

SEC("uretprobe")
int BPF_URETPROBE(cu_copy_ret, int ret)
{
	__u64 now = bpf_ktime_get_ns();
	struct cuda_cgroup *cg;
	struct pending p;

	/* p.size: when the copy began; p.out2: its bytes */
	if (!take_pending(bpf_get_current_pid_tgid(), &p) || p.call != CALL_COPY_H2D)
		return 0;
	if (ret != CUDA_SUCCESS || now <= p.size)
		return 0;
	cg = my_cgroup();
	if (!cg)
		return 0;
	__sync_fetch_and_add(&cg->h2d_copy_ns, now - p.size);
	__sync_fetch_and_add(&cg->h2d_copy_bytes, p.out2);
	return 0;
}

/* CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
 * and cuMemcpyDtoHAsync_v2(..., CUstream hStream), and their _ptds/_ptsz variants */
SEC("uprobe")
int BPF_UPROBE(cu_memcpy_dtoh, __u64 dst, __u64 src, __u64 bytes)
{
	return copied(bytes, false);
}

/* CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) and
 * cuMemcpyAsync(..., CUstream hStream), and their _ptds/_ptsz variants:
 * unified addressing, the direction from what the two addresses are. */
SEC("uprobe")
int BPF_UPROBE(cu_memcpy, __u64 dst, __u64 src, __u64 bytes)
{
	bool to_device = mem_kind(dst) != 0, from_device = mem_kind(src) != 0;

	if (to_device == from_device)
		return 0; /* within the device, or within the host */
	return copied(bytes, to_device);
}

/* A stream of the cgroup got outstanding work: the first opens its busy interval. */
static __always_inline void work_open(struct cuda_cgroup *cg, __u64 now)
{
	if (__sync_fetch_and_add(&cg->busy_streams, 1) == 0)
		cg->busy_since = now;
}

/* A stream's work is done: the last closes the cgroup's busy interval (its
 * start read before leaving, as in gpu_driver.bpf.c). */
static __always_inline void work_close(struct cuda_cgroup *cg, __u64 end)
{
	__u64 since = cg->busy_since;

	if (__sync_fetch_and_add(&cg->busy_streams, -1) == 1 && (__s64)(end - since) > 0)
		__sync_fetch_and_add(&cg->busy_ns, end - since);
}

/* The calling thread's cumulative run-queue wait (0 without sched_info). */
static __always_inline __u64 my_run_delay(void)
{
	struct task_struct *t;

	if (!feed_stall)
		return 0;
	t = bpf_get_current_task_btf();
	if (!bpf_core_field_exists(t->sched_info))
		return 0;
	return t->sched_info.run_delay;
}

/* A launch closes the calling thread's feed gap, if one is open. */
static __always_inline void feed_gap_close(struct cuda_cgroup *cg, __u64 now)
{
	struct task_struct *t;
	struct feeder *f;
	__u64 queued, idle;

	if (!feed_stall)
		return;
	t = bpf_get_current_task_btf();
	f = bpf_task_storage_get(&cuda_feeders, t, 0, 0);
	if (!f || !f->at)
		return;
	/* with other work of the cgroup in flight the GPU was not idle */
	if (cg->busy_streams == 0 && now > f->at) {
		queued = my_run_delay() - f->run_delay;
		if ((__s64)queued < 0)
			queued = 0;
		idle = t->nvcsw == f->nvcsw ? now - f->at : queued;
		if (idle < queued)
			idle = queued;
		__sync_fetch_and_add(&cg->feed_cpu_ns, queued);
		__sync_fetch_and_add(&cg->feed_idle_ns, idle);
	}
	f->at = 0;
}

/* A call showed the cgroup's last outstanding work done: the calling thread's
 * feed gap opens now. For a blocking synchronisation, `entry_delay` is its
 * run_delay when the call began: what it grew since is the wait between the
 * completion waking it and it running, already GPU idle. */
static __always_inline void feed_gap_open(struct cuda_cgroup *cg, __u64 now, bool blocking,
					  __u64 entry_delay)
{
	struct task_struct *t;
	struct feeder *f;
	__u64 rd, queued;

	if (!feed_stall || cg->busy_streams != 0)
		return;
	t = bpf_get_current_task_btf();
	f = bpf_task_storage_get(&cuda_feeders, t, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!f) {
		bump(STAT_NO_STORAGE);
		return;
	}
	rd = my_run_delay();
	if (blocking && rd > entry_delay) {
		queued = rd - entry_delay;
		__sync_fetch_and_add(&cg->feed_cpu_ns, queued);
		__sync_fetch_and_add(&cg->feed_idle_ns, queued);
	}
	f->at = now;
	f->run_delay = rd;
	f->nvcsw = t->nvcsw;
}

static __always_inline void stream_done(struct cuda_cgroup *cg, __u32 pid, __u64 stream, __u64 end)
{
	struct stream_key k = {.tgid = pid, .stream = stream};

	/* whoever deletes the entry closes it, once */
	if (!bpf_map_delete_elem(&cuda_streams, &k))
		work_close(cg, end);
}

/* The stream a call names, as the probes key it: the per-thread default
 * stream (CU_STREAM_PER_THREAD, or 0 in a _ptsz call) is the calling
 * thread's own, keyed by its thread id above the handle (real handles are
 * aligned pointers, so no other key ends in 0x2); CU_STREAM_LEGACY is 0. */
static __always_inline __u64 stream_of(__u64 stream, bool ptsz)
{
	if (stream == CU_STREAM_PER_THREAD || (ptsz && stream == 0))
		return (bpf_get_current_pid_tgid() << 32) | CU_STREAM_PER_THREAD;
	return stream == CU_STREAM_LEGACY ? 0 : stream;
}

/* A launch of a kernel or a graph: counted, and its stream marked busy. */
static __always_inline int launched(__u64 stream, bool ptsz)
{
	struct cuda_cgroup *cg = my_cgroup();
	struct stream_key k = {.tgid = tgid(), .stream = stream_of(stream, ptsz)};
	__u64 now = bpf_ktime_get_ns(), *last;

	if (!cg)
		return 0;
	__sync_fetch_and_add(&cg->launches, 1);
	feed_gap_close(cg, now);
	last = bpf_map_lookup_elem(&cuda_streams, &k);
	if (last) {
		*last = now;
		return 0;
	}
	if (bpf_map_update_elem(&cuda_streams, &k, &now, BPF_NOEXIST)) {
		/* another thread made it meanwhile, or the map is full */
		last = bpf_map_lookup_elem(&cuda_streams, &k);
		if (last)
			*last = now;
		else
			bump(STAT_UNTRACKED_LAUNCH);
		return 0;
	}
	work_open(cg, now);
	return 0;
}

/* CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ,
 *                         unsigned blockDimX, blockDimY, blockDimZ,
 *                         unsigned sharedMemBytes, CUstream hStream,
 *                         void **kernelParams, void **extra)
 * and cuLaunchKernel_ptsz. The launch path is hot: opt-in. The 9th argument
 * is on the user stack, read with bpf_probe_read_user. */
#if defined(__TARGET_ARCH_x86)
#define LAUNCH_STREAM_SP 24 /* above the return address, blockDimZ, sharedMemBytes */
#elif defined(__TARGET_ARCH_arm64)
#define LAUNCH_STREAM_SP 0 /* x0-x7 hold the first eight */
#else
#error "the stack offset of cuLaunchKernel's stream for this architecture is missing"
#endif
/* A kernel launch whose stream is at user address `at`. */
static __always_inline int kernel_launched(__u64 at, bool ptsz)
{
	__u64 stream;

	if (bpf_probe_read_user(&stream, sizeof(stream), (void *)at)) {
		struct cuda_cgroup *cg = my_cgroup();

		/* counted, but its stream is unknown */
		if (cg)
			__sync_fetch_and_add(&cg->launches, 1);
		bump(STAT_UNTRACKED_LAUNCH);
		return 0;
	}
	return launched(stream, ptsz);
}

SEC("uprobe")
int BPF_UPROBE(cu_launch_kernel)
{
	return kernel_launched(PT_REGS_SP(ctx) + LAUNCH_STREAM_SP, false);
}

SEC("uprobe")
int BPF_UPROBE(cu_launch_kernel_ptsz)
{
	return kernel_launched(PT_REGS_SP(ctx) + LAUNCH_STREAM_SP, true);
}

/* CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f,
 *                           void **kernelParams, void **extra) and
 * cuLaunchKernelEx_ptsz: the stream is a field of the configuration, after
 * its seven unsigned ints (gridDim, blockDim, sharedMemBytes), 8-aligned. */
#define LAUNCH_CONFIG_STREAM 32
SEC("uprobe")
int BPF_UPROBE(cu_launch_kernel_ex, __u64 config)
{
	return kernel_launched(config + LAUNCH_CONFIG_STREAM, false);
}

SEC("uprobe")
int BPF_UPROBE(cu_launch_kernel_ex_ptsz, __u64 config)
{
	return kernel_launched(config + LAUNCH_CONFIG_STREAM, true);
}

/* CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) and
 * cuGraphLaunch_ptsz: one launch of the whole graph (how many kernels it
 * holds is not visible here); its completion is seen as a kernel's. */
SEC("uprobe")
int BPF_UPROBE(cu_graph_launch, __u64 exec, __u64 stream)
{
	return launched(stream, false);
}

SEC("uprobe")
int BPF_UPROBE(cu_graph_launch_ptsz, __u64 exec, __u64 stream)
{
	return launched(stream, true);
}

static __always_inline int event_recorded(__u64 event, __u64 stream, bool ptsz)
{
	struct stream_key k = {.tgid = tgid(), .stream = event};
	struct event_rec r = {.stream = stream_of(stream, ptsz), .recorded = bpf_ktime_get_ns()};

	bpf_map_update_elem(&cuda_events, &k, &r, BPF_ANY);
	return 0;
}

/* CUresult cuEventRecord(CUevent hEvent, CUstream hStream) and cuEventRecord_ptsz */
SEC("uprobe")
int BPF_UPROBE(cu_event_record, __u64 event, __u64 stream)
{
	return event_recorded(event, stream, false);
}

SEC("uprobe")
int BPF_UPROBE(cu_event_record_ptsz, __u64 event, __u64 stream)
{
	return event_recorded(event, stream, true);
}

/* A call that waits for the work behind a handle (a stream or an event), its
 * wait timed from the entry, and its query form, which answers at once: both
 * stashed for cu_sync_ret. `key` turns the handle into the probes' key. */
#define WAIT_AND_QUERY(wait_prog, wait_call, query_prog, query_call, key) \
	SEC("uprobe")                                                      \
	int BPF_UPROBE(wait_prog, __u64 handle)                            \
	{                                                                  \
		return stash(wait_call, key, my_run_delay(), bpf_ktime_get_ns()); \
	}                                                                  \
	SEC("uprobe")                                                      \
	int BPF_UPROBE(query_prog, __u64 handle)                           \
	{                                                                  \
		return stash(query_call, key, 0, 0);                       \
	}

/* CUresult cuStreamSynchronize(CUstream hStream), cuStreamQuery(CUstream hStream),
 * and their _ptsz variants */
WAIT_AND_QUERY(cu_stream_sync, CALL_STREAM_SYNC, cu_stream_query, CALL_STREAM_QUERY,
	       stream_of(handle, false))
WAIT_AND_QUERY(cu_stream_sync_ptsz, CALL_STREAM_SYNC, cu_stream_query_ptsz, CALL_STREAM_QUERY,
	       stream_of(handle, true))

/* CUresult cuCtxSynchronize(void) */
SEC("uprobe")
int BPF_UPROBE(cu_ctx_sync)
{
	return stash(CALL_CTX_SYNC, 0, my_run_delay(), bpf_ktime_get_ns());
}

/* CUresult cuEventSynchronize(CUevent hEvent), cuEventQuery(CUevent hEvent) */
WAIT_AND_QUERY(cu_event_sync, CALL_EVENT_SYNC, cu_event_query, CALL_EVENT_QUERY, handle)

struct close_ctx {
	struct cuda_cgroup *cg;
	__u64 end;
	__u32 tgid;
};

static long close_stream(struct bpf_map *map, struct stream_key *k, __u64 *last,
			 struct close_ctx *c)
{
	if (k->tgid == c->tgid && !bpf_map_delete_elem(&cuda_streams, k))
		work_close(c->cg, c->end);
	return 0;
}

/* Every stream of process `pid` done at `end`. */
static __always_inline void all_done(struct cuda_cgroup *cg, __u32 pid, __u64 end)
{
	struct close_ctx c = {.cg = cg, .end = end, .tgid = pid};

	bpf_for_each_map_elem(&cuda_streams, close_stream, &c, 0);
}

/* The work an event waits for is done: its stream's, when nothing was
 * launched there after the record (otherwise the stream stays busy). */
static __always_inline void event_done(struct cuda_cgroup *cg, __u32 pid, __u64 event, __u64 end)
{
	struct stream_key ek = {.tgid = pid, .stream = event}, sk = {.tgid = pid};
	struct event_rec *r = bpf_map_lookup_elem(&cuda_events, &ek);
	__u64 *last;

	if (!r)
		return;
	sk.stream = r->stream;
	last = bpf_map_lookup_elem(&cuda_streams, &sk);
	if (last && *last <= r->recorded)
		stream_done(cg, pid, sk.stream, end);
}

/* One uretprobe for the synchronisation calls and queries stashed above. */
SEC("uretprobe")
int BPF_URETPROBE(cu_sync_ret, int ret)
{
	__u64 id = bpf_get_current_pid_tgid(), now = bpf_ktime_get_ns();
	struct cuda_cgroup *cg;
	struct pending p;
	bool blocking;

	/* p.out: the stream or event handle; p.size: when the call began;
	 * p.out2: the thread's run_delay then (blocking calls, feed_stall) */
	if (!take_pending(id, &p))
		return 0;
	blocking = p.call == CALL_STREAM_SYNC || p.call == CALL_CTX_SYNC || p.call == CALL_EVENT_SYNC;
	if (ret != CUDA_SUCCESS && !blocking)
		return 0; /* a query answering "not ready" */
	cg = my_cgroup();
	if (!cg)
		return 0;
	/* The host thread waited this long for the GPU, whatever the outcome:
	 * the latency signal a pod feels when the GPU (or its link) is slow. */
	if (blocking && now > p.size)
		hist_record(&cg->sync_wait, now - p.size);
	if (ret != CUDA_SUCCESS || !busy_estimate)
		return 0; /* an error (nothing is known complete), or no busy estimate */
	switch (p.call) {
	case CALL_STREAM_SYNC:
	case CALL_STREAM_QUERY:
		stream_done(cg, id >> 32, p.out, now);
		break;
	case CALL_CTX_SYNC:
		all_done(cg, id >> 32, now);
		break;
	case CALL_EVENT_SYNC:
	case CALL_EVENT_QUERY:
		event_done(cg, id >> 32, p.out, now);
		break;
	}
	feed_gap_open(cg, now, blocking, p.out2);
	return 0;
}

struct drop_ctx {
	__u32 tgid;
};

static long drop_objects(struct bpf_map *map, struct obj_key *k, struct obj *o,
			 struct drop_ctx *c)
{
	if (k->tgid != c->tgid)
		return 0;
	/* the address ranges go with the objects that made them */
	if (k->kind == KIND_DPTR)
		mark_range(k->tgid, k->id, o->size, 0);
	else if (k->kind == KIND_MAPPING)
		mark_range(k->tgid, k->id, o->span, 0);
	bpf_map_delete_elem(&cuda_objs, k);
	return 0;
}

/* A process that exits gives back what it still holds. */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(cuda_exit, struct task_struct *p)
{
	struct drop_ctx c = {.tgid = p->tgid};
	struct cuda_cgroup *cg;
	struct proc_vram *pv;
	__s64 bytes;

	/* the last thread of the process, which need not be the leader */
	if (p->signal->live.counter != 0)
		return 0;
	/* its outstanding work ends with it (the driver tears its context down) */
	cg = cuda_cgroup_get(task_dfl_cgroup(p), false);
	if (cg && busy_estimate)
		all_done(cg, c.tgid, bpf_ktime_get_ns());
	pv = bpf_map_lookup_elem(&cuda_procs, &c.tgid);
	if (!pv)
		return 0;
	bytes = pv->bytes;
	/* several exiting threads can see live == 0; the one whose delete
	 * succeeds settles the process */
	if (bpf_map_delete_elem(&cuda_procs, &c.tgid))
		return 0;
	bpf_for_each_map_elem(&cuda_objs, drop_objects, &c, 0);
	if (!bytes)
		return 0;
	cg = cuda_cgroup_get(task_dfl_cgroup(p), true);
	if (cg) {
		__sync_fetch_and_add(&cg->vram_bytes, -bytes);
		mark_active(task_dfl_cgroup(p), &cg->epoch);
	} else {
		bump(STAT_NO_STORAGE);
	}
	return 0;
}
