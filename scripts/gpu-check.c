/*
 * The CUDA program scripts/gpu-check.sh runs under gpufeed-guest on a machine
 * with an NVIDIA GPU: it does known amounts of each thing the GPU probes
 * count, through the CUDA driver API (libcuda.so.1, opened with dlopen: no
 * CUDA toolkit is needed to build it, only a C compiler), and writes its own
 * counts so that the script can set them beside what the agent saw.
 *
 * Phases, driven by files in CTL_DIR (the script creates the go files):
 *   init      cuInit, device 0, its primary context, a PTX module with a
 *             spinning kernel (JIT-compiled by the driver); writes `ready`
 *   go        64 MiB and 16 MiB with cuMemAlloc_v2; 32 MiB (rounded up to the
 *             granularity) through the VMM API (cuMemCreate, reserve, map,
 *             set access); copies: 64 MiB + 8 MiB host-to-device (one
 *             synchronous, one asynchronous), 16 MiB device-to-host;
 *             LAUNCHES kernels of SPIN_MS each on the default stream, a
 *             cuStreamSynchronize after every 10 and a cuCtxSynchronize at
 *             the end; writes `peak` and its counts to CTL_DIR/result
 *   release   frees, unmaps and releases everything; writes `freed`
 *   exit      returns
 *
 * The types and signatures are those of NVIDIA's cuda.h (CUDA 12, x86_64).
 *
 * usage: gpu-check CTL_DIR
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
/* the driver API's types and the clients' helpers, shared with the stand-in
 * library's test clients (gpu-check.sh passes their directory with -I) */
#include "cuda_client.h"

#define MIB (1024ULL * 1024)
#define LAUNCHES 50
#define SPIN_MS 2

/* A kernel that spins for `cycles` SM clock cycles. */
static const char ptx[] = ".version 7.0\n"
			  ".target sm_70\n"
			  ".address_size 64\n"
			  ".visible .entry spin(.param .u64 cycles)\n"
			  "{\n"
			  "  .reg .pred %p;\n"
			  "  .reg .b64 %rd<5>;\n"
			  "  ld.param.u64 %rd1, [cycles];\n"
			  "  mov.u64 %rd2, %clock64;\n"
			  "LOOP:\n"
			  "  mov.u64 %rd3, %clock64;\n"
			  "  sub.s64 %rd4, %rd3, %rd2;\n"
			  "  setp.lt.u64 %p, %rd4, %rd1;\n"
			  "  @%p bra LOOP;\n"
			  "  ret;\n"
			  "}\n";

/* The driver API functions used, with cuda.h's signatures. */
#define CU_FUNCTIONS(X)                                                                    \
	X(cuInit, unsigned int)                                                            \
	X(cuDeviceGet, CUdevice *, int)                                                    \
	X(cuDeviceGetAttribute, int *, int, CUdevice)                                      \
	X(cuDevicePrimaryCtxRetain, CUcontext *, CUdevice)                                 \
	X(cuCtxSetCurrent, CUcontext)                                                      \
	X(cuModuleLoadData, CUmodule *, const void *)                                      \
	X(cuModuleGetFunction, CUfunction *, CUmodule, const char *)                       \
	X(cuMemAlloc_v2, CUdeviceptr *, size_t)                                            \
	X(cuMemFree_v2, CUdeviceptr)                                                       \
	X(cuMemGetAllocationGranularity, size_t *, const CUmemAllocationProp *, int)       \
	X(cuMemCreate, CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, \
	  unsigned long long)                                                              \
	X(cuMemRelease, CUmemGenericAllocationHandle)                                      \
	X(cuMemAddressReserve, CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long) \
	X(cuMemAddressFree, CUdeviceptr, size_t)                                           \
	X(cuMemMap, CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,             \
	  unsigned long long)                                                              \
	X(cuMemUnmap, CUdeviceptr, size_t)                                                 \
	X(cuMemSetAccess, CUdeviceptr, size_t, const CUmemAccessDesc *, size_t)            \
	X(cuMemcpyHtoD_v2, CUdeviceptr, const void *, size_t)                              \
	X(cuMemcpyHtoDAsync_v2, CUdeviceptr, const void *, size_t, CUstream)               \
	X(cuMemcpyDtoH_v2, void *, CUdeviceptr, size_t)                                    \
	X(cuLaunchKernel, CUfunction, unsigned int, unsigned int, unsigned int,            \
	  unsigned int, unsigned int, unsigned int, unsigned int, CUstream, void **,       \
	  void **)                                                                         \
	X(cuStreamSynchronize, CUstream)                                                   \
	X(cuCtxSynchronize, void)

CU_FUNCTIONS(CUDA_DECLARE)

