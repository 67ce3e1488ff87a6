/* LD_PRELOAD shim: a CUDA runtime that "sees" one NVIDIA H200 and never touches a driver.
   Only the queries torch's C++ makes while tracing/lowering on fake tensors are answered (device count, current
   device, properties, the default stream's state); anything that would really run, allocate or copy returns an
   error (cudaErrorNoDevice), so an accidental real kernel or malloc fails loudly instead of silently succeeding.
   Build: gcc -shared -fPIC -O2 -I<nvidia/cu13/include> -Wl,--version-script=fakecudart.map fakecudart.c -o libfakecudart.so */
#include <string.h>
#include <stdlib.h>
#include <stdio.h>
#include <cuda_runtime_api.h>

static int verbose = -1;
static void trace(const char *f) {
    if (verbose < 0) { const char *e = getenv("FAKECUDART_VERBOSE"); verbose = e && *e == '1'; }
    if (verbose) fprintf(stderr, "[fakecudart] %s\n", f);
}
#include <stdlib.h>

cudaError_t cudaGetDeviceCount(int *n) { trace("cudaGetDeviceCount"); *n = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { trace("cudaSetDevice"); return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDriverGetVersion(int *v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t s) { return cudaSuccess; }
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st) { *st = cudaStreamCaptureStatusNone; return cudaSuccess; }
/* torch 2.13 (CUDA 13's signature) asks the capture id of the current stream before anything else runs */
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, enum cudaStreamCaptureStatus *st, unsigned long long *id,
                                     cudaGraph_t *g, const cudaGraphNode_t **deps, const cudaGraphEdgeData **edges,
                                     size_t *n) {
    *st = cudaStreamCaptureStatusNone; if (id) *id = 0; if (g) *g = 0; if (deps) *deps = 0; if (edges) *edges = 0;
    if (n) *n = 0; return cudaSuccess; }
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *m) { return cudaSuccess; }
cudaError_t cudaDeviceGetStreamPriorityRange(int *lo, int *hi) { if (lo) *lo = 0; if (hi) *hi = -5; return cudaSuccess; }
cudaError_t cudaDeviceCanAccessPeer(int *c, int a, int b) { *c = 0; return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *f, size_t *t) { *t = 150109880320ULL; *f = *t; return cudaSuccess; }
/* events: handed out, never used for timing */
static int ev_dummy[1024]; static int ev_next = 0;
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int fl) { trace("cudaEventCreateWithFlags"); *e = (cudaEvent_t)&ev_dummy[(ev_next++) % 1024]; return cudaSuccess; }
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = (cudaEvent_t)&ev_dummy[(ev_next++) % 1024]; return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { trace("cudaEventRecord"); return cudaSuccess; }
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned int f) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t e) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int f) { trace("cudaStreamWaitEvent"); return cudaSuccess; }
/* Memory: inductor's pattern-matcher init (fuse_attention/pad_mm/misc_patterns `_..._init`) makes small REAL cuda
   example tensors (torch.empty/tensor/randn on "cuda") to trace its patterns; "device" memory is host memory here,
   copies are memcpy and kernel launches do nothing (values are irrelevant for those traces). Counted, and logged
   with FAKECUDART_VERBOSE=1, so one can check that nothing but those small example tensors was ever allocated. */
static size_t n_malloc = 0, bytes_malloc = 0; static long n_launch = 0;
cudaError_t cudaMalloc(void **p, size_t n) {
    trace("cudaMalloc");
    if (posix_memalign(p, 512, n ? n : 1)) return cudaErrorMemoryAllocation;
    n_malloc++; bytes_malloc += n;
    if (verbose == 1) fprintf(stderr, "[fakecudart] cudaMalloc(%zu) -> host %p (total %zu in %zu)\n", n, *p, bytes_malloc, n_malloc);
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
/* Unified memory (bitsandbytes' paged optimizer states: functional.py get_paged -> cget_managed_ptr): host memory
   too, counted apart from cudaMalloc; prefetches (bitsandbytes' cprefetch before each paged update, device -1 = to
   the host) counted by direction. `fakecudart_managed` hands the counts to a script (ctypes). */
static size_t n_managed = 0, bytes_managed = 0, prefetch_dev = 0, prefetch_host = 0;
cudaError_t cudaMallocManaged(void **p, size_t n, unsigned int fl) {
    trace("cudaMallocManaged");
    if (posix_memalign(p, 4096, n ? n : 1)) return cudaErrorMemoryAllocation;
    memset(*p, 0, n);
    n_managed++; bytes_managed += n;
    if (verbose == 1) fprintf(stderr, "[fakecudart] cudaMallocManaged(%zu) -> host %p\n", n, *p);
    return cudaSuccess;
}
cudaError_t cudaMemPrefetchAsync(const void *p, size_t n, struct cudaMemLocation loc, unsigned int fl, cudaStream_t s) {
    if (loc.type == cudaMemLocationTypeDevice) prefetch_dev += n; else prefetch_host += n;
    return cudaSuccess; }
void fakecudart_managed(size_t *out) { out[0] = n_managed; out[1] = bytes_managed; out[2] = prefetch_dev; out[3] = prefetch_host; }
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaMemset(void *d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
    memset(a, 0, sizeof(*a)); a->type = cudaMemoryTypeDevice; a->device = 0; a->devicePointer = (void *)p; return cudaSuccess; }
/* kernel launches (the <<<>>> path of libtorch_cuda, CUDA 13): accepted, nothing runs */
unsigned __cudaPushCallConfiguration(dim3 g, dim3 b, size_t sm, void *st) { return 0; }
cudaError_t __cudaPopCallConfiguration(dim3 *g, dim3 *b, size_t *sm, void *st) {
    g->x = g->y = g->z = 1; b->x = b->y = b->z = 1; *sm = 0; return cudaSuccess; }
cudaError_t __cudaLaunchKernel(const void *f, dim3 g, dim3 b, void **a, size_t sm, cudaStream_t s) {
    n_launch++; if (verbose == 1) fprintf(stderr, "[fakecudart] kernel launch #%ld ignored\n", n_launch); return cudaSuccess; }
cudaError_t cudaLaunchKernel(const void *f, dim3 g, dim3 b, void **a, size_t sm, cudaStream_t s) {
    n_launch++; if (verbose == 1) fprintf(stderr, "[fakecudart] kernel launch #%ld ignored\n", n_launch); return cudaSuccess; }
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *cfg, const void *f, void **a) { n_launch++; return cudaSuccess; }
cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes *a, const void *f) {
    memset(a, 0, sizeof(*a)); a->maxThreadsPerBlock = 1024; a->numRegs = 32; return cudaSuccess; }
