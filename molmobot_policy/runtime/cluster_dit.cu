// One flow step of the action expert's DiT blocks as one kernel of thread-block clusters
// (CUDA C++, sm_90). The design and its reasons: molmobot_policy/runtime/cluster_dit.py.
//
// Grid: H clusters of R = 8 CTAs, cluster h = attention head h, CTA r = rank in the cluster.
// Every cluster keeps its own copy of the float32 residual stream x (T <= 16 rows x D), split
// by columns over its CTAs (CTA r holds columns [r * CW, (r + 1) * CW)); all clusters compute
// the same bits of x (same inputs, same summation order). Per block, CTA (h, r):
//   LN1: xm = x * (1 + scale1) and the row sums of its columns to every CTA of the cluster
//        (one bulk copy per peer into its distributed shared memory, awaited on an mbarrier);
//   q|k|v of head h: 4 or 5 of the head's 36 n-tiles of 8 columns (LayerNorm in the epilogue:
//        rstd * (xm W^T - mean u) + v + b, u = W (1 + scale), v = W shift) -> every CTA;
//   self-attention of head h (every CTA, redundantly, float32);
//   proj: the head's partial o_h Wo[:, head]^T for output columns [r CW, (r+1) CW) -> global,
//        each float with the block's parity in its lowest bit;
//   exchange: CTA (h, r) polls the 8 head partials of its columns (from the CTAs (*, r)) until
//        each value carries the block's parity, sums them in head order,
//        x += gate1 * (sum + bias);
//   LN2, cross q (1 or 2 n-tiles), cross-attention of head h over this CTA's eighth of the
//        keys (flash-decoding partials), combined over the cluster (each CTA's 12 dims from
//        the peers' st.async stores, awaited on its mbarrier); proj partial, exchange;
//   LN3, fc1 + GELU: 48 of the cluster's 384 hidden units -> every CTA; fc2: the cluster's
//        partial over its 384 hidden units for columns [r CW, (r+1) CW) -> global; exchange.
// Every broadcast inside the cluster goes by bulk copy or st.async into the peers' shared
// memory and is awaited on the receiver's mbarrier (one phase per block): no cluster barrier.
// Weights and cached K/V stream through a ring of shared-memory slots by bulk asynchronous
// copies (TMA) issued RING slots ahead of their use: weights never depend on activations.
// Reductions are in fixed order and no float atomics are used: replays give the same bits.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace cg = cooperative_groups;
typedef __nv_bfloat16 bf16;

namespace cdit {

constexpr int D = 768, H = 8, HD = 96, F = 3072, R = 8;
constexpr int CW = D / R;                 // residual columns per CTA (96)
constexpr int FH = F / H;                 // hidden units per cluster (384)
constexpr int FW = FH / R;                // per CTA (48)
constexpr int MR = 16;                    // token rows (one mma m-tile): T <= 16
constexpr int THREADS = 256, WARPS = 8;
constexpr int SLOT = 12288, SLOT_E = SLOT / 2;
constexpr int WSLOTS = 23;                // weight slots per (block, head, rank)
constexpr int GROUP_E = 16 * HD;          // elements of one 16-key group of K (or V)
constexpr int GROUPS_PER_SLOT = SLOT_E / GROUP_E;   // 4
constexpr int MAX_KV_SLOTS = 4;
constexpr int KEYMAX = MAX_KV_SLOTS * GROUPS_PER_SLOT * 16;   // 256 keys per CTA
constexpr int QKV_NT = 3 * HD / 8;        // 36 n-tiles of a head's q|k|v
constexpr int Q2_NT = HD / 8;             // 12
constexpr int LDB = CW + 8;               // row stride of a rank's block of the LayerNorm input
constexpr int XB_ROWS_BYTES = MR * LDB * 2;                // its bf16 rows
constexpr int XB_BYTES = XB_ROWS_BYTES + MR * 8;           // + its float2 row sums: one copy
constexpr int LDQKV = 3 * HD + 8, LDH = HD + 8, LDA = FH + 8, LDP = KEYMAX + 8;
constexpr int OD = HD / R;                // head dims whose cross-attention combine a CTA owns (12)
constexpr int LDS = 24;                   // self-attention probabilities (bf16 16 x 16, padded)
constexpr int RING = 11;

// the epilogue operands of one block for this CTA (byte offsets in one of two buffers,
// copied a block ahead by cp.async): scale / gate of the three sublayers, the residual
// biases, and u, v, bias of its q|k|v, cross q and fc1 columns
constexpr int OP_SC1 = 0, OP_G1 = 192, OP_SC2 = 384, OP_G2 = 576, OP_SC3 = 768, OP_G3 = 960;
constexpr int OP_BO1 = 1152, OP_BO2 = 1344, OP_B2 = 1536;
constexpr int OP_QU = 1728, OP_QV = 1888, OP_QB = 2048;      // 5 n-tiles: 40 f32, 40 f32, 40 bf16
constexpr int OP_CU = 2128, OP_CV = 2192, OP_CB = 2256;      // 2 n-tiles: 16, 16, 16
constexpr int OP_FU = 2288, OP_FV = 2480, OP_FB = 2672;      // 48, 48, 48
constexpr int OP_BYTES = 2768, OP_CHUNKS = OP_BYTES / 16;    // 173 copies of 16 bytes

// shared memory, byte offsets
constexpr int OFF_RING = 0;
constexpr int OFF_XA = OFF_RING + RING * SLOT;          // R blocks of XB_BYTES (see ln_broadcast)
constexpr int OFF_XS = OFF_XA + R * XB_BYTES;           // float MR x CW
constexpr int OFF_QKV = OFF_XS + MR * CW * 4;           // bf16 MR x LDQKV
constexpr int OFF_OH = OFF_QKV + MR * LDQKV * 2;        // bf16 MR x LDH
constexpr int OFF_Q2 = OFF_OH + MR * LDH * 2;           // bf16 MR x LDH
constexpr int OFF_IN = OFF_Q2 + MR * LDH * 2;           // float R x MR x OD: partials of my dims
constexpr int OFF_ML = OFF_IN + R * MR * OD * 4;        // float2 R x MR: their row max and sum
constexpr int OFF_AH = OFF_ML + R * MR * 8;             // bf16 MR x LDA; probabilities alias
constexpr int OFF_RED = OFF_AH + MR * LDA * 2;          // float, RED_BYTES
constexpr int RED_BYTES = 12288;
constexpr int OFF_MRS = OFF_RED + RED_BYTES;            // float 2 x MR
constexpr int OFF_OPS = OFF_MRS + 2 * MR * 4;           // 2 x OP_BYTES
constexpr int OFF_MB = OFF_OPS + 2 * OP_BYTES;          // bf16 KEYMAX: this CTA's mask bias
constexpr int OFF_BARS = OFF_MB + KEYMAX * 2;           // uint64 x RING, then the LN, combine,
constexpr int SMEM_BYTES = OFF_BARS + (RING + 6) * 8;   // o_h, q|k|v, cross q and fc1 barriers
// bytes the cross-attention's combine barrier awaits from the R - 1 peers (row max and sum of
// each row, the partials of this CTA's OD dims), and the o_h barrier (their combined dims)
constexpr unsigned COMBINE_TX = (R - 1) * (MR * 8 + MR * OD * 4);
constexpr unsigned OH_TX = (R - 1) * MR * OD * 2;
// and the GEMM outputs broadcast to every CTA: all but this CTA's n-tiles (256 bytes each)
__host__ __device__ constexpr unsigned broadcast_tx(int n_tiles, int mine) {
    return (unsigned)(n_tiles - mine) * MR * 8 * 2;
}
static_assert(MR * LDP * 2 <= MR * LDA * 2, "probabilities must fit in ah");
static_assert(XB_ROWS_BYTES % 16 == 0 && XB_BYTES % 16 == 0, "bulk copies of 16-byte units");
static_assert(OFF_XA % 128 == 0 && OFF_RED % 16 == 0 && OFF_OPS % 16 == 0 && OFF_BARS % 8 == 0,
              "alignment");
static_assert(SMEM_BYTES <= 232448, "shared memory");

struct Params {
    const bf16 *x_in;       // (T, D) the step's input tokens
    bf16 *out;              // (T, D) its output
    const bf16 *mod;        // (nb, 9, D): shift1 scale1 gate1 shift2 scale2 gate2 shift3 ...
    const float *tables;    // (2, nb, 4D + F): u, v of the LayerNorm-fed GEMMs
    const bf16 *wp;         // (nb, H, R, WSLOTS * SLOT_E) packed weights
    const bf16 *bq1, *bkv1, *bo1, *bq2, *bo2, *b1, *b2;
    const bf16 *kp, *vp;    // (nb, H, S * HD) packed cross-attention K / V
    const bf16 *mask_bias;  // (S,) additive
    float *part;            // (3, H, MR, D) head partials of the three exchanges, each float's
                            // lowest bit the parity of its block (b + 1) & 1; zero at launch
    long long *trace;       // null, or (H * R, nb, TRACE_POINTS) clock64 stamps (benchmarks)
    int T, S, nb, nkv, prefetch, mode;   // mode bits (benchmarks): 1 no streaming, 2 no exchange
                                         // waits, 4 copies issued empty
    float eps, sm_scale;
    // the whole flow step around the blocks (xt_in null: the blocks alone, x_in -> out): the
    // tokens embedded from x_t, and after the blocks the final layer and the Euler update
    const float *xt_in;     // (T, A) x_t, float32
    float *xt_out;          // (T, A) x_t + dt * velocity, float32
    const bf16 *w_emb, *b_emb, *pos;     // action_embed (D, A) and (D); action_pos_embed (T, D)
    const bf16 *w_fin, *b_fin;           // the final linear (A, D) and (A)
    const bf16 *mod_fin;    // (2, D): the final layer's shift, scale
    const float *tab_fin;   // (2, A): u = W_fin (1 + scale), v = W_fin shift
    int A;                  // action_dim <= 16
    float dt;               // 1 / flow steps
};
constexpr int TRACE_POINTS = 24;

__device__ __forceinline__ unsigned smem_u32(const void *p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
                 "r"(bytes) : "memory");
}
// one try of a wait for the phase of `parity`: acquiring at CTA scope (copies from global
// memory), or at cluster scope (what peers stored with st.async before completing it)
template <bool CLUSTER>
__device__ __forceinline__ bool mbar_try(uint64_t *bar, unsigned parity) {
    unsigned done;
    if (CLUSTER)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64"
                     " p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    else
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
    while (!mbar_try<false>(bar, parity)) {
    }
}
__device__ __forceinline__ void mbar_wait_cluster(uint64_t *bar, unsigned parity) {
    while (!mbar_try<true>(bar, parity)) {
    }
}
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes,
                                          uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes),
                 "r"(smem_u32(bar)) : "memory");
}
// this CTA's shared-memory address addr as the same offset in the shared memory of CTA rank
__device__ __forceinline__ unsigned mapa(unsigned addr, unsigned rank) {
    unsigned out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
    return out;
}
// bytes from this CTA's shared memory to the same offset in CTA rank's, completing on that CTA's
// mbarrier bar (the same offset as ours)
__device__ __forceinline__ void bulk_copy_to_peer(const void *src, unsigned bytes, uint64_t *bar,
                                                  unsigned rank) {
    const unsigned s = smem_u32(src);
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];\n" ::"r"(mapa(s, rank)), "r"(s), "r"(bytes),
                 "r"(mapa(smem_u32(bar), rank)) : "memory");
}
// 4 or 8 bytes into the same offset of CTA rank's shared memory, completing on that CTA's
// barrier bar (the same offset as ours): the reader waits for the bytes, not for a cluster
// barrier
__device__ __forceinline__ void st_async(void *dst, uint32_t v, uint64_t *bar, unsigned rank) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n"
                 ::"r"(mapa(smem_u32(dst), rank)), "r"(v), "r"(mapa(smem_u32(bar), rank))
                 : "memory");
}
__device__ __forceinline__ void st_async(void *dst, float a, float b, uint64_t *bar,
                                         unsigned rank) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2},"
                 " [%3];\n" ::"r"(mapa(smem_u32(dst), rank)), "r"(__float_as_uint(a)),
                 "r"(__float_as_uint(b)), "r"(mapa(smem_u32(bar), rank)) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void *src, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
