"""Issue 21's next design step, measured before it is written: what one dependent GEMM phase
of the flow loop costs when its weights are copied into shared memory *before* the wait for
its input, against after it (what the Triton kernel does), in CUDA C++.

The fused flow-loop kernel (`runtime/fused_dit.py`) spends 2.6-7.0 us per phase against
0-1.3 us of HBM traffic (docs/decisions/fused-dit-kernel.md); in Triton the weights of a
pipelined loop cannot be started before a spin-wait. This probe is a persistent kernel of its
own (one block of 4 warps per output tile of 8 columns, D / 8 blocks, all resident) that
runs a chain of `--phases` dependent y = x W_p^T GEMMs (16 tokens x D, bf16, float32
accumulation, mma.sync m16n8k16) with a grid barrier between phases, every phase its own
weights (more than L2 holds), in three modes:

- `after`: wait for the phase's input, then copy the weight tile and the input into shared
  memory (cp.async) and multiply;
- `before`: the weight tile of the phase copied (cp.async, its own group) right after the
  block arrives at the barrier before it, then the wait, then the input;
- `barrier`: the grid barriers alone;
- `compute`: the barriers and the MMAs with their epilogue, nothing loaded after phase 0
  (`before` minus this: the activation's round trip through L2).

Then the same chain in one thread-block cluster per chain (C = 16 or 8 blocks, Hopper's
distributed shared memory): each block computes D / C output columns and writes them into
every block's copy of the next activation, one cluster barrier per phase, no global memory
in the exchange; modes `stream` (each phase's weights from HBM, prefetched a phase ahead
where two buffers fit: C = 16), `compute` (weights loaded once), `barrier`; and `stream` with
as many clusters at once as fit, each its own chain and weights (GB/s over all of them: what
a cluster's SMs can stream).

Per phase us = kernel time / phases (median of `--iters` launches, CUDA events). The
chain's output is checked against torch (bf16 per phase). CUDA only; the extension is built
here by torch.utils.cpp_extension (nvcc), ~1 min the first time:

    python3 benchmarks/probe_phase_latency.py --out $OUT/probe.json          (H200)
"""
from __future__ import annotations

import argparse
import statistics

