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
        if (mode == 0) {
            copy_tile(ws, wp, COLS, D, D);
            copy_tile(xs, x, ROWS, D, D);
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
            mma_tile(xs, ws, red, y, n0, D);
        } else if (mode == 1) {
            copy_tile(xs, x, ROWS, D, D);
            cp_async_commit();
            cp_async_wait_all();                       // this phase's weights and input
            __syncthreads();
            mma_tile(xs, ws, red, y, n0, D);
        } else if (mode == 3) {                        // loads once, then compute only
            if (p == 0) {
                copy_tile(ws, wp, COLS, D, D);
                copy_tile(xs, x, ROWS, D, D);
                cp_async_commit();
                cp_async_wait_all();
                __syncthreads();
            }
            mma_tile(xs, ws, red, y, n0, D);
        }
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
'''

MODES = {'after': 0, 'before': 1, 'barrier': 2, 'compute': 3}


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
                      functions=['run'], extra_cuda_cflags=['-O3', '-arch=sm_90a'],
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
    bytes_per_phase = d * d * 2
    print(f'\n{args.phases} dependent phases of 16 x {d} @ {d} x {d} (bf16), {d // 8} blocks; '
          f'{torch.cuda.get_device_name()}')
    print(f"{'mode':10s} {'ms':>8s} {'us/phase':>9s} {'GB/s':>8s} {'rel err':>9s}")
    for r in rows:
        gbs = bytes_per_phase / (r['us_per_phase'] * 1e-6) / 1e9 if r['mode'] in ('after', 'before') else 0
        err = '' if r['rel_err'] is None else f"{r['rel_err']:.2e}"
        print(f"{r['mode']:10s} {r['ms']:8.3f} {r['us_per_phase']:9.2f} {gbs:8.0f} {err:>9s}")
    if args.out:
        import common
        common.write_json(args.out, {**common.provenance(), 'dim': d, 'phases': args.phases,
                                     'rows': rows})
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