// a head partial's value pair with the parity bit par in the lowest bit of each float (a
// relative change of at most 2^-23), stored with one 8-byte volatile store: its readers poll it
__device__ __forceinline__ void store_flagged(float *dst, float a0, float a1, unsigned par) {
    const unsigned u0 = (__float_as_uint(a0) & ~1u) | par, u1 = (__float_as_uint(a1) & ~1u) | par;
    asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};\n" ::"l"(dst), "r"(u0), "r"(u1)
                 : "memory");
}
__device__ __forceinline__ uint4 ld_volatile4(const float *src) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src) : "memory");
    return v;
}
// all four floats carry parity par (the block's partial has landed, not the block before's)
__device__ __forceinline__ bool carries(uint4 v, unsigned par) {
    return par ? (v.x & v.y & v.z & v.w & 1u) != 0 : ((v.x | v.y | v.z | v.w) & 1u) == 0;
}
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A fragment of rows [0, 16), k [k0, k0 + 16) of a row-major bf16 matrix in shared memory
__device__ __forceinline__ void load_a(uint32_t a[4], const bf16 *A, int ld, int k0, int g,
                                       int t) {
    const bf16 *p = A + g * ld + k0 + 2 * t;
    a[0] = *reinterpret_cast<const uint32_t *>(p);
    a[1] = *reinterpret_cast<const uint32_t *>(p + 8 * ld);
    a[2] = *reinterpret_cast<const uint32_t *>(p + 8);
    a[3] = *reinterpret_cast<const uint32_t *>(p + 8 * ld + 8);
}

// the same from the LayerNorm input: R blocks of MR x LDB (rank j holds k [j CW, (j + 1) CW)); a
// k-step of 16 never straddles two blocks (CW = 96)
__device__ __forceinline__ void load_a_blocked(uint32_t a[4], const bf16 *A, int k0, int g, int t) {
    const int blk = k0 / CW;
    load_a(a, A + blk * (XB_BYTES / 2), LDB, k0 - blk * CW, g, t);
}

// the per-CTA stream: items 0 .. nb * ipb - 1, item i in ring slot i % RING
struct Stream {
    const Params *p;
    int h, r, ipb, total, g0, gr, ntv, ntv2;
    __device__ void src(int item, const bf16 *&ptr, unsigned &bytes) const {
        const int b = item / ipb, l = item % ipb, nkv = p->nkv;
        if (l < 9 || l >= 9 + 2 * nkv) {
            const int w = l < 9 ? l : l - 2 * nkv;
            ptr = p->wp + ((size_t)(b * H + h) * R + r) * (WSLOTS * SLOT_E) + (size_t)w * SLOT_E;
            if (w < 5) bytes = w < ntv ? SLOT : 0;
            else if (w == 6 || w == 10) bytes = SLOT / 2;      // the proj's 1.5 slots
            else if (w == 7 || w == 8) bytes = w - 7 < ntv2 ? SLOT : 0;
            else bytes = SLOT;
        } else {
            int q = l - 9;
            const bf16 *base = p->kp;
            if (q >= nkv) { q -= nkv; base = p->vp; }
            const int n = max(0, min(GROUPS_PER_SLOT, gr - q * GROUPS_PER_SLOT));
            ptr = base + (size_t)(b * H + h) * p->S * HD
                  + (size_t)(g0 + q * GROUPS_PER_SLOT) * GROUP_E;
            bytes = n * GROUP_E * 2;
        }
    }
};

struct Ring {
    unsigned char *base;
    uint64_t *bars;
    bool on;                // false: nothing streams (benchmarks: the rest of the kernel alone)
    __device__ const unsigned char *ptr(int item) const { return base + (item % RING) * SLOT; }
    __device__ void wait(int item) const {
        if (on) mbar_wait(bars + item % RING, (item / RING) & 1);
    }
};

