// Probe for issue 21's next design (docs/decisions/cluster-dit-kernel.md, "Next design"), two
// questions of a flow loop run by one cluster of 16 CTAs:
// 1. bulk-copy (TMA) ingress per SM when N SMs stream at once, from HBM (each CTA its own fresh
//    range of an 8 GB buffer) and from L2 (each CTA re-reads its own 256 KB window). One CTA
//    per SM, thread 0 keeps `ring` copies of `slot` bytes in flight on mbarriers; no compute.
//    Prints N, total and per-SM GB/s.
// 2. inside one cluster of 8 or 16 CTAs: a cluster barrier, and an all-gather of a 16 x 768
//    bf16 activation (each CTA's slice to every peer, by DSMEM stores or bulk copies) plus a
//    barrier, in us per round; and how many such clusters fit at once.
// Medians of 3 launches after one warm-up. Standalone (no torch):
//
//     nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/probe benchmarks/probe_one_cluster.cu
//     /tmp/probe                                                   (H200: seconds)
//
// Results (H100, 2026-12-07) and what they decide: docs/decisions/cluster-dit-kernel.md.
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

// median ms of 3 runs of launch() after one warm-up, timed with events a, b (-1 on an error)
template <class Launch>
static float median_ms(cudaEvent_t a, cudaEvent_t b, Launch launch) {
    std::vector<float> ms;
    for (int rep = 0; rep < 4; ++rep) {
        cudaEventRecord(a);
        if (launch() != cudaSuccess || cudaGetLastError() != cudaSuccess) return -1.f;
        cudaEventRecord(b);
        if (cudaEventSynchronize(b) != cudaSuccess) return -1.f;
        float t;
        cudaEventElapsedTime(&t, a, b);
        if (rep) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
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

// Part 2: inside one cluster of C CTAs (8, the portable maximum, or 16, allowed with
// cudaFuncAttributeNonPortableClusterSizeAllowed), `iters` rounds of: every CTA sends its slice
// of a 16 x 768 bf16 activation (16 x 768 / C) to every peer, then a cluster barrier; or the
// barrier alone (bytes 0). `bulk`: one cp.async.bulk shared::cta -> shared::cluster copy per
// peer; else 16-byte st.shared::cluster stores by all threads. The round's time is what each
// all-gather of a one-cluster flow-loop design would cost.
__global__ void __launch_bounds__(256, 1) cluster_rounds(int iters, int slice_bytes, int bulk,
                                                         unsigned long long *sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned rank, size;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(size));
    uint64_t *bar = reinterpret_cast<uint64_t *>(smem);
    unsigned char *gather = smem + 128;          // size slices
    unsigned char *mine = gather + (size_t)rank * slice_bytes;
    for (int i = threadIdx.x; i < slice_bytes; i += blockDim.x) mine[i] = (unsigned char)(i + rank);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n"
                 ::: "memory");
    for (int it = 0; it < iters; ++it) {
        if (slice_bytes && bulk) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            if (threadIdx.x < size) {
                const unsigned src = smem_u32(mine);
                if (threadIdx.x != rank) {
                    unsigned dst, rbar;
                    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(dst) : "r"(src), "r"((unsigned)threadIdx.x));
                    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(rbar) : "r"(smem_u32(bar)), "r"((unsigned)threadIdx.x));
                    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes"
                                 " [%0], [%1], %2, [%3];\n" ::"r"(dst), "r"(src), "r"(slice_bytes), "r"(rbar) : "memory");
                } else {
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                                 ::"r"(smem_u32(bar)), "r"((size - 1) * slice_bytes) : "memory");
                }
            }
            unsigned done;
            do {
                asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                             " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done)
                             : "r"(smem_u32(bar)), "r"((unsigned)(it & 1)) : "memory");
            } while (!done);
        } else if (slice_bytes) {
            for (int e = threadIdx.x; e < slice_bytes / 16 * (int)size; e += blockDim.x) {
                const int peer = e / (slice_bytes / 16), off = (e % (slice_bytes / 16)) * 16;
                if (peer == (int)rank) continue;
                unsigned dst;
                asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(dst) : "r"(smem_u32(mine + off)), "r"((unsigned)peer));
                const uint4 v = *reinterpret_cast<const uint4 *>(mine + off);
                asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};\n"
                             ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
            }
        }
        // the bulk copies' peers must have read nothing of the next round's slice yet: a
        // barrier per round (what the design has after each all-gather's consumer)
        asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n"
                     ::: "memory");
    }
    if (threadIdx.x == 0) sink[blockIdx.x] = gather[(rank + 1) % size * slice_bytes];
}