CUDA_SRC = r'''
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#define ROWS 16
#define COLS 8            // output columns per block (one mma n-tile)
#define WARPS 4

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n"); }

__device__ __forceinline__ void arrive(unsigned *counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" :: "l"(counter) : "memory");
    }
}
__device__ __forceinline__ void wait_for(unsigned *counter, unsigned target) {
    if (threadIdx.x == 0) {
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(counter)
                         : "memory");
        } while (seen < target);
    }
    __syncthreads();
}

// One block: output columns n0..n0+7 of y (16 x D) = x (16 x D) W^T, W (D x D) row-major
// (row n = output column n). Each warp takes a quarter of K; the partials meet in smem.
__device__ __forceinline__ void mma_tile(const __nv_bfloat16 *xs, const __nv_bfloat16 *ws,
                                         float *red, __nv_bfloat16 *y, int n0, int D) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    const int kq = D / WARPS;
    for (int k0 = warp * kq; k0 < (warp + 1) * kq; k0 += 16) {
        const uint32_t *xa = reinterpret_cast<const uint32_t *>(xs);
        const uint32_t *wb = reinterpret_cast<const uint32_t *>(ws);
        uint32_t a0 = xa[(g * D + k0 + t * 2) / 2];
        uint32_t a1 = xa[((g + 8) * D + k0 + t * 2) / 2];
        uint32_t a2 = xa[(g * D + k0 + 8 + t * 2) / 2];
        uint32_t a3 = xa[((g + 8) * D + k0 + 8 + t * 2) / 2];
        uint32_t b0 = wb[(g * D + k0 + t * 2) / 2];
        uint32_t b1 = wb[(g * D + k0 + 8 + t * 2) / 2];
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    // c0, c1: row g, cols 2t, 2t+1; c2, c3: row g + 8
    float *r = red + warp * ROWS * COLS;
    r[g * COLS + 2 * t] = c[0];
    r[g * COLS + 2 * t + 1] = c[1];
    r[(g + 8) * COLS + 2 * t] = c[2];
    r[(g + 8) * COLS + 2 * t + 1] = c[3];
    __syncthreads();
    const int e = threadIdx.x;                  // 128 threads, 16 x 8 outputs
    const float s = red[e] + red[ROWS * COLS + e] + red[2 * ROWS * COLS + e]
                    + red[3 * ROWS * COLS + e];   // a fixed order: the same bits every run
    y[(e / COLS) * D + n0 + e % COLS] = __float2bfloat16(s);
}

__device__ __forceinline__ void copy_tile(__nv_bfloat16 *dst, const __nv_bfloat16 *src,
                                          int rows, int D, int row_stride) {
    const int chunks_per_row = D / 8;            // 16-byte chunks
    for (int i = threadIdx.x; i < rows * chunks_per_row; i += blockDim.x) {
        const int r = i / chunks_per_row, c = i % chunks_per_row;
        cp_async16(dst + r * D + c * 8, src + (size_t)r * row_stride + c * 8);
    }
}

// mode 0: after, 1: before, 2: barriers only, 3: compute only (no loads after phase 0)
__global__ void phase_chain(const __nv_bfloat16 *__restrict__ w, __nv_bfloat16 *act,
                            unsigned *counter, int phases, int D, int mode) {
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16 *xs = reinterpret_cast<__nv_bfloat16 *>(smem);            // 16 x D
    __nv_bfloat16 *ws = xs + ROWS * D;                                      // 8 x D
    float *red = reinterpret_cast<float *>(ws + COLS * D);                  // 4 x 16 x 8
    const int n0 = blockIdx.x * COLS;
    const unsigned n_blocks = gridDim.x;
    if (mode == 1) {                                   // phase 0's weights before its input
        copy_tile(ws, w + (size_t)n0 * D, COLS, D, D);
        cp_async_commit();
    }
    for (int p = 0; p < phases; ++p) {
        const __nv_bfloat16 *wp = w + (size_t)p * D * D + (size_t)n0 * D;
        const __nv_bfloat16 *x = act + (size_t)(p % 2) * ROWS * D;
        __nv_bfloat16 *y = act + (size_t)((p + 1) % 2) * ROWS * D;
        if (p > 0) wait_for(counter, p * n_blocks);    // phase p - 1 written by every block
        // after: both now; before: the input now (its weights are in flight); compute:
        // both once, at phase 0
        const bool load_weights = mode == 0 || (mode == 3 && p == 0);
        const bool load_input = mode == 0 || mode == 1 || (mode == 3 && p == 0);
        if (load_weights) copy_tile(ws, wp, COLS, D, D);
        if (load_input) {
            copy_tile(xs, x, ROWS, D, D);
            cp_async_commit();
            cp_async_wait_all();                       // this phase's weights and input
            __syncthreads();
        }
        if (mode != 2) mma_tile(xs, ws, red, y, n0, D);
        arrive(counter);
        if (mode == 1 && p + 1 < phases) {             // the next phase's weights, now
            __syncthreads();                           // everyone is done reading ws
            copy_tile(ws, wp + (size_t)D * D, COLS, D, D);
            cp_async_commit();
        }
    }
}

void launch_phase_chain(const void *w, void *act, void *counter, int phases, int D, int mode,
                        cudaStream_t stream) {
    const size_t smem = (ROWS + COLS) * D * 2 + WARPS * ROWS * COLS * 4;
    cudaFuncSetAttribute(phase_chain, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         (int)smem);
    phase_chain<<<D / COLS, WARPS * 32, smem, stream>>>(
        reinterpret_cast<const __nv_bfloat16 *>(w), reinterpret_cast<__nv_bfloat16 *>(act),
        reinterpret_cast<unsigned *>(counter), phases, D, mode);
}

// ---------------------------------------------------------------- one thread-block cluster
// G independent chains, one per cluster of C blocks (C = cluster size, up to 16 on Hopper
// with the non-portable attribute). Block r of a cluster computes output columns
// [r * D/C, (r+1) * D/C) of y = x W_p^T and writes them into EVERY block's copy of the next
// activation through distributed shared memory; one barrier.cluster per phase. Shared rows
// are padded by PAD halves so that the mma fragments' loads hit 32 different banks.
// mode 0: stream each phase's weights from HBM (prefetched one phase ahead when two weight
// buffers fit, else loaded after the barrier); 1: weights loaded once (compute + exchange
// only); 2: the cluster barriers alone.
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#define PAD 8
#define MAXT 12           // n-tiles of 8 columns per block: D / C <= 96

__device__ __forceinline__ void copy_rows(__nv_bfloat16 *dst, const __nv_bfloat16 *src,
                                          int rows, int D) {
    const int cpr = D / 8, S = D + PAD;
    for (int i = threadIdx.x; i < rows * cpr; i += blockDim.x) {
        const int r = i / cpr, c = i % cpr;
        cp_async16(dst + r * S + c * 8, src + (size_t)r * D + c * 8);
    }
}

static size_t cluster_smem(int D, int C, int nbuf) {
    const int S = D + PAD, cols = D / C;
    return (size_t)2 * ROWS * S * 2 + (size_t)nbuf * cols * S * 2
           + (size_t)WARPS * ROWS * cols * 4;
}

__global__ void cluster_chain(const __nv_bfloat16 *__restrict__ w,
                              const __nv_bfloat16 *__restrict__ x0, __nv_bfloat16 *out,
                              int phases, int D, int mode, int nbuf) {
    cg::cluster_group cluster = cg::this_cluster();
    const int C = (int)cluster.num_blocks();
    const int rank = (int)cluster.block_rank();
    const int chain = blockIdx.x / C;
    const int cols = D / C, S = D + PAD, ntiles = cols / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16 *xs = reinterpret_cast<__nv_bfloat16 *>(smem);     // 2 x ROWS x S
    __nv_bfloat16 *ws = xs + 2 * ROWS * S;                          // nbuf x cols x S
    float *red = reinterpret_cast<float *>(ws + nbuf * cols * S);   // WARPS x ROWS x cols
    const __nv_bfloat16 *wc = w + (size_t)chain * phases * D * D;
    const int n0 = rank * cols;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    copy_rows(xs, x0, ROWS, D);
    if (mode != 2) copy_rows(ws, wc + (size_t)n0 * D, cols, D);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    cluster.sync();                            // every block of the cluster is running
    for (int p = 0; p < phases; ++p) {
        if (mode == 2) {
            cluster.sync();
            continue;
        }
        const __nv_bfloat16 *x = xs + (p % 2) * ROWS * S;
        __nv_bfloat16 *y = xs + ((p + 1) % 2) * ROWS * S;
        if (mode == 0 && p > 0) {
            if (nbuf == 1) {
                copy_rows(ws, wc + (size_t)p * D * D + (size_t)n0 * D, cols, D);
                cp_async_commit();
            }
            cp_async_wait_all();               // phase p's weights (issued a phase ago)
            __syncthreads();
        }
        if (mode == 0 && nbuf == 2 && p + 1 < phases) {
            copy_rows(ws + ((p + 1) % 2) * cols * S,
                      wc + (size_t)(p + 1) * D * D + (size_t)n0 * D, cols, D);
            cp_async_commit();
        }
        const __nv_bfloat16 *wt = ws + ((mode == 0 && nbuf == 2) ? (p % 2) : 0) * cols * S;
        float c[MAXT][4];
#pragma unroll
        for (int j = 0; j < MAXT; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
        const int kq = D / WARPS;
        for (int k0 = warp * kq; k0 < (warp + 1) * kq; k0 += 16) {
            const uint32_t a0 = *reinterpret_cast<const uint32_t *>(x + g * S + k0 + t * 2);
            const uint32_t a1 = *reinterpret_cast<const uint32_t *>(x + (g + 8) * S + k0 + t * 2);
            const uint32_t a2 = *reinterpret_cast<const uint32_t *>(x + g * S + k0 + 8 + t * 2);
            const uint32_t a3 =
                *reinterpret_cast<const uint32_t *>(x + (g + 8) * S + k0 + 8 + t * 2);
#pragma unroll
            for (int j = 0; j < MAXT; ++j) {
                if (j < ntiles) {
                    const __nv_bfloat16 *wr = wt + (j * 8 + g) * S + k0 + t * 2;
                    const uint32_t b0 = *reinterpret_cast<const uint32_t *>(wr);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t *>(wr + 8);
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                        : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
                }
            }
        }
        float *r = red + warp * ROWS * cols;
#pragma unroll
        for (int j = 0; j < MAXT; ++j) {
            if (j < ntiles) {
                r[g * cols + j * 8 + 2 * t] = c[j][0];
                r[g * cols + j * 8 + 2 * t + 1] = c[j][1];
                r[(g + 8) * cols + j * 8 + 2 * t] = c[j][2];
                r[(g + 8) * cols + j * 8 + 2 * t + 1] = c[j][3];
            }
        }
        __syncthreads();
        const int pairs = ROWS * cols / 2;
        for (int e = threadIdx.x; e < pairs; e += blockDim.x) {
            const int row = e / (cols / 2), col = 2 * (e % (cols / 2));
            float s0 = 0.f, s1 = 0.f;
            for (int q = 0; q < WARPS; ++q) {   // a fixed order: the same bits every run
                s0 += red[(q * ROWS + row) * cols + col];
                s1 += red[(q * ROWS + row) * cols + col + 1];
            }
            __nv_bfloat162 v = __floats2bfloat162_rn(s0, s1);
            for (int dst = 0; dst < C; ++dst) {
                __nv_bfloat16 *remote = cluster.map_shared_rank(y, dst);
                *reinterpret_cast<__nv_bfloat162 *>(remote + row * S + n0 + col) = v;
            }
        }
        cluster.sync();                        // y complete in every block
    }
    if (rank == 0 && mode != 2) {
        const __nv_bfloat16 *x = xs + (phases % 2) * ROWS * S;
        for (int i = threadIdx.x; i < ROWS * D; i += blockDim.x)
            out[(size_t)chain * ROWS * D + i] = x[(i / D) * S + i % D];
    }
    cluster.sync();                            // no block exits while others write into it
}

static cudaLaunchConfig_t cluster_config(int D, int C, int G, size_t smem, cudaStream_t stream,
                                         cudaLaunchAttribute *attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(C * G, 1, 1);
    cfg.blockDim = dim3(WARPS * 32, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

// returns the number of weight buffers used (1 or 2), or -(cuda error) on failure
int launch_cluster_chain(const void *w, const void *x0, void *out, int phases, int D, int mode,
                         int C, int G, cudaStream_t stream) {
    if (D % C || (D / C) % 8 || D / C > 8 * MAXT || D % (16 * WARPS)) return -1000;
    int optin = 0, dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    const int nbuf = cluster_smem(D, C, 2) <= (size_t)optin ? 2 : 1;
    const size_t smem = cluster_smem(D, C, nbuf);
    if (smem > (size_t)optin) return -1001;
    cudaFuncSetAttribute(cluster_chain, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaFuncSetAttribute(cluster_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = cluster_config(D, C, G, smem, stream, attr);
    cudaError_t err = cudaLaunchKernelEx(
        &cfg, cluster_chain, reinterpret_cast<const __nv_bfloat16 *>(w),
        reinterpret_cast<const __nv_bfloat16 *>(x0), reinterpret_cast<__nv_bfloat16 *>(out),
        phases, D, mode, nbuf);
    return err == cudaSuccess ? nbuf : -(int)err;
}

// how many clusters of C blocks (with this kernel's shared memory) can be resident at once
int max_active_clusters(int D, int C) {
    int optin = 0, dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    const int nbuf = cluster_smem(D, C, 2) <= (size_t)optin ? 2 : 1;
    const size_t smem = cluster_smem(D, C, nbuf);
    cudaFuncSetAttribute(cluster_chain, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaFuncSetAttribute(cluster_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = cluster_config(D, C, 1, smem, 0, attr);
    if (cudaOccupancyMaxActiveClusters(&n, cluster_chain, &cfg) != cudaSuccess) return -1;
    return n;
}
'''