// warp 0 (all lanes): issues the items up to (not including) `upto`, one per lane, each into
// its slot, and an L2 prefetch of the item `prefetch` ahead of it
__device__ __forceinline__ void issue_upto(const Stream &st, const Ring &ring, int &issued,
                                           int upto) {
    upto = min(upto, st.total);
    if (issued >= upto) return;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    for (int i = issued + (int)(threadIdx.x & 31); i < upto; i += 32) {
        const bf16 *src;
        unsigned bytes;
        st.src(i, src, bytes);
        uint64_t *bar = ring.bars + i % RING;
        if (st.p->mode & 4) bytes = 0;          // benchmarks: the issue without the copies
        mbar_expect_tx(bar, bytes);
        if (bytes) bulk_copy(ring.base + (i % RING) * SLOT, src, bytes, bar);
        const int ahead = i + st.p->prefetch;
        if (st.p->prefetch > 0 && ahead < st.total) {
            st.src(ahead, src, bytes);
            if (bytes) prefetch_l2(src, bytes);
        }
    }
    issued = upto;
}

// warp w issues the items up to `upto`; every thread advances its count of issued items
__device__ __forceinline__ void issue_by(int w, const Stream &st, const Ring &ring, int &issued,
                                         int upto) {
    if ((int)(threadIdx.x / 32) == w) {
        int mine = issued;
        issue_upto(st, ring, mine, upto);
    }
    issued = max(issued, min(upto, st.total));
}

__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}