static int cluster_part(unsigned long long *sink) {
    CK(cudaFuncSetAttribute(cluster_rounds, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CK(cudaFuncSetAttribute(cluster_rounds, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            128 + 16 * 768 * 2));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    printf("\n%-8s %-6s %-12s %12s %16s\n", "cluster", "mode", "slice bytes", "us / round",
           "clusters fit");
    const int iters = 2000;
    for (int C : {8, 16}) {
        for (int mode = 0; mode < 3; ++mode) {      // 0 barrier only, 1 stores, 2 bulk copies
            const int slice = mode ? 16 * 768 * 2 / C : 0;
            cudaLaunchConfig_t cfg = {};
            cudaLaunchAttribute attr[1];
            cfg.gridDim = dim3(C, 1, 1);
            cfg.blockDim = dim3(256, 1, 1);
            cfg.dynamicSmemBytes = 128 + 16 * 768 * 2;
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = C;
            attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
            cfg.attrs = attr;
            cfg.numAttrs = 1;
            int fit = 0;
            CK(cudaOccupancyMaxActiveClusters(&fit, cluster_rounds, &cfg));
            const float t = median_ms(a, b, [&] {
                return cudaLaunchKernelEx(&cfg, cluster_rounds, iters, slice, mode == 2 ? 1 : 0,
                                          sink);
            });
            if (t < 0) { printf("cluster of %d: launch failed\n", C); return 1; }
            printf("%-8d %-6s %-12d %12.3f %16d\n", C, mode == 0 ? "bar" : mode == 1 ? "store" : "bulk",
                   slice, 1e3 * t / iters, fit);
        }
    }
    return 0;
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
    CK(cudaFuncSetAttribute(ingress, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    printf("%-6s %-4s %-8s %-6s %10s %12s\n", "source", "N", "slot KB", "ring", "total GB/s", "per SM GB/s");
    const int Ns[] = {1, 8, 16, 32, 64, 132};
    // (slot bytes, copies in flight): 144-208 KB in flight per SM; the flow loop's ring is
    // 11 x 12 KB
    const int configs[][2] = {{12288, 12}, {16384, 13}, {32768, 5}, {53248, 4}, {69632, 3}};
    for (int src = 0; src < 2; ++src) {             // 0: HBM, 1: L2 (a 256 KB window per CTA)
        for (const auto &config : configs) {
            const int slot = config[0], ring = config[1];
            for (int N : Ns) {
                if (N > sms) continue;
                const size_t per = src == 0 ? std::min(total / N, (size_t)256 << 20) / slot * slot
                                            : (size_t)16 << 20;
                const size_t stride = src == 0 ? total / N / 4096 * 4096 : (size_t)256 << 10;
                const size_t window = src == 0 ? per : (size_t)256 << 10;
                const size_t smem = (size_t)ring * slot + ring * 8;
                const float t = median_ms(a, b, [&] {
                    ingress<<<N, 128, smem>>>(buf, stride, per, window, slot, ring, sink);
                    return cudaGetLastError();
                });
                if (t < 0) { printf("ingress N=%d: launch failed\n", N); return 1; }
                const double gbs = (double)per * N / (t * 1e-3) / 1e9;
                printf("%-6s %-4d %-8d %-6d %10.0f %12.1f\n", src ? "L2" : "HBM", N, slot / 1024,
                       ring, gbs, gbs / N);
            }
        }
    }
    return cluster_part(sink);
}