cudaError_t cudaFuncSetAttribute(const void *f, enum cudaFuncAttribute at, int v) { return cudaSuccess; }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, const void *f, int bs, size_t sm, unsigned fl) { *n = 2; return cudaSuccess; }
void fakecudart_report(void) __attribute__((destructor));
void fakecudart_report(void) {
    if (getenv("FAKECUDART_REPORT")) fprintf(stderr, "[fakecudart] host-backed cudaMalloc: %zu calls, %zu bytes; %ld kernel launches ignored\n", n_malloc, bytes_malloc, n_launch); }

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev) {
    trace("cudaGetDeviceProperties");
    if (dev != 0) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof(*p));
    strcpy(p->name, "NVIDIA H200");
    p->totalGlobalMem = 150109880320ULL;
    p->sharedMemPerBlock = 49152; p->regsPerBlock = 65536; p->warpSize = 32; p->memPitch = 2147483647;
    p->maxThreadsPerBlock = 1024; p->maxThreadsDim[0] = 1024; p->maxThreadsDim[1] = 1024; p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647; p->maxGridSize[1] = 65535; p->maxGridSize[2] = 65535;
    p->totalConstMem = 65536; p->major = 9; p->minor = 0; p->textureAlignment = 512;
    p->multiProcessorCount = 132; p->integrated = 0; p->canMapHostMemory = 1; p->concurrentKernels = 1;
    p->ECCEnabled = 1; p->pciBusID = 0; p->pciDeviceID = 0; p->pciDomainID = 0; p->asyncEngineCount = 3;
    p->unifiedAddressing = 1; p->memoryBusWidth = 6144; p->l2CacheSize = 52428800; p->persistingL2CacheMaxSize = 32505856;
    p->maxThreadsPerMultiProcessor = 2048; p->streamPrioritiesSupported = 1; p->globalL1CacheSupported = 1;
    p->localL1CacheSupported = 1; p->sharedMemPerMultiprocessor = 233472; p->regsPerMultiprocessor = 65536;
    p->managedMemory = 1; p->isMultiGpuBoard = 0; p->multiGpuBoardGroupID = 0; p->pageableMemoryAccess = 0;
    p->concurrentManagedAccess = 1; p->computePreemptionSupported = 1; p->canUseHostPointerForRegisteredMem = 1;
    p->cooperativeLaunch = 1; p->sharedMemPerBlockOptin = 232448; p->maxBlocksPerMultiProcessor = 32;
    p->accessPolicyMaxWindowSize = 134213632; p->reservedSharedMemPerBlock = 1024;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int dev) {
    struct cudaDeviceProp p; cudaGetDeviceProperties(&p, 0);
    switch (a) {
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrMultiProcessorCount: *v = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = 232448; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *v = 233472; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = 49152; break;
    case cudaDevAttrWarpSize: *v = 32; break;
    case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
    case cudaDevAttrMaxRegistersPerMultiprocessor: *v = 65536; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *v = 2048; break;
    case cudaDevAttrL2CacheSize: *v = 52428800; break;
    case cudaDevAttrConcurrentManagedAccess: *v = 1; break;  /* an H200's answer: bitsandbytes' cprefetch asks it */
    case cudaDevAttrManagedMemory: *v = 1; break;
    default: *v = 0;
    }
    return cudaSuccess;
}
/* pinned host memory (the D2H copy of .item() stages through it) */
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int fl) { trace("cudaHostAlloc"); return posix_memalign(p, 4096, n ? n : 1) ? cudaErrorMemoryAllocation : cudaSuccess; }
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, 0); }
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaHostRegister(void *p, size_t n, unsigned int fl) { return cudaSuccess; }
cudaError_t cudaHostUnregister(void *p) { return cudaSuccess; }
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned int fl) { *d = h; return cudaSuccess; }
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *ud) { fn(ud); return cudaSuccess; }