// block b's epilogue operands of CTA (h, r) into `ops` (one cp.async group, every thread)
__device__ __forceinline__ void load_ops(const Params &p, int b, int h, int r, int j0, int ntv,
                                         int q0, int ntv2, unsigned char *ops) {
    const int c = threadIdx.x;
    if (b < p.nb && c < OP_CHUNKS) {
        const size_t tw = 4 * D + F;
        const float *u = p.tables + (size_t)b * tw, *v = p.tables + (size_t)(p.nb + b) * tw;
        const void *src = nullptr;
        int dst = 0;
        if (c < 72) {                       // scale1 gate1 scale2 gate2 scale3 gate3
            const int which = c / 12, k = c % 12;
            const int row = 1 + which + which / 2;                  // 1 2 4 5 7 8
            src = p.mod + ((size_t)b * 9 + row) * D + r * CW + k * 8;
            dst = which * 192 + k * 16;
        } else if (c < 108) {               // bo1, bo2 (the context's out_bias), b2
            const int which = (c - 72) / 12, k = (c - 72) % 12;
            const bf16 *bias = which == 0 ? p.bo1 : which == 1 ? p.bo2 : p.b2;
            src = bias + (size_t)b * D + r * CW + k * 8;
            dst = OP_BO1 + which * 192 + k * 16;
        } else if (c < 133) {               // q|k|v n-tiles: u (2 chunks), v (2), bias (1)
            const int i = (c - 108) / 5, kind = (c - 108) % 5;
            if (i < ntv) {
                const int jj = j0 + i, part = jj / Q2_NT, w = (jj % Q2_NT) * 8;
                const int n = part * D + h * HD + w;
                if (kind < 2) { src = u + n + kind * 4; dst = OP_QU + i * 32 + kind * 16; }
                else if (kind < 4) {
                    src = v + n + (kind - 2) * 4;
                    dst = OP_QV + i * 32 + (kind - 2) * 16;
                }
                else {
                    src = part == 0 ? p.bq1 + (size_t)b * D + h * HD + w
                                    : p.bkv1 + (size_t)b * 2 * D + (part - 1) * D + h * HD + w;
                    dst = OP_QB + i * 16;
                }
            }
        } else if (c < 143) {               // cross q n-tiles
            const int i = (c - 133) / 5, kind = (c - 133) % 5;
            if (i < ntv2) {
                const int w = (q0 + i) * 8, n = 3 * D + h * HD + w;
                if (kind < 2) { src = u + n + kind * 4; dst = OP_CU + i * 32 + kind * 16; }
                else if (kind < 4) {
                    src = v + n + (kind - 2) * 4;
                    dst = OP_CV + i * 32 + (kind - 2) * 16;
                }
                else { src = p.bq2 + (size_t)b * D + h * HD + w; dst = OP_CB + i * 16; }
            }
        } else {                            // fc1: 48 hidden units
            const int q = c - 143, hid = h * FH + r * FW;
            if (q < 12) { src = u + 4 * D + hid + q * 4; dst = OP_FU + q * 16; }
            else if (q < 24) { src = v + 4 * D + hid + (q - 12) * 4; dst = OP_FV + (q - 12) * 16; }
            else { src = p.b1 + (size_t)b * F + hid + (q - 24) * 8; dst = OP_FB + (q - 24) * 16; }
        }
        if (src) cp_async16(ops + dst, src);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// y = A (MR x KS*16, shared, row stride lda; BLK: the LayerNorm input's blocks) @ W^T over NT n-tiles of 8 (ntv of them valid),
// W's B fragments packed (n-tile, k-step, lane, 4 halves) in the ring from item it0 on (an
// n-tile never straddles two slots; each warp waits for the slots of its own n-tiles only, so
// it starts as they land, not once the GEMM's last slot has). Warps: NSPLIT groups of n-tiles x (8 / NSPLIT) K ranges;
// partials summed in fixed order; then epi(row, col, v0, v1) for column pairs of the valid
// n-tiles. The slots may be reused once it returns.
template <int NT, int KS, int NSPLIT, bool BLK = false, class Epi>
__device__ __forceinline__ void gemm(const bf16 *A, int lda, const Ring &ring, int it0, int ntv,
                                     float *red, Epi epi) {
    constexpr int KSPLIT = WARPS / NSPLIT, NTW = NT / NSPLIT, KSW = KS / KSPLIT, NC = NT * 8;
    constexpr int NTB = KS * 256;                                    // bytes of one n-tile
    static_assert(NT % NSPLIT == 0 && KS % KSPLIT == 0, "split");
    static_assert(KSPLIT * MR * NC * 4 <= RED_BYTES, "red");
    static_assert(SLOT % NTB == 0, "an n-tile within one slot");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int ng = warp % NSPLIT, kg = warp / NSPLIT;
    const unsigned char *bp[NTW];
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
        const int jj = ng * NTW + j;
        bp[j] = ring.ptr(it0 + (jj * NTB) / SLOT) + (jj * NTB) % SLOT + lane * 8;
    }
    float c[NTW][4];
#pragma unroll
    for (int j = 0; j < NTW; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
#pragma unroll
    for (int j = 0; j < NTW; ++j) {     // the ring slots of this warp's n-tiles (not the others')
        const int jj = ng * NTW + j;
        if (jj < ntv) ring.wait(it0 + (jj * NTB) / SLOT);
    }
#pragma unroll 4
    for (int s = kg * KSW; s < (kg + 1) * KSW; ++s) {
        uint32_t a[4];
        if (BLK) load_a_blocked(a, A, s * 16, g, t);
        else load_a(a, A, lda, s * 16, g, t);
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
            if (ng * NTW + j < ntv) {
                const uint2 b = *reinterpret_cast<const uint2 *>(bp[j] + s * 256);
                mma16816(c[j], a, b.x, b.y);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
        const int col = (ng * NTW + j) * 8 + 2 * t;
        float *r0 = red + (kg * MR + g) * NC + col;
        *reinterpret_cast<float2 *>(r0) = make_float2(c[j][0], c[j][1]);
        *reinterpret_cast<float2 *>(r0 + 8 * NC) = make_float2(c[j][2], c[j][3]);
    }
    __syncthreads();
    const int pairs = MR * ntv * 4;
    for (int e = threadIdx.x; e < pairs; e += THREADS) {
        const int row = e / (ntv * 4), col = 2 * (e % (ntv * 4));
        float v0 = 0.f, v1 = 0.f;
#pragma unroll
        for (int q = 0; q < KSPLIT; ++q) {
            const float2 v = *reinterpret_cast<const float2 *>(red + (q * MR + row) * NC + col);
            v0 += v.x;
            v1 += v.y;
        }
        epi(row, col, v0, v1);
    }
    __syncthreads();
}

__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
}
__device__ __forceinline__ float bf(const bf16 *p, int i) { return __bfloat162float(p[i]); }

// the LayerNorm applied in a GEMM epilogue (see the file's header), for output columns col and
// col + 1: rstd * (acc - mean u) + v + bias, with u, v, bias this CTA's columns
__device__ __forceinline__ float2 layer_norm_epilogue(float a0, float a1, int col, const float *u,
                                                      const float *v, const bf16 *bias,
                                                      float mean, float rstd) {
    return make_float2(rstd * (a0 - mean * u[col]) + v[col] + bf(bias, col),
                       rstd * (a1 - mean * u[col + 1]) + v[col + 1] + bf(bias, col + 1));
}

// a column pair (zero where keep is false: rows >= T) into every CTA's copy of buf, at offset:
// this CTA's by a plain store, the peers' by st.async counted on their barrier bar
__device__ __forceinline__ void broadcast_pair(bf16 *buf, int offset, float y0, float y1,
                                               bool keep, uint64_t *bar, int r) {
    __nv_bfloat162 y = keep ? __floats2bfloat162_rn(y0, y1) : __floats2bfloat162_rn(0.f, 0.f);
    *reinterpret_cast<__nv_bfloat162 *>(buf + offset) = y;
#pragma unroll
    for (int dst = 0; dst < R; ++dst)
        if (dst != r) st_async(buf + offset, *reinterpret_cast<uint32_t *>(&y), bar, dst);
}

// the peers' bytes of a broadcast: a GEMM output (this CTA's own stores are ordered by the
// GEMM's last block barrier) or the combined o_h. After a LayerNorm-fed GEMM it also orders
// the reuse of the LayerNorm blocks in xa: a peer sends its next slice only after it waited
// here for this CTA's bytes, which this CTA sends after its k-loop read xa
__device__ __forceinline__ void await_broadcast(uint64_t *bar, unsigned bytes, unsigned parity) {
    if (threadIdx.x == 0) mbar_expect_tx(bar, bytes);
    mbar_wait_cluster(bar, parity);
}

// xm = x * (1 + scale) of this CTA's columns (bf16) and their row sums / sums of squares
// (float32) into this CTA's block of xa (R blocks of XB_BYTES: rank j's MR x LDB rows, then its
// MR float2 sums), then that block to the same place in every other CTA of the cluster by one
// bulk copy each, completing on their LN barrier; waits for the R - 1 blocks coming in (phase
// parity of this LayerNorm: the kernel's LayerNorms alternate it). Then the row statistics
// (mean, 1 / std) from all blocks into mrs. No cluster barrier: a block is overwritten only
// after the wait that follows each LayerNorm-fed GEMM (`await_broadcast`: every peer sent its
// bytes after its k-loop read its xa, which it began once every copy into it had landed).
__device__ __forceinline__ void ln_broadcast(const float *xs, const bf16 *scale,
                                             unsigned char *xab, float *mrs, int r, float eps,
                                             uint64_t *bar, unsigned parity) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    unsigned char *mine = xab + r * XB_BYTES;
    bf16 *xm = reinterpret_cast<bf16 *>(mine);
    for (int e = tid; e < MR * CW / 8; e += THREADS) {
        const int row = e / (CW / 8), c8 = (e % (CW / 8)) * 8;
        const float *x = xs + row * CW + c8;
        uint4 packed;
        __nv_bfloat162 *o = reinterpret_cast<__nv_bfloat162 *>(&packed);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            o[i] = __floats2bfloat162_rn(x[2 * i] * (1.f + bf(scale, c8 + 2 * i)),
                                         x[2 * i + 1] * (1.f + bf(scale, c8 + 2 * i + 1)));
        *reinterpret_cast<uint4 *>(xm + row * LDB + c8) = packed;
    }
    float2 *sums = reinterpret_cast<float2 *>(mine + XB_ROWS_BYTES);
    for (int row = warp; row < MR; row += WARPS) {
        float s = 0.f, q = 0.f;
        for (int c = lane; c < CW; c += 32) {
            const float x = xs[row * CW + c];
            s += x;
            q += x * x;
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) {
            s += __shfl_xor_sync(0xffffffffu, s, m);
            q += __shfl_xor_sync(0xffffffffu, q, m);
        }
        if (lane == 0) sums[row] = make_float2(s, q);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // for the copies' reads
    __syncthreads();
    if (tid < R) {
        if (tid != r) bulk_copy_to_peer(mine, XB_BYTES, bar, tid);
        else mbar_expect_tx(bar, (R - 1) * XB_BYTES);
    }
    mbar_wait(bar, parity);
    if (tid < MR) {
        float s = 0.f, q = 0.f;
#pragma unroll
        for (int j = 0; j < R; ++j) {
            const float2 v = reinterpret_cast<const float2 *>(xab + j * XB_BYTES
                                                              + XB_ROWS_BYTES)[tid];
            s += v.x;
            q += v.y;
        }
        const float mean = s / D;
        const float var = fmaxf(q / D - mean * mean, 0.f);
        mrs[tid] = mean;
        mrs[MR + tid] = 1.f / sqrtf(var + eps);
    }
    // the next GEMM's __syncthreads (before its epilogue) orders mrs
}


// x[:, r CW : (r+1) CW] += gate * (sum over heads of part[sub] + bias), rows < T; bias and
// gate: this CTA's columns (shared memory). Each thread polls its partials until every value
// carries the block's parity par (wait false: benchmarks, whatever is there): a partial's
// store is its own signal, so no counter, fence or block barrier stands between the
// producer's store and this read. The parity of a slot alternates from block to block and a
// producer rewrites a slot only after every reader of it has sent its next partial (which it
// waited for), so a value of the block before is never taken for this block's.
__device__ __forceinline__ void residual_update(const Params &p, int sub, int r, const bf16 *bias,
                                                const bf16 *gate, float *xs, unsigned par,
                                                bool wait) {
    const float *P = p.part + (size_t)sub * H * MR * D;
    for (int e = threadIdx.x; e < p.T * CW / 4; e += THREADS) {
        const int row = e / (CW / 4), c4 = (e % (CW / 4)) * 4, col = r * CW + c4;
        uint4 v[H];
#pragma unroll
        for (int hh = 0; hh < H; ++hh) v[hh] = ld_volatile4(P + ((size_t)hh * MR + row) * D + col);
        // poll in rounds: every value still without the parity is reloaded, all of them
        // before any is looked at again, so a round costs one L2 round trip however many
        // heads are late (a head at a time costs a round trip for each late head)
        while (wait) {
            unsigned late = 0;
#pragma unroll
            for (int hh = 0; hh < H; ++hh)
                if (!carries(v[hh], par)) late |= 1u << hh;
            if (!late) break;
#pragma unroll
            for (int hh = 0; hh < H; ++hh)
                if (late & (1u << hh)) v[hh] = ld_volatile4(P + ((size_t)hh * MR + row) * D + col);
        }
        float4 s = make_float4(__uint_as_float(v[0].x), __uint_as_float(v[0].y),
                               __uint_as_float(v[0].z), __uint_as_float(v[0].w));
#pragma unroll
        for (int hh = 1; hh < H; ++hh) {
            s.x += __uint_as_float(v[hh].x);
            s.y += __uint_as_float(v[hh].y);
            s.z += __uint_as_float(v[hh].z);
            s.w += __uint_as_float(v[hh].w);
        }
        const float sv[4] = {s.x, s.y, s.z, s.w};
        float *x = xs + row * CW + c4;
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] += bf(gate, c4 + i) * (sv[i] + bf(bias, c4 + i));
    }
    __syncthreads();
}

#define STAMP(i) do { if (trace && threadIdx.x == 0) trace[i] = clock64(); } while (0)

// the token of row `row`, column col from x_t, as the action expert embeds it: action_embed on
// x_t in bf16 (float32 sums, the bias added before the bf16 rounding), then the position
// embedding added in bf16 (`ActionExpert.embed_actions`)
__device__ __forceinline__ float embed_token(const Params &p, int row, int col) {
    float acc = 0.f;
    for (int a = 0; a < p.A; ++a)
        acc += __bfloat162float(__float2bfloat16(p.xt_in[row * p.A + a])) * bf(p.w_emb, col * p.A + a);
    const float y = __bfloat162float(__float2bfloat16(acc + bf(p.b_emb, col)));
    return __bfloat162float(__float2bfloat16(y + bf(p.pos, row * D + col)));
}

// two consecutive bf16 of the final linear's row n (0 past its A rows) as one B register
__device__ __forceinline__ uint32_t fin_pair(const Params &p, int n, int k) {
    return n < p.A ? *reinterpret_cast<const uint32_t *>(p.w_fin + (size_t)n * D + k) : 0u;
}

// cluster 0, after the blocks: the final layer on x rounded to bf16 (as the blocks' output is),
// its LayerNorm through the broadcast every LayerNorm-fed GEMM uses (phase parity `parity`),
// the 16 x A x D product on CTA 0 (k-steps split over the warps, summed in warp order), the
// LayerNorm epilogue with tab_fin, the velocity rounded to bf16, and
// xt_out = xt_in + dt * velocity in float32 (a product, then a sum: `euler_flow`)
__device__ void final_step(const Params &p, float *xs, unsigned char *xab, float *mrs,
                           float *red, int r, uint64_t *lnbar, unsigned parity) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    for (int e = tid; e < MR * CW; e += THREADS) xs[e] = __bfloat162float(__float2bfloat16(xs[e]));
    __syncthreads();
    ln_broadcast(xs, p.mod_fin + D + r * CW, xab, mrs, r, p.eps, lnbar, parity);
    if (r != 0) return;
    const bf16 *xa = reinterpret_cast<const bf16 *>(xab);
    float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = warp; s < D / 16; s += WARPS) {
        uint32_t a[4];
        load_a_blocked(a, xa, s * 16, g, t);
        const int k = s * 16 + 2 * t;
        mma16816(c0, a, fin_pair(p, g, k), fin_pair(p, g, k + 8));
        mma16816(c1, a, fin_pair(p, 8 + g, k), fin_pair(p, 8 + g, k + 8));
    }
    float *pr = red + warp * MR * 16;                 // this warp's 16 x 16 partial
    pr[g * 16 + 2 * t] = c0[0];
    pr[g * 16 + 2 * t + 1] = c0[1];
    pr[(g + 8) * 16 + 2 * t] = c0[2];
    pr[(g + 8) * 16 + 2 * t + 1] = c0[3];
    pr[g * 16 + 8 + 2 * t] = c1[0];
    pr[g * 16 + 8 + 2 * t + 1] = c1[1];
    pr[(g + 8) * 16 + 8 + 2 * t] = c1[2];
    pr[(g + 8) * 16 + 8 + 2 * t + 1] = c1[3];
    __syncthreads();                                  // also orders ln_broadcast's mrs
    const int row = tid / 16, n = tid % 16;
    if (row < p.T && n < p.A) {
        float acc = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) acc += red[(w * MR + row) * 16 + n];
        const float y = mrs[MR + row] * (acc - mrs[row] * p.tab_fin[n]) + p.tab_fin[p.A + n]
                        + bf(p.b_fin, n);
        const float v = __bfloat162float(__float2bfloat16(y));
        p.xt_out[row * p.A + n] = __fadd_rn(p.xt_in[row * p.A + n], __fmul_rn(p.dt, v));
    }
}

