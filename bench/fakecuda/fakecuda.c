/* A fake libcuda.so.1 (driver API) for the queries torch makes through its lazy driver loader
   (at::cuda::detail::hasPrimaryContext / c10::cuda::MaybeSetDevice: cuDevicePrimaryCtxGetState, etc.).
   Everything reports one device whose primary context is active; nothing can run. */
#include <stddef.h>
#include <string.h>
typedef int CUresult; typedef int CUdevice; typedef void *CUcontext;
static int dummy_ctx;
CUresult cuInit(unsigned int f) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGet(CUdevice *d, int o) { *d = o; return o == 0 ? 0 : 101; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active) { *flags = 0; *active = 1; return 0; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = &dummy_ctx; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { *c = &dummy_ctx; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "fake libcuda: no device"; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { *s = "CUDA_ERROR_FAKE"; return 0; }
CUresult cuDeviceGetName(char *n, int len, CUdevice d) { strncpy(n, "NVIDIA H200", len); return 0; }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { *b = 150109880320ULL; return 0; }
