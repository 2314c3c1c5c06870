/*
 * Link-time stand-in for the NVIDIA driver library, libcuda.so.1.
 *
 * ggml-cuda calls a handful of driver API functions directly (the virtual memory pool: cuMemCreate,
 * cuMemMap, ...), so llama-server needs a libcuda.so to link against. The driver library comes with
 * the GPU driver, not with the toolkit, and a build machine without a GPU has none. This stub is
 * built with soname libcuda.so.1, so the binary records the same dependency it would record against
 * the real library; at run time the dynamic loader finds the driver's libcuda.so.1 instead. The stub
 * is never shipped or put on a library path.
 *
 * The list is what `nm -u` shows for the ggml-cuda objects of the pinned llama.cpp. A new driver
 * call in a future llama.cpp shows up as an undefined reference when llama-server links: add it here
 * with its prototype from cuda.h (the header maps versioned names such as cuMemGetInfo_v2 for us).
 * Every function fails with CUDA_ERROR_STUB_LIBRARY, the driver's own code for "this is a stub".
 */
#include <cuda.h>
#include <stddef.h>

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
    (void) error;
    if (pStr) {
        *pStr = "libcuda stub: the NVIDIA driver library is not loaded";
    }
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
    (void) device;
    (void) ordinal;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    (void) pi;
    (void) attrib;
    (void) dev;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags) {
    (void) ptr;
    (void) size;
    (void) alignment;
    (void) addr;
    (void) flags;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    (void) ptr;
    (void) size;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags) {
    (void) handle;
    (void) size;
    (void) prop;
    (void) flags;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
    (void) handle;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option) {
    (void) granularity;
    (void) prop;
    (void) option;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags) {
    (void) ptr;
    (void) size;
    (void) offset;
    (void) handle;
    (void) flags;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
    (void) ptr;
    (void) size;
    return CUDA_ERROR_STUB_LIBRARY;
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    (void) ptr;
    (void) size;
    (void) desc;
    (void) count;
    return CUDA_ERROR_STUB_LIBRARY;
}