__global__ void __launch_bounds__(THREADS, 1) dit_step_kernel(const Params p) {
    cg::cluster_group cluster = cg::this_cluster();
    const int r = (int)cluster.block_rank(), h = blockIdx.x / R;
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char *xab = smem + OFF_XA;
    const bf16 *xa = reinterpret_cast<const bf16 *>(xab);
    float *xs = reinterpret_cast<float *>(smem + OFF_XS);
    bf16 *qkv = reinterpret_cast<bf16 *>(smem + OFF_QKV);
    bf16 *oh = reinterpret_cast<bf16 *>(smem + OFF_OH);
    bf16 *q2 = reinterpret_cast<bf16 *>(smem + OFF_Q2);
    float *inbox = reinterpret_cast<float *>(smem + OFF_IN);
    float2 *inml = reinterpret_cast<float2 *>(smem + OFF_ML);
    bf16 *ah = reinterpret_cast<bf16 *>(smem + OFF_AH);
    bf16 *probs = reinterpret_cast<bf16 *>(smem + OFF_AH);
    float *red = reinterpret_cast<float *>(smem + OFF_RED);
    float *mrs = reinterpret_cast<float *>(smem + OFF_MRS);
    bf16 *mbias = reinterpret_cast<bf16 *>(smem + OFF_MB);
    const Ring ring{smem + OFF_RING, reinterpret_cast<uint64_t *>(smem + OFF_BARS),
                    !(p.mode & 1)};
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int T = p.T, nkv = p.nkv, ipb = WSLOTS + 2 * nkv;
    const int G = p.S / 16, g0 = r * G / R, gr = (r + 1) * G / R - g0;
    const int j0 = r * QKV_NT / R, ntv = (r + 1) * QKV_NT / R - j0;      // q|k|v n-tiles
    const int q0 = r * Q2_NT / R, ntv2 = (r + 1) * Q2_NT / R - q0;       // cross q n-tiles
    const Stream st{&p, h, r, ipb, p.nb * ipb, g0, gr, ntv, ntv2};
    const bool exchange = !(p.mode & 2);
    int issued = ring.on ? 0 : st.total;
    uint64_t *lnbar = reinterpret_cast<uint64_t *>(smem + OFF_BARS) + RING;
    uint64_t *cabar = lnbar + 1, *ohbar = lnbar + 2;      // one phase per block each
    uint64_t *qkvbar = lnbar + 3, *q2bar = lnbar + 4, *ahbar = lnbar + 5;
    if (tid == 0) {
        for (int s = 0; s < RING + 6; ++s) mbar_init(ring.bars + s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    issue_by(0, st, ring, issued, RING);
    load_ops(p, 0, h, r, j0, ntv, q0, ntv2, smem + OFF_OPS);
    for (int e = tid; e < MR * CW; e += THREADS) {
        const int row = e / CW, c = e % CW;
        xs[e] = row >= T ? 0.f
                : p.xt_in ? embed_token(p, row, r * CW + c)
                          : __bfloat162float(p.x_in[row * D + r * CW + c]);
    }
    for (int k = tid; k < gr * 16; k += THREADS) mbias[k] = p.mask_bias[g0 * 16 + k];
    cluster.sync();                 // every CTA of the cluster runs before remote writes
    const bf16 zero = __float2bfloat16(0.f);
    // the epilogue of the three head partials: rows < T of this CTA's columns, float32
    const auto store_partial = [T](float *part, unsigned par) {
        return [T, part, par](int row, int col, float a0, float a1) {
            if (row < T) store_flagged(part + (size_t)row * D + col, a0, a1, par);
        };
    };
    for (int b = 0; b < p.nb; ++b) {
        const int it0 = b * ipb;
        long long *trace = p.trace ? p.trace + ((size_t)blockIdx.x * p.nb + b) * TRACE_POINTS
                                   : nullptr;
        STAMP(0);
        const unsigned par = (b + 1) & 1;       // of this block's partials (zeros: none yet)
        const unsigned char *ops = smem + OFF_OPS + (b & 1) * OP_BYTES;
        unsigned char *next_ops = smem + OFF_OPS + ((b + 1) & 1) * OP_BYTES;
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");     // block b's operands
        __syncthreads();
        const bf16 *opb = reinterpret_cast<const bf16 *>(ops);
        const float *opf = reinterpret_cast<const float *>(ops);
        // ---- self-attention
        ln_broadcast(xs, opb + OP_SC1 / 2, xab, mrs, r, p.eps, lnbar, (3 * b) & 1);
        STAMP(1);
        STAMP(2);
        gemm<6, D / 16, 2, true>(xa, LDB, ring, it0, ntv, red,
            [&](int row, int col, float a0, float a1) {
                const int jj = j0 + col / 8, part = jj / Q2_NT, w = (jj % Q2_NT) * 8 + col % 8;
                const float2 y = layer_norm_epilogue(a0, a1, col, opf + OP_QU / 4,
                                                     opf + OP_QV / 4, opb + OP_QB / 2, mrs[row],
                                                     mrs[MR + row]);
                broadcast_pair(qkv, row * LDQKV + part * HD + w, y.x, y.y, row < T, qkvbar, r);
            });
        STAMP(3);
        issue_by(0, st, ring, issued, it0 + 5 + RING);
        await_broadcast(qkvbar, broadcast_tx(QKV_NT, ntv), b & 1);
        STAMP(4);
        {   // softmax(q k^T / sqrt(hd)) v of head h (mma; probabilities rounded to bf16 as the
            // reference does); every token sees every token
            float *sc = red;                                         // MR x MR
            bf16 *pr = reinterpret_cast<bf16 *>(red + MR * MR);      // MR x LDS
            if (warp < 2) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int s = 0; s < HD / 16; ++s) {
                    uint32_t a[4];
                    load_a(a, qkv, LDQKV, s * 16, g, t);
                    const bf16 *kr = qkv + (warp * 8 + g) * LDQKV + HD + s * 16 + 2 * t;
                    mma16816(c, a, *reinterpret_cast<const uint32_t *>(kr),
                             *reinterpret_cast<const uint32_t *>(kr + 8));
                }
                const int col = warp * 8 + 2 * t;
                sc[g * MR + col] = c[0] * p.sm_scale;
                sc[g * MR + col + 1] = c[1] * p.sm_scale;
                sc[(g + 8) * MR + col] = c[2] * p.sm_scale;
                sc[(g + 8) * MR + col + 1] = c[3] * p.sm_scale;
            }
            __syncthreads();
            for (int i = warp; i < MR; i += WARPS) {
                const float s = lane < T ? sc[i * MR + lane] : -INFINITY;
                float m = s;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                const float e = lane < T ? __expf(s - m) : 0.f;
                float l = e;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
                if (lane < MR) pr[i * LDS + lane] = __float2bfloat16(e / l);
            }
            __syncthreads();
            for (int j = warp; j < HD / 8; j += WARPS) {
                uint32_t a[4];
                load_a(a, pr, LDS, 0, g, t);
                const bf16 *vc = qkv + 2 * HD + j * 8 + g;
                __nv_bfloat162 b0, b1;
                b0.x = vc[(2 * t) * LDQKV];
                b0.y = vc[(2 * t + 1) * LDQKV];
                b1.x = vc[(2 * t + 8) * LDQKV];
                b1.y = vc[(2 * t + 9) * LDQKV];
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                mma16816(c, a, *reinterpret_cast<uint32_t *>(&b0),
                         *reinterpret_cast<uint32_t *>(&b1));
                const int col = j * 8 + 2 * t;
                *reinterpret_cast<__nv_bfloat162 *>(oh + g * LDH + col) =
                    g < T ? __floats2bfloat162_rn(c[0], c[1]) : __nv_bfloat162(zero, zero);
                *reinterpret_cast<__nv_bfloat162 *>(oh + (g + 8) * LDH + col) =
                    g + 8 < T ? __floats2bfloat162_rn(c[2], c[3]) : __nv_bfloat162(zero, zero);
            }
            __syncthreads();
        }
        STAMP(5);
        float *part0 = p.part + (size_t)h * MR * D + r * CW;
        gemm<12, HD / 16, 4>(oh, LDH, ring, it0 + 5, 12, red,
            store_partial(part0, par));
        STAMP(6);
        // (the GEMM's last block barrier: its slots and block b - 1's operands are read)
        issue_by(1, st, ring, issued, it0 + 7 + RING);
        load_ops(p, b + 1, h, r, j0, ntv, q0, ntv2, next_ops);   // block b + 1's operands
        STAMP(7);
        residual_update(p, 0, r, opb + OP_BO1 / 2, opb + OP_G1 / 2, xs, par, exchange);
        STAMP(8);
        // ---- cross-attention
        ln_broadcast(xs, opb + OP_SC2 / 2, xab, mrs, r, p.eps, lnbar, (3 * b + 1) & 1);
        STAMP(9);
        gemm<2, D / 16, 1, true>(xa, LDB, ring, it0 + 7, ntv2, red,
            [&](int row, int col, float a0, float a1) {
                const int w = (q0 + col / 8) * 8 + col % 8;
                const float2 y = layer_norm_epilogue(a0, a1, col, opf + OP_CU / 4,
                                                     opf + OP_CV / 4, opb + OP_CB / 2, mrs[row],
                                                     mrs[MR + row]);
                broadcast_pair(q2, row * LDH + w, y.x * p.sm_scale, y.y * p.sm_scale, row < T,
                               q2bar, r);
            });
        issue_by(0, st, ring, issued, it0 + 9 + RING);
        await_broadcast(q2bar, broadcast_tx(Q2_NT, ntv2), b & 1);
        STAMP(10);
        {   // this CTA's keys [g0 16, (g0 + gr) 16): scores, row max / sum, P V (unnormalized)
            const int itk = it0 + 9, itv = it0 + 9 + nkv;
            STAMP(11);
            uint32_t qa[HD / 16][4];
#pragma unroll
            for (int s = 0; s < HD / 16; ++s) load_a(qa[s], q2, LDH, s * 16, g, t);
            // scores of n-tiles j = warp + 8 q (8 keys each) in registers, then the row max
            // and sum over the CTA's keys through two small exchanges between the warps
            float c[KEYMAX / 64][4];
#pragma unroll
            for (int q = 0; q < KEYMAX / 64; ++q) {
                const int j = warp + WARPS * q;
                c[q][0] = c[q][1] = c[q][2] = c[q][3] = -INFINITY;
                if (j < 2 * gr) {
                    ring.wait(itk + j / 8);
                    const unsigned char *kb = ring.ptr(itk + j / 8) + (j % 8) * (HD / 16) * 256
                                              + lane * 8;
                    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int s = 0; s < HD / 16; ++s) {
                        const uint2 bb = *reinterpret_cast<const uint2 *>(kb + s * 256);
                        mma16816(acc, qa[s], bb.x, bb.y);
                    }
                    const int key = j * 8 + 2 * t;
                    const float bk0 = bf(mbias, key), bk1 = bf(mbias, key + 1);
                    c[q][0] = acc[0] + bk0;
                    c[q][1] = acc[1] + bk1;
                    c[q][2] = acc[2] + bk0;
                    c[q][3] = acc[3] + bk1;
                }
            }
            float m0 = -INFINITY, m1 = -INFINITY;       // rows g and g + 8
#pragma unroll
            for (int q = 0; q < KEYMAX / 64; ++q) {
                m0 = fmaxf(m0, fmaxf(c[q][0], c[q][1]));
                m1 = fmaxf(m1, fmaxf(c[q][2], c[q][3]));
            }
#pragma unroll
            for (int o = 1; o < 4; o <<= 1) {
                m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, o));
                m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
            }
            float *wmax = red, *wsum = red + WARPS * MR;        // WARPS x MR each
            if (t == 0) {
                wmax[warp * MR + g] = m0;
                wmax[warp * MR + g + 8] = m1;
            }
            __syncthreads();
            m0 = wmax[g];
            m1 = wmax[g + 8];
