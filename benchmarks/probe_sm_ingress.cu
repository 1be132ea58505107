// Probe for issue 21's next design (docs/decisions/cluster-dit-kernel.md, "Next design"):
// bulk-copy (TMA) ingress per SM when N SMs stream at once, from HBM (each CTA its own fresh
// range of an 8 GB buffer) and from L2 (each CTA re-reads its own 256 KB window). One CTA per
// SM, thread 0 keeps `ring` copies of `slot` bytes in flight on mbarriers; no compute. Prints
// N, total and per-SM GB/s (median of 3 launches after one warm-up). Standalone (no torch):
//
//     nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/probe benchmarks/probe_sm_ingress.cu
//     /tmp/probe                                                   (H200: seconds)
//
// Compile-checked for sm_90a on 2026-12-06; not yet run (no device time was left).
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); return 1; } } while (0)

__device__ __forceinline__ unsigned smem_u32(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__global__ void __launch_bounds__(128, 1) ingress(const char *src, size_t stride_per_cta,
                                                  size_t bytes_per_cta, size_t window,
                                                  int slot, int ring, unsigned long long *sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    uint64_t *bars = reinterpret_cast<uint64_t *>(smem + (size_t)ring * slot);
    const char *base = src + (size_t)blockIdx.x * stride_per_cta;
    const size_t n = bytes_per_cta / slot;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ring; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bars + s)));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (size_t i = 0; i < n + ring; ++i) {
            if (i >= (size_t)ring) {            // wait for copy i - ring
                const size_t j = i - ring;
                const unsigned parity = (unsigned)((j / ring) & 1);
                unsigned done;
                do {
                    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                                 " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done)
                                 : "r"(smem_u32(bars + j % ring)), "r"(parity) : "memory");
                } while (!done);
            }
            if (i < n) {
                const int s = (int)(i % ring);
                const char *from = base + (i * (size_t)slot) % window;
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                             ::"r"(smem_u32(bars + s)), "r"(slot) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                             " [%0], [%1], %2, [%3];\n" ::"r"(smem_u32(smem + (size_t)s * slot)),
                             "l"(from), "r"(slot), "r"(smem_u32(bars + s)) : "memory");
            }
        }
        sink[blockIdx.x] = smem[blockIdx.x % slot];
    }
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const size_t total = (size_t)8 << 30;
    char *buf;
    CK(cudaMalloc(&buf, total));
    CK(cudaMemset(buf, 1, total));
    unsigned long long *sink;
    CK(cudaMalloc(&sink, 4096 * 8));
    CK(cudaFuncSetAttribute(ingress, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    printf("%-6s %-4s %-8s %-6s %10s %12s\n", "source", "N", "slot KB", "ring", "total GB/s", "per SM GB/s");
    const int Ns[] = {1, 8, 16, 32, 64, 132};
    const int slots[] = {12288, 32768};
    for (int src = 0; src < 2; ++src) {             // 0: HBM, 1: L2 (a 256 KB window per CTA)
        for (int slot : slots) {
            const int ring = std::min(160 * 1024 / slot, 12);
            for (int N : Ns) {
                if (N > sms) continue;
                const size_t per = src == 0 ? std::min(total / N, (size_t)256 << 20) / slot * slot
                                            : (size_t)16 << 20;
                const size_t stride = src == 0 ? total / N / 4096 * 4096 : (size_t)256 << 10;
                const size_t window = src == 0 ? per : (size_t)256 << 10;
                const size_t smem = (size_t)ring * slot + ring * 8;
                std::vector<float> ms;
                for (int rep = 0; rep < 4; ++rep) {
                    CK(cudaEventRecord(a));
                    ingress<<<N, 128, smem>>>(buf, stride, per, window, slot, ring, sink);
                    CK(cudaGetLastError());
                    CK(cudaEventRecord(b));
                    CK(cudaEventSynchronize(b));
                    float t;
                    CK(cudaEventElapsedTime(&t, a, b));
                    if (rep) ms.push_back(t);
                }
                std::sort(ms.begin(), ms.end());
                const double gbs = (double)per * N / (ms[ms.size() / 2] * 1e-3) / 1e9;
                printf("%-6s %-4d %-8d %-6d %10.0f %12.1f\n", src ? "L2" : "HBM", N, slot / 1024,
                       ring, gbs, gbs / N);
            }
        }
    }
    return 0;
}