/* Calls a driver function; any error ends the program with its name. */
#define CALL(name, ...)                                                                    \
	do {                                                                               \
		CUresult r_ = name##_p(__VA_ARGS__);                                       \
		if (r_ != 0) {                                                             \
			fprintf(stderr, "gpu-check: %s failed: CUresult %d\n", #name, r_);  \
			exit(1);                                                           \
		}                                                                          \
	} while (0)

/* cuStreamSynchronize / cuCtxSynchronize, timed. */
static long long sync_ns;
static int sync_calls;

static void timed_sync(int whole_context)
{
	long long t = now_ns();

	if (whole_context)
		CALL(cuCtxSynchronize, );
	else
		CALL(cuStreamSynchronize, (CUstream)0);
	sync_ns += now_ns() - t;
	sync_calls++;
}

int main(int argc, char **argv)
{
	CUdeviceptr a, b, va;
	CUmemGenericAllocationHandle handle;
	CUmemAllocationProp prop;
	CUmemAccessDesc access_desc;
	CUcontext ctx;
	CUmodule mod;
	CUfunction spin;
	CUdevice dev;
	size_t gran = 0, vmm;
	unsigned long long cycles;
	long long first_launch, busy_ns;
	int khz = 0;
	char *host;
	char path[4096];
	FILE *out;

	if (argc != 2) {
		fprintf(stderr, "usage: gpu-check CTL_DIR\n");
		return 2;
	}
	ctl_dir = argv[1];
	cuda_open();
	CU_FUNCTIONS(CUDA_RESOLVE)
	CALL(cuInit, 0u);
	CALL(cuDeviceGet, &dev, 0);
	CALL(cuDeviceGetAttribute, &khz, CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev);
	CALL(cuDevicePrimaryCtxRetain, &ctx, dev);
	CALL(cuCtxSetCurrent, ctx);
	CALL(cuModuleLoadData, &mod, (const void *)ptx);
	CALL(cuModuleGetFunction, &spin, mod, "spin");
	host = calloc(1, 64 * MIB);
	if (!host)
		return 1;
	ctl_touch("ready");

	ctl_await(10000, "go");
	CALL(cuMemAlloc_v2, &a, (size_t)(64 * MIB));
	CALL(cuMemAlloc_v2, &b, (size_t)(16 * MIB));
	memset(&prop, 0, sizeof(prop));
	prop.type = 1;
	prop.location.type = 1;
	prop.location.id = dev;
	CALL(cuMemGetAllocationGranularity, &gran, &prop, 0);
	if (!gran)
		gran = 2 * MIB;
	vmm = (32 * MIB + gran - 1) / gran * gran;
	CALL(cuMemCreate, &handle, vmm, &prop, 0ULL);
	CALL(cuMemAddressReserve, &va, vmm, (size_t)0, (CUdeviceptr)0, 0ULL);
	CALL(cuMemMap, va, vmm, (size_t)0, handle, 0ULL);
	access_desc.location = prop.location;
	access_desc.flags = 3;
	CALL(cuMemSetAccess, va, vmm, &access_desc, (size_t)1);

	CALL(cuMemcpyHtoD_v2, a, (const void *)host, (size_t)(64 * MIB));
	CALL(cuMemcpyHtoDAsync_v2, va, (const void *)host, (size_t)(8 * MIB), (CUstream)0);
	timed_sync(0);
	CALL(cuMemcpyDtoH_v2, (void *)host, b, (size_t)(16 * MIB));

	/* kHz x ms = cycles */
	cycles = (unsigned long long)(khz > 0 ? khz : 1000000) * SPIN_MS;
	first_launch = now_ns();
	for (int i = 0; i < LAUNCHES; i++) {
		void *params[] = {&cycles};

		CALL(cuLaunchKernel, spin, 1u, 1u, 1u, 1u, 1u, 1u, 0u, (CUstream)0, params,
		     (void **)NULL);
		if (i % 10 == 9)
			timed_sync(i == LAUNCHES - 1);
	}
	busy_ns = now_ns() - first_launch;

	snprintf(path, sizeof(path), "%s/result", ctl_dir);
	out = fopen(path, "w");
	if (!out)
		return 1;
	fprintf(out, "vram_bytes %llu\n", 80 * MIB + (unsigned long long)vmm);
	fprintf(out, "h2d_bytes %llu\n", 72 * MIB);
	fprintf(out, "d2h_bytes %llu\n", 16 * MIB);
	fprintf(out, "launches %d\n", LAUNCHES);
	fprintf(out, "sync_calls %d\n", sync_calls);
	fprintf(out, "sync_wait_ns %lld\n", sync_ns);
	fprintf(out, "launch_to_done_ns %lld\n", busy_ns);
	fprintf(out, "kernel_ns %lld\n", (long long)LAUNCHES * SPIN_MS * 1000000LL);
	if (fclose(out) != 0)
		return 1;
	ctl_touch("peak");

	ctl_await(10000, "release");
	CALL(cuMemUnmap, va, vmm);
	CALL(cuMemAddressFree, va, vmm);
	CALL(cuMemRelease, handle);
	CALL(cuMemFree_v2, b);
	CALL(cuMemFree_v2, a);
	ctl_touch("freed");
	ctl_await(10000, "exit");
	return 0;
}