#pragma unroll
            for (int w = 1; w < WARPS; ++w) {
                m0 = fmaxf(m0, wmax[w * MR + g]);
                m1 = fmaxf(m1, wmax[w * MR + g + 8]);
            }
            float l0 = 0.f, l1 = 0.f;
#pragma unroll
            for (int q = 0; q < KEYMAX / 64; ++q) {
                const int j = warp + WARPS * q;
                if (j < 2 * gr) {
                    const float e0 = __expf(c[q][0] - m0), e1 = __expf(c[q][1] - m0);
                    const float e2 = __expf(c[q][2] - m1), e3 = __expf(c[q][3] - m1);
                    l0 += e0 + e1;
                    l1 += e2 + e3;
                    const int key = j * 8 + 2 * t;
                    *reinterpret_cast<__nv_bfloat162 *>(probs + g * LDP + key) =
                        __floats2bfloat162_rn(e0, e1);
                    *reinterpret_cast<__nv_bfloat162 *>(probs + (g + 8) * LDP + key) =
                        __floats2bfloat162_rn(e2, e3);
                }
            }
#pragma unroll
            for (int o = 1; o < 4; o <<= 1) {
                l0 += __shfl_xor_sync(0xffffffffu, l0, o);
                l1 += __shfl_xor_sync(0xffffffffu, l1, o);
            }
            if (t == 0) {
                wsum[warp * MR + g] = l0;
                wsum[warp * MR + g + 8] = l1;
            }
            __syncthreads();
            if (tid < MR) {             // this CTA's row max and sum to every CTA's inbox
                float l = 0.f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) l += wsum[w * MR + tid];
                float mx = wmax[tid];