CPP_SRC = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
void launch_phase_chain(const void *w, void *act, void *counter, int phases, int D, int mode,
                        cudaStream_t stream);
void run(torch::Tensor w, torch::Tensor act, torch::Tensor counter, int64_t phases,
         int64_t mode) {
    TORCH_CHECK(w.is_cuda() && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
    TORCH_CHECK(act.size(0) == 2 && act.size(1) == 16 && act.is_contiguous());
    const int D = act.size(2);
    TORCH_CHECK(D % 64 == 0 && w.size(0) >= phases && w.size(1) == D && w.size(2) == D);
    counter.zero_();
    launch_phase_chain(w.data_ptr(), act.data_ptr(), counter.data_ptr(), phases, D, mode,
                       c10::cuda::getCurrentCUDAStream());
}
int launch_cluster_chain(const void *w, const void *x0, void *out, int phases, int D, int mode,
                         int C, int G, cudaStream_t stream);
int max_active_clusters(int D, int C);
int64_t run_cluster(torch::Tensor w, torch::Tensor x0, torch::Tensor out, int64_t phases,
                    int64_t mode, int64_t C, int64_t G) {
    TORCH_CHECK(w.is_cuda() && w.scalar_type() == torch::kBFloat16 && w.is_contiguous());
    const int D = x0.size(1);
    TORCH_CHECK(x0.size(0) == 16 && x0.is_contiguous() && out.is_contiguous());
    TORCH_CHECK(w.size(0) >= phases * G && w.size(1) == D && w.size(2) == D);
    TORCH_CHECK(out.numel() >= G * 16 * D);
    const int r = launch_cluster_chain(w.data_ptr(), x0.data_ptr(), out.data_ptr(), phases, D,
                                       mode, C, G, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(r != -1000, "cluster_chain: D / C must be a multiple of 8 and <= 96");
    TORCH_CHECK(r != -1001, "cluster_chain: too much shared memory for one block");
    TORCH_CHECK(r > 0, "cluster_chain launch: ", cudaGetErrorString((cudaError_t)(-r)));
    return r;
}
int64_t max_clusters(int64_t D, int64_t C) { return max_active_clusters(D, C); }
'''

MODES = {'after': 0, 'before': 1, 'barrier': 2, 'compute': 3}
CLUSTER_MODES = {'stream': 0, 'compute': 1, 'barrier': 2}


def _median_ms(torch, launch, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters + 3):
        start.record()
        launch()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples[3:])


def cluster_rows(ext, torch, args) -> list[dict]:
    """The cluster kernel: per cluster size C (16, 8), one chain (G = 1) in each mode and as
    many chains as fit at once (G = max), each chain with weights of its own."""
    d, dev = args.dim, torch.device('cuda')
    sizes = {c: int(ext.max_clusters(d, c)) for c in (16, 8)}
    print(f'clusters resident at once: {sizes}', flush=True)
    chains = max([1] + list(sizes.values()))
    w = torch.randn(chains * args.phases, d, d, device=dev, dtype=torch.bfloat16) * d ** -0.5
    x0 = torch.randn(16, d, device=dev).to(torch.bfloat16)
    out = torch.zeros(chains, 16, d, device=dev, dtype=torch.bfloat16)
    rows = []
    for c, most in sizes.items():
        if most < 1:
            rows.append({'mode': f'C{c} not launchable', 'ms': float('nan'),
                         'us_per_phase': float('nan'), 'rel_err': None})
            continue
        # correctness: a short chain in two clusters (or one), each with its own weights
        check, g = min(args.phases, 8), min(2, most)
        out.zero_()
        nbuf = int(ext.run_cluster(w, x0, out, check, 0, c, g))
        torch.cuda.synchronize()
        err = 0.0
        for chain in range(g):
            ref = x0
            for p in range(check):
                ref = (ref.float() @ w[chain * check + p].float().T).to(torch.bfloat16)
            err = max(err, float((out[chain].float() - ref.float()).abs().max()
                                 / ref.float().abs().max()))
        configs = [(name, 1) for name in CLUSTER_MODES] + ([('stream', most)] if most > 1 else [])
        for name, g in configs:
            ms = _median_ms(torch, lambda: ext.run_cluster(w, x0, out, args.phases,
                                                            CLUSTER_MODES[name], c, g),
                            args.iters)
            rows.append({'mode': f'C{c}xG{g} {name}', 'cluster': c, 'chains': g,
                         'weight_buffers': nbuf, 'ms': ms,
                         'us_per_phase': 1e3 * ms / args.phases,
                         'rel_err': err if name == 'stream' and g == 1 else None})
    return rows


def main(argv=None) -> int:
    import torch
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--dim', type=int, default=768, help='D (the action expert width)')
    parser.add_argument('--phases', type=int, default=720,
                        help='dependent phases per launch (distinct weights: 720 x 768^2 '
                             'bf16 = 849 MB, far beyond L2)')
    parser.add_argument('--iters', type=int, default=50)
    parser.add_argument('--out', default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print('needs a CUDA device')
        return 2
    from torch.utils.cpp_extension import load_inline
    ext = load_inline('probe_phase_latency', cpp_sources=CPP_SRC, cuda_sources=CUDA_SRC,
                      functions=['run', 'run_cluster', 'max_clusters'], extra_cuda_cflags=['-O3', '-arch=sm_90a'],
                      verbose=False)
    dev, d = torch.device('cuda'), args.dim
    torch.manual_seed(0)
    w = (torch.randn(args.phases, d, d, device=dev) * d ** -0.5).to(torch.bfloat16)
    x0 = torch.randn(16, d, device=dev).to(torch.bfloat16)
    act = torch.zeros(2, 16, d, device=dev, dtype=torch.bfloat16)
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    # correctness on a short chain, against torch with the same per-phase bf16 rounding
    check = min(args.phases, 8)
    errors = {}
    for name in ('after', 'before'):
        act[0] = x0
        ext.run(w, act, counter, check, MODES[name])
        ref = x0
        for p in range(check):
            ref = (ref.float() @ w[p].float().T).to(torch.bfloat16)
        got = act[check % 2].float()
        errors[name] = float((got - ref.float()).abs().max() / ref.float().abs().max())
    rows = []
    for name, mode in MODES.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(args.iters + 3):
            act[0] = x0
            start.record()
            ext.run(w, act, counter, args.phases, mode)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        samples = samples[3:]
        ms = statistics.median(samples)
        rows.append({'mode': name, 'ms': ms, 'us_per_phase': 1e3 * ms / args.phases,
                     'rel_err': errors.get(name)})
    rows += cluster_rows(ext, torch, args)
    bytes_per_phase = d * d * 2
    print(f'\n{args.phases} dependent phases of 16 x {d} @ {d} x {d} (bf16), {d // 8} blocks; '
          f'{torch.cuda.get_device_name()}')
    print(f"{'mode':22s} {'ms':>8s} {'us/phase':>9s} {'GB/s':>8s} {'rel err':>9s}")
    for r in rows:
        streams = r['mode'] in ('after', 'before') or r['mode'].endswith('stream')
        gbs = r.get('chains', 1) * bytes_per_phase / (r['us_per_phase'] * 1e-6) / 1e9 \
            if streams else 0
        err = '' if r['rel_err'] is None else f"{r['rel_err']:.2e}"
        print(f"{r['mode']:22s} {r['ms']:8.3f} {r['us_per_phase']:9.2f} {gbs:8.0f} {err:>9s}")
    print('cluster rows: C<size>xG<chains>; GB/s over all chains; a chain of phases per '
          'cluster, its activation exchanged through distributed shared memory')
    if args.out:
        import common
        common.write_json(args.out, {**common.provenance(), 'dim': d, 'phases': args.phases,
                                     'rows': rows})
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