#pragma unroll
                for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, wmax[w * MR + tid]);
                inml[r * MR + tid] = make_float2(mx, l);
#pragma unroll
                for (int dst = 0; dst < R; ++dst)
                    if (dst != r) st_async(inml + r * MR + tid, mx, l, cabar, dst);
            }
            STAMP(12);
            for (int i = 0; i < nkv; ++i) ring.wait(itv + i);
            STAMP(13);
            for (int j = warp; j < HD / 8; j += WARPS) {    // P V, each column to its owner
                float acc[4] = {0.f, 0.f, 0.f, 0.f};
                for (int s = 0; s < gr; ++s) {
                    uint32_t a[4];
                    load_a(a, probs, LDP, s * 16, g, t);
                    const uint2 bb = *reinterpret_cast<const uint2 *>(
                        ring.ptr(itv + s / 4) + (s % 4) * (HD / 8) * 256 + j * 256 + lane * 8);
                    mma16816(acc, a, bb.x, bb.y);
                }
                const int col = j * 8 + 2 * t, owner = col / OD, oc = col % OD;
                float *dst = inbox + (r * MR + g) * OD + oc;
                if (owner == r) {
                    *reinterpret_cast<float2 *>(dst) = make_float2(acc[0], acc[1]);
                    *reinterpret_cast<float2 *>(dst + 8 * OD) = make_float2(acc[2], acc[3]);
                } else {
                    st_async(dst, acc[0], acc[1], cabar, owner);
                    st_async(dst + 8 * OD, acc[2], acc[3], cabar, owner);
                }
            }
            __syncthreads();        // (this CTA's own partials and row sums: plain stores)
            STAMP(14);
        }
        issue_by(0, st, ring, issued, it0 + 9 + 2 * nkv + RING);   // K and V read (sync above)
        // combine the 8 partials of my OD dims (fixed order), to every CTA's o_h, once the
        // peers' partials have landed (the combine barrier: one phase per block; a peer
        // sends block b + 1's only after this CTA's LayerNorm slice of b + 1, so after this
        // combine)
        if (tid == 0) mbar_expect_tx(cabar, COMBINE_TX);
        if (tid < MR * OD / 2) {
            mbar_wait_cluster(cabar, b & 1);
            STAMP(15);
            const int row = tid / (OD / 2), d = 2 * (tid % (OD / 2));
            float mx = inml[row].x;
#pragma unroll
            for (int j = 1; j < R; ++j) mx = fmaxf(mx, inml[j * MR + row].x);
            float den = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
            for (int j = 0; j < R; ++j) {
                const float2 ml = inml[j * MR + row];
                const float w = __expf(ml.x - mx);
                den += w * ml.y;
                const float2 o = *reinterpret_cast<const float2 *>(inbox + (j * MR + row) * OD + d);
                o0 += w * o.x;
                o1 += w * o.y;
            }
            __nv_bfloat162 y = row < T ? __floats2bfloat162_rn(o0 / den, o1 / den)
                                       : __nv_bfloat162(zero, zero);
            bf16 *mine = oh + row * LDH + r * OD + d;
            *reinterpret_cast<__nv_bfloat162 *>(mine) = y;
#pragma unroll
            for (int dst = 0; dst < R; ++dst)
                if (dst != r) st_async(mine, *reinterpret_cast<uint32_t *>(&y), ohbar, dst);
        }
        await_broadcast(ohbar, OH_TX, b & 1);     // the peers' dims of o_h
        __syncthreads();            // and this CTA's own
        STAMP(16);
        const int itw = it0 + 9 + 2 * nkv;                      // wo2, w1, w2 from here
        float *part1 = p.part + (size_t)(H + h) * MR * D + r * CW;
        gemm<12, HD / 16, 4>(oh, LDH, ring, itw, 12, red,
            store_partial(part1, par));
        STAMP(17);
        issue_by(1, st, ring, issued, itw + 2 + RING);
        STAMP(18);
        residual_update(p, 1, r, opb + OP_BO2 / 2, opb + OP_G2 / 2, xs, par, exchange);
        // ---- MLP
        ln_broadcast(xs, opb + OP_SC3 / 2, xab, mrs, r, p.eps, lnbar, (3 * b + 2) & 1);
        STAMP(19);
        STAMP(20);
        gemm<6, D / 16, 2, true>(xa, LDB, ring, itw + 2, 6, red,
            [&](int row, int col, float a0, float a1) {
                const float2 y = layer_norm_epilogue(a0, a1, col, opf + OP_FU / 4,
                                                     opf + OP_FV / 4, opb + OP_FB / 2, mrs[row],
                                                     mrs[MR + row]);
                broadcast_pair(ah, row * LDA + r * FW + col, gelu(y.x), gelu(y.y), row < T,
                               ahbar, r);
            });
        issue_by(0, st, ring, issued, itw + 8 + RING);
        await_broadcast(ahbar, broadcast_tx(FH / 8, FW / 8), b & 1);
        STAMP(21);
        float *part2 = p.part + (size_t)(2 * H + h) * MR * D + r * CW;
        gemm<12, FH / 16, 4>(ah, LDA, ring, itw + 8, 12, red,
            store_partial(part2, par));
        STAMP(22);
        issue_by(1, st, ring, issued, itw + 14 + RING);
        residual_update(p, 2, r, opb + OP_B2 / 2, opb + OP_G3 / 2, xs, par, exchange);
        STAMP(23);
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    if (h == 0) {
        for (int e = tid; e < T * CW; e += THREADS) {
            const int row = e / CW, c = e % CW;
            p.out[row * D + r * CW + c] = __float2bfloat16(xs[row * CW + c]);
        }
        if (p.xt_in) {
            __syncthreads();                          // out written before xs is rounded
            final_step(p, xs, xab, mrs, red, r, lnbar, (3 * p.nb) & 1);
        }
    }
    cluster.sync();                 // no CTA exits while another may read its shared memory
}

// ------------------------------------------------------------ the K/V repack, once per query
// keys / values (n_blocks, 1, H, S, HD) with the head dim contiguous (any other strides, in
// elements) -> kp, vp (n_blocks, H, S * HD) in the fragment order `cluster_dit.pack_context`
// defines. One CTA of 192 threads per (16 keys, head, block): the 16 x 96 tiles are read as
// 16-byte vectors into shared memory, then each thread writes 8 consecutive elements of each
// packed 1536-element group (both outputs are contiguous per 16 keys).
constexpr int PACK_THREADS = GROUP_E / 8;        // 192
__global__ void __launch_bounds__(PACK_THREADS) pack_context_kernel(
        const bf16 *__restrict__ keys, const bf16 *__restrict__ values, bf16 *__restrict__ kp,
        bf16 *__restrict__ vp, long long s_blk, long long s_head, long long s_key, int S) {
    __shared__ __align__(16) bf16 kt[16 * HD];
    __shared__ __align__(16) bf16 vt[16 * HD];
    const int g16 = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    {
        const int row = tid / (HD / 8), c8 = tid % (HD / 8);
        const long long src = b * s_blk + h * s_head + (long long)(16 * g16 + row) * s_key + 8 * c8;
        reinterpret_cast<uint4 *>(kt)[tid] = *reinterpret_cast<const uint4 *>(keys + src);
        reinterpret_cast<uint4 *>(vt)[tid] = *reinterpret_cast<const uint4 *>(values + src);
    }
    __syncthreads();
    __align__(16) bf16 ko[8], vo[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int o = 8 * tid + i;                 // element of this 16-key group's output
        const int j = o & 3, lane = (o >> 2) & 31, g = lane >> 2, t = lane & 3;
        const int half = j >> 1, e = j & 1;
        // keys: o = ((n8 * 6 + ks) * 32 + lane) * 4 + j -> key 8 n8 + g, dim 16 ks + 8 half + 2 t + e
        const int tile = o >> 7, n8 = tile / (HD / 16), ks = tile % (HD / 16);
        ko[i] = kt[(8 * n8 + g) * HD + 16 * ks + 8 * half + 2 * t + e];
        // values: o = (nt * 32 + lane) * 4 + j -> key 8 half + 2 t + e, dim 8 nt + g
        vo[i] = vt[(8 * half + 2 * t + e) * HD + 8 * tile + g];
    }
    const long long dst = ((long long)(b * H + h) * S + 16 * g16) * HD + 8 * tid;
    *reinterpret_cast<uint4 *>(kp + dst) = *reinterpret_cast<const uint4 *>(ko);
    *reinterpret_cast<uint4 *>(vp + dst) = *reinterpret_cast<const uint4 *>(vo);
}

}  // namespace cdit

// ------------------------------------------------------------------------------ host side
// A plain C interface (no torch headers: the library builds in seconds with nvcc alone and
// links the CUDA runtime statically), called through ctypes by cluster_dit.py, which checks
// shapes, dtypes and strides first. Each function returns a cudaError_t (0: success) and
// launches on the given stream of the given device.

static cudaLaunchConfig_t launch_config(cudaStream_t stream, cudaLaunchAttribute *attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(cdit::H * cdit::R, 1, 1);
    cfg.blockDim = dim3(cdit::THREADS, 1, 1);
    cfg.dynamicSmemBytes = cdit::SMEM_BYTES;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cdit::R;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

#define CDIT_TRY(call) do { const int e_ = (int)(call); if (e_ != 0) return e_; } while (0)

// selects `device` for this thread (in this library's CUDA runtime, which torch's does not
// see) and, once per device, lets the kernel take its shared memory (before any graph capture:
// the first call is the availability check at configure)
static int use_device(int device) {
    static bool attribute_set[64] = {};
    if (device < 0 || device >= 64) return (int)cudaErrorInvalidDevice;
    CDIT_TRY(cudaSetDevice(device));
    if (!attribute_set[device]) {
        CDIT_TRY(cudaFuncSetAttribute(cdit::dit_step_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      cdit::SMEM_BYTES));
        attribute_set[device] = true;
    }
    return 0;
}

extern "C" {

// the kernel's compiled sizes: D, H, HD, F, R, MR, SLOT_E, WSLOTS, GROUPS_PER_SLOT,
// MAX_KV_SLOTS, SMEM_BYTES (n <= 11 of them written)
int cdit_constants(long long *out, int n) {
    const long long c[] = {cdit::D, cdit::H, cdit::HD, cdit::F, cdit::R, cdit::MR, cdit::SLOT_E,
                           cdit::WSLOTS, cdit::GROUPS_PER_SLOT, cdit::MAX_KV_SLOTS,
                           cdit::SMEM_BYTES};
    for (int i = 0; i < n && i < 11; ++i) out[i] = c[i];
    return 0;
}

const char *cdit_error_string(int error) { return cudaGetErrorString((cudaError_t)error); }

// clusters of this kernel resident at once on `device` (H are needed)
int cdit_max_active_clusters(int device, int *out) {
    CDIT_TRY(use_device(device));
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = launch_config(0, attr);
    return (int)cudaOccupancyMaxActiveClusters(out, cdit::dit_step_kernel, &cfg);
}

// one flow step. ptr: x_in, out, mod, tables, wp, bq1, bkv1, bo1, bq2, bo2, b1, b2, kp, vp,
// mask_bias, part, trace (null or clock64 stamps), xt_in (null: the blocks alone), xt_out,
// w_emb, b_emb, pos, w_fin, b_fin, mod_fin, tab_fin; ints: T, S, nb, nkv, prefetch, mode, A;
// floats: eps, sm_scale, dt (the fields of cdit::Params)
int cdit_step(int device, void *stream, void *const *ptr, const long long *ints,
              const float *floats) {
    CDIT_TRY(use_device(device));
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    cdit::Params p;
    p.x_in = static_cast<const bf16 *>(ptr[0]);
    p.out = static_cast<bf16 *>(ptr[1]);
    p.mod = static_cast<const bf16 *>(ptr[2]);
    p.tables = static_cast<const float *>(ptr[3]);
    p.wp = static_cast<const bf16 *>(ptr[4]);
    p.bq1 = static_cast<const bf16 *>(ptr[5]);
    p.bkv1 = static_cast<const bf16 *>(ptr[6]);
    p.bo1 = static_cast<const bf16 *>(ptr[7]);
    p.bq2 = static_cast<const bf16 *>(ptr[8]);
    p.bo2 = static_cast<const bf16 *>(ptr[9]);
    p.b1 = static_cast<const bf16 *>(ptr[10]);
    p.b2 = static_cast<const bf16 *>(ptr[11]);
    p.kp = static_cast<const bf16 *>(ptr[12]);
    p.vp = static_cast<const bf16 *>(ptr[13]);
    p.mask_bias = static_cast<const bf16 *>(ptr[14]);
    p.part = static_cast<float *>(ptr[15]);
    p.trace = static_cast<long long *>(ptr[16]);
    p.xt_in = static_cast<const float *>(ptr[17]);
    p.xt_out = static_cast<float *>(ptr[18]);
    p.w_emb = static_cast<const bf16 *>(ptr[19]);
    p.b_emb = static_cast<const bf16 *>(ptr[20]);
    p.pos = static_cast<const bf16 *>(ptr[21]);
    p.w_fin = static_cast<const bf16 *>(ptr[22]);
    p.b_fin = static_cast<const bf16 *>(ptr[23]);
    p.mod_fin = static_cast<const bf16 *>(ptr[24]);
    p.tab_fin = static_cast<const float *>(ptr[25]);
    p.T = (int)ints[0]; p.S = (int)ints[1]; p.nb = (int)ints[2]; p.nkv = (int)ints[3];
    p.prefetch = (int)ints[4]; p.mode = (int)ints[5]; p.A = (int)ints[6];
    p.eps = floats[0]; p.sm_scale = floats[1]; p.dt = floats[2];
    // zero partials carry parity 0, which block 0 (parity 1) never takes for its own
    CDIT_TRY(cudaMemsetAsync(p.part, 0, sizeof(float) * 3 * cdit::H * cdit::MR * cdit::D, st));
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = launch_config(st, attr);
    CDIT_TRY(cudaLaunchKernelEx(&cfg, cdit::dit_step_kernel, p));
    return (int)cudaGetLastError();
}

// the cached K/V repack (cdit::pack_context_kernel); strides in elements
int cdit_pack_context(int device, void *stream, const void *keys, const void *values, void *kp,
                      void *vp, long long s_blk, long long s_head, long long s_key, int nb,
                      int S) {
    CDIT_TRY(use_device(device));
    dim3 grid((unsigned)(S / 16), cdit::H, (unsigned)nb);
    cdit::pack_context_kernel<<<grid, cdit::PACK_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const bf16 *>(keys), static_cast<const bf16 *>(values),
        static_cast<bf16 *>(kp), static_cast<bf16 *>(vp), s_blk, s_head, s_key, S);
    return (int)cudaGetLastError();
}

}  // extern "C"
