// Fused KDA decode step for sm_90a: the streamed, persistent kernel written in CUDA C++.
//
// Design note
// ===========
// Work item = (request r, head h), numbered head-major: item = h*R + r (the CuTe DSL design
// uses r*H + h), so that consecutive items of a CTA share the head and the head's conv taps /
// conv bias / dt_bias (and at T=1 or with a bf16 pool its f_b rows) are staged only when the
// head changes. The grid
// is persistent: as many CTAs as are resident (two per SM, from the occupancy query), never
// more than there are items.
//
// The step is memory bound (per live item: a 64 KiB fp32 state page read, T pages written, a
// few KiB of operands), so the loop keeps one state page in flight per CTA almost always.
//
// bf16 state pools (KdaParams.state_bf16, the BF builds): the 32 KiB page is staged with the
// same 16-byte copies, widened to fp32 exactly when it moves into registers, and every page
// written is rounded once to nearest even (docs/contract.md); all arithmetic is the fp32 build's.
// A thread then holds 8 consecutive bf16 key columns per 16-byte load (key_col), so the row
// sums run over the columns in another order than in the fp32 build; it stores them as two
// 8-byte halves. The page staging is 32 KiB smaller, so the BF builds stage the head's f_b rows
// in shared memory at every T.
//
// cp.async groups per item: L (its slot row, one item ahead), E (x / output-gate / f_a rows,
// conv window, head parameters, beta words) and S (the page), committed E then S. The
// rows go by 16-byte copies in the V16 builds (rows 16-byte aligned, KdaParams.row_bytes == 16);
// the other builds stage them with 8- / 4-byte copies or element loads (issue_operands_narrow).
//
//   top of item n:   wait for E(n) (S(n) may still be landing); take item n+1 and issue
//                    L(n+1); f_b fragments (T=1 and BF: from shared memory after B1, see
//                    below; else L2/L1) into registers; B1.
//   gate MMA (mma.sync m16n8k16 bf16 -> fp32, raw gate rounded to bf16 into smem), conv +
//   SiLU + window write-back, sigmoid(output gate), per-token write offsets.
//   wait for S(n), L(n+1); B2.
//   issue E(n+1) (its buffers are free now; the state is not in registers yet, so the
//   address arithmetic costs no registers). All: state page smem -> registers, then issue
//   S(n+1) into the chunks just read (each thread its own: no barrier needed). Warps 0-3:
//   L2-normalise q, k. Warps 4-7: decay alpha from the raw gate (accurate expf/log1pf). B3.
//   Recurrence for T tokens on the register-resident page, state stores per token,
//   per-warp sums of bf16(o)^2 for the RMSNorm; B4; gated RMSNorm epilogue (bf16 out).
//   S(n+1) is requested before the norms and the decay rather than after B3: on the H200
//   1.5% / 1.0% faster at T=1 (R = 128 / 512; 2.2% slower at R=32) and 1.4-3.3% at T=5.
//
// Thread layout (256 threads): thread tid holds value rows tid/8 + 32m (m = 0..3) and in
// each row the key columns 4*(tid%8 + 8c)..+3 (c = 0..3): 16 float4 = 64 fp32 registers. A
// row's 8 lanes are consecutive, so every state load / store instruction of a warp covers
// 4 rows x 128 contiguous bytes (whole L2 lines; the 4-lanes-per-row layout of the CuTe DSL
// design gives 8 rows x 64 B, half lines: twice the L2 requests). Row dot products: in-
// thread over two partial sums (x,z and y,w components, chunks in order), combined p0 + p1,
// then across the 8 lanes with xor-shuffles 1, 2, 4, so all 8 lanes hold the same value.
// Threads 0-127 own q and k channel tid (conv, squares, output gate, RMSNorm); threads 128-255
// own v channel tid-128 and, after B2, gate feature tid-128.
//
// Gate MMA: warp w computes features 16w..16w+15 for the T token columns. The MMA's k index
// is permuted identically for A (f_b) and B (f_a) so that k-steps 2p, 2p+1 cover gate-rank
// columns [32p, 32p+32) and a thread's A fragment is one 16-byte load per row and k-step pair
// (the straightforward fragment order needs 32 scattered 4-byte loads, twice the L2 sectors).
// gate_mode 1's four chains are exactly those 32-column slices, summed ((c0+c1)+c2)+c3.
//
// f_b in shared memory (the T=1 and BF builds, KdaParams.fb_smem): the head's 128 f_b rows (32 KiB)
// are staged with the head's other parameters (group E, only when the head changes) and the
// MMA's A fragments are read from there after B1 (16-byte loads, chunks XOR-swizzled by row
// so that a quarter warp hits 32 distinct banks); the conv bias then comes from global
// memory (its shared-memory copy would not fit). Within its static range a CTA stages the
// rows once or twice per launch instead of reading 32 KiB from L2 for every item. The fp32
// T >= 2 builds read the fragments from L2: 32 KiB more does not fit two CTAs per SM next to T
// tokens' buffers and a 64 KiB page. Measurements: backends/cuda/policy.py.
//
// Schedule: CTA b first walks the contiguous range [b*S, (b+1)*S) of S = KdaParams.static_items
// items (S = 0 counts as 1: the range is item b alone), then takes each next item from an
// atomic counter (thread 0, at the top of the current item, so that the next item's slot row
// is still requested one item ahead), which hands out items G*S onwards; the last CTA to
// finish resets the counters. The static ranges keep the head-major locality for most items;
// the counter evens out the SMs, which run at different speeds (per-item time per SM 8.7-9.7
// us at R=512 T=1 on the H200, the same SMs slow from step to step). The launcher sets
// S = floor(f * items / CTAs) from the fraction f that backends/cuda/policy.py gives by T.
//
// Shared memory per CTA: 64 KiB state staging laid out [16 chunk][256 thread][4 floats]
// (each thread reads back only what it copied: no barrier needed for the page itself, no bank
// conflicts), operand staging T*1296 B (f_a rows padded to 136 bf16), conv window 4.5 KiB,
// head parameters 8 KiB (T=1: 32 KiB more for the f_b rows, 1.5 KiB less without the conv
// bias), q/k/v/alpha/o/sigmoid(og) as fp32 [T][128] (3 KiB per token), small bookkeeping.
// T=1: 115,264 B; T=2: 87,952 B; T=8: 114,416 B. The BF builds stage 32 KiB of page and the
// f_b rows at every T: T=1: 82,496 B; T=8: 113,376 B. Two CTAs per SM need <= 115,712 B each
// (static_assert below; tests/backends/cuda/test_compile.py checks the built object).
//
// Registers: __launch_bounds__(256, 2) caps at 128 per thread. During the recurrence the live
// set is the 64-register page, 8 partial sums, 4 u's, two float4 operands and addressing. The
// per-item info (slots, r, h) lives in shared memory, written once per item by thread 0,
// because every register loop-carried across the recurrence pushed some T over the cap; for
// the same reason the staging functions pass tid / strides through opaque() so that ptxas
// cannot hoist their address arithmetic out of the item loop. No T spills (checked in CI).
//
// Programmatic dependent launch: the kernel is always launched with programmatic stream
// serialization. Only the norm weight (a model weight) is read before griddepcontrol.wait;
// the slot ids, windows, pages and operands may all come from the predecessor (slot ids from
// a server's input preparation, windows and pages from the previous step on the same cache),
// and launch_dependents alone does not make a primary's writes visible to a dependent. The
// first item's page is requested behind its operands, in its own cp.async group, so that item
// 0's conv and gate overlap its arrival as every later item's do. The trigger for dependents
// is issued at the end of each CTA, after its last stores and a fence; a dependent reads our
// outputs only after its own griddepcontrol.wait, which waits for this whole grid and its
// memory.
//
// Numerics follow docs/contract.md section 2. Rounding points y, rg, o, out are bf16; all else
// fp32. Not built with --use_fast_math: the decay alpha = exp(gk) is not rounded and
// multiplies every state element; where it is exactly 1 in the reference, an approximate exp
// gives 1 - 1ulp and moves state elements the reference leaves bit-identical (seen on the
// H200). The decay path therefore uses accurate expf / log1pf / division. (Such elements can
// still differ by fp32 reassociation of u.) SiLU and the sigmoids of beta and of the output
// gate, which a bf16 rounding or the fp32 tolerance follows, use __expf / __fdividef.
//
// What the kernel does not do, and why: an L2 prefetch of item n+d's page during item n
// (cp.async.bulk.prefetch.L2) is slower in every cell on the H200 (R=128 T=1: 0.655 / 0.603 of
// the bandwidth floor at d = 2 / 3 against 0.788 without; at ~4 TB/s the 50 MB L2 turns over in
// about one item's time per CTA, so the prefetched pages are evicted before use). Streaming
// state stores (st.global.cs) measure the same as write-back ones within run-to-run noise.
// State loads use plain cp.async.cg: the L2::cache_hint form miscompiles with nvcc 13.0 for
// T=1 (uniform descriptor registers read but never written; illegal-instruction fault on the
// H200). All slot offsets are 64-bit.

#include "kda_decode.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

namespace {

constexpr int kThreads = 256;
constexpr int kD = 128;
constexpr int kFaStride = 136;  // padded f_a row (bf16 elements)
constexpr int kMaxT = 8;

struct __align__(16) Item {
  int r, h;
  int src;    // state slot read (dead when <= 0)
  int cslot;  // conv window slot / record row
  int off;    // window offset a-1
  int pad[3];
};

template <int T, bool FB, bool BF>
struct __align__(16) Smem {
  float4 state[(BF ? 8 : 16) * kThreads];  // [chunk][thread] 16 bytes (fp32: 64 KiB, bf16: 32 KiB)
  __nv_bfloat16 x[T][3 * kD];           // staged x row slice: q | k | v of this head
  __nv_bfloat16 og[T][kD];              // staged output-gate row slice
  __nv_bfloat16 fa[T][kFaStride];       // staged f_a rows (padded)
  // Staged conv history, raw cache words. SD: [part][pos][128 ch] elements of the cache
  // dtype (16-byte chunks). DS: per channel the 2 (bf16) or 3 (fp32) 4-byte words covering
  // positions off..off+2, [part*128 + ch][words].
  uint32_t win[3 * 3 * kD];
  uint32_t cw[3 * 4 * kD];              // conv taps of the head, raw: [part][tap][128] (fp32 or bf16)
  float cbias[FB ? 1 : 3][kD];          // conv bias of the head (if any; FB: read from global)
  // FB (the head's f_b staged in shared memory): [row][16-byte chunk], chunk index XOR
  // 4 * (row % 4), so that the MMA's 16-byte fragment loads are free of bank conflicts.
  uint4 fb[FB ? kD * 16 : 1];
  float dtb[kD];                        // dt_bias of the head
  float q[T][kD], k[T][kD], v[T][kD];   // conv outputs (q, k normalised in place)
  float alpha[T][kD];                   // per-key decay
  float o[T][kD];                       // recurrence output
  float ogs[T][kD];                     // sigmoid(output gate)
  float red[T][4][2];                   // warp partial sums: q^2, k^2 by warp 0-3 (conv);
                                        // after B3 bf16(o)^2 by warp 0-7, [t][w/2][w%2]
  float beta[T];
  uint32_t beta_word[2][kMaxT];         // 4-byte words holding beta[n, h] (by item parity)
  float nw[kD];                         // norm weight
  long long woff[T];                    // per token: state page offset to write (-1: none), or
                                        // in record mode the v_record row offset
  int item_end;                         // R * H: items >= item_end are past the work (kept
                                        // out of registers)
  int item_idx[2];                      // item index of iterations n and n+1 (by parity)
  int static_end;                       // end of the CTA's static range
  int slots[2][12];                     // state_indices row [0, T) and num_accepted [8], by parity of iteration
  Item info[2];                         // items n and n+1 (by parity), derived once from slots
  int params_head;                      // head whose cw / cbias / dtb are staged (-1: none)
};

__device__ __forceinline__ float bf2f(uint16_t raw) {
  return __uint_as_float(static_cast<uint32_t>(raw) << 16);
}
__device__ __forceinline__ float bf16r(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ uint16_t f2bf_raw(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
// (lo, hi) rounded to nearest even, lo in the low half (the lower address)
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// Fast sigmoid / SiLU (ex2.approx + approximate division), used where a bf16 rounding or
// the tolerance of an unrounded fp32 factor (beta) follows.
__device__ __forceinline__ float sigmoidf_fast(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
__device__ __forceinline__ float siluf_fast(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void trigger_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Returns v through an empty volatile asm: address arithmetic that depends on it cannot be
// hoisted out of the item loop (where it would only hold registers, or spill).
__device__ __forceinline__ int64_t opaque(int64_t v) {
  asm volatile("" : "+l"(v));
  return v;
}
__device__ __forceinline__ int opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}
template <typename P>
__device__ __forceinline__ P* opaque(P* v) {
  return reinterpret_cast<P*>(opaque(reinterpret_cast<int64_t>(v)));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// cp.async of request r's slot row (and accepted count) into sm.slots[iter & 1], by threads
// 0..8 (warp 0 only: before B2 the next item's index is known to warp 0 alone).
template <int T, bool FB, bool BF>
__device__ __forceinline__ void issue_slots(const KdaParams& p, Smem<T, FB, BF>& sm, int iter, int r, int tid) {
  if (tid < T) cp_async4(&sm.slots[iter & 1][tid], p.state_indices + static_cast<int64_t>(r) * p.idx_row + tid);
  if (T > 1 && tid == kMaxT) cp_async4(&sm.slots[iter & 1][8], p.num_accepted + r);
}

// The item of iteration `iter` = (request r, head h), with its slots from its staged slot row.
template <int T, bool FB, bool BF>
__device__ __forceinline__ Item item_at(const KdaParams& p, const Smem<T, FB, BF>& sm, int iter, int r, int h) {
  Item it;
  it.r = r;
  it.h = h;
  const int* row = sm.slots[iter & 1];
  if (T == 1) {
    it.src = it.cslot = row[0];
    it.off = 0;
  } else {
    const int a = min(max(row[8], 1), T);
    it.src = row[a - 1];
    it.cslot = row[0];
    it.off = a - 1;
  }
  // Live iff both the source slot and the conv slot are real slots (0 is the null slot, -1
  // the old pad id, >= num_slots out of range); a dead item is marked by src = 0.
  const unsigned ns = static_cast<unsigned>(p.num_slots);
  if (static_cast<unsigned>(it.src) - 1u >= ns - 1u || static_cast<unsigned>(it.cslot) - 1u >= ns - 1u)
    it.src = 0;
  return it;
}

// The thread's key columns in chunk c (0..3) of its rows: fp32 pages 4*(lane8 + 8c)..+3
// (16-byte chunks, a warp access covers 4 rows x 128 contiguous bytes); bf16 pages
// 8*(lane8 + 8*(c/2)) + 4*(c%2)..+3, so that chunks 2c', 2c'+1 are one 16-byte access of 8
// bf16 (again 4 rows x 128 contiguous bytes per warp access).
template <bool BF>
__device__ __forceinline__ int key_col(int lane8, int c) {
  return BF ? 8 * (lane8 + 8 * (c >> 1)) + 4 * (c & 1) : 4 * (lane8 + 8 * c);
}

// cp.async of the item's state page (64 KiB fp32 or 32 KiB bf16) into the thread's own staging
// chunks, 16 bytes each: [chunk][thread] (BF: sm.state is [8][256] uint4).
template <int T, bool FB, bool BF>
__device__ __forceinline__ void issue_state(const KdaParams& p, Smem<T, FB, BF>& sm, const Item& it,
                                            int tid_) {
  const int tid = opaque(tid_);  // keep the tid-only index math inside the item loop
  const int64_t off = static_cast<int64_t>(it.src) * p.state_slot + static_cast<int64_t>(it.h) * (kD * kD) +
                      (tid >> 3) * kD;
  if (BF) {
    const auto* base = static_cast<const __nv_bfloat16*>(p.state) + off + 8 * (tid & 7);
    uint4* st = reinterpret_cast<uint4*>(sm.state);
#pragma unroll
    for (int j = 0; j < 8; ++j)  // chunk (m, c') = (j/2, j%2): row tid/8 + 32m, columns key_col(c = 2c', 2c'+1)
      cp_async16(&st[j * kThreads + tid], base + (j >> 1) * 32 * kD + 64 * (j & 1));
  } else {
    const float* base = static_cast<const float*>(p.state) + off + 4 * (tid & 7);
#pragma unroll
    for (int j = 0; j < 16; ++j)  // chunk (m, c) = (j/4, j%4): row tid/8 + 32m, columns key_col(c)
      cp_async16(&sm.state[j * kThreads + tid], base + (j >> 2) * 32 * kD + 32 * (j & 3));
  }
}

// cp.async of the item's x (q|k|v slice), output-gate and f_a rows, T tokens.
template <int T, bool FB, bool BF>
__device__ __forceinline__ void issue_operands(const KdaParams& p, Smem<T, FB, BF>& sm, const Item& it,
                                               int tid_) {
  const int tid = opaque(tid_);  // keep the tid-only index math inside the item loop
  const int dim = p.num_heads * kD;
  const auto* x = opaque(static_cast<const __nv_bfloat16*>(p.x));
  const auto* og = opaque(static_cast<const __nv_bfloat16*>(p.output_gate));
  const auto* fa = opaque(static_cast<const __nv_bfloat16*>(p.f_a));
#pragma unroll
  for (int k = 0; k < (80 * T + kThreads - 1) / kThreads; ++k) {
    const int i = tid + k * kThreads;
    if (i >= 80 * T) break;
    const int t = i / 80, q = i - t * 80;
    const int seg = q >> 4, piece = (q & 15) * 8;
    const int64_t n = static_cast<int64_t>(it.r) * T + t;
    if (seg < 3) {
      cp_async16(&sm.x[t][seg * kD + piece], x + n * p.x_row + seg * dim + it.h * kD + piece);
    } else if (seg == 3) {
      cp_async16(&sm.og[t][piece], og + n * p.og_row + it.h * kD + piece);
    } else {
      cp_async16(&sm.fa[t][piece], fa + n * p.fa_row + piece);
    }
  }
}

// The same rows when x, output_gate or f_a is not 16-byte aligned (KdaParams.row_bytes < 16,
// e.g. an engine's packed projection with H % 8 != 0 heads): row_bytes-wide cp.async (8 or 4
// bytes, into the same group), or, for rows only 2-byte aligned, four element loads per
// 8-byte piece stored to shared memory, which the barriers before their readers publish as
// they do the copies. The staging layout is the 16-byte path's.
template <int T, bool FB, bool BF>
__device__ __forceinline__ void issue_operands_narrow(const KdaParams& p, Smem<T, FB, BF>& sm,
                                                      const Item& it, int tid_) {
  const int tid = opaque(tid_);
  const int dim = p.num_heads * kD;
  const auto* x = opaque(static_cast<const __nv_bfloat16*>(p.x));
  const auto* og = opaque(static_cast<const __nv_bfloat16*>(p.output_gate));
  const auto* fa = opaque(static_cast<const __nv_bfloat16*>(p.f_a));
  const int rb = p.row_bytes;         // 8, 4 or 2
  const int ew = rb == 4 ? 2 : 4;     // elements per piece
  const int per = kD / ew;            // pieces per 128-element row
  const int total = 5 * T * per;      // T tokens x (q, k, v, output gate, f_a) rows
#pragma unroll 1
  for (int i = tid; i < total; i += kThreads) {
    const int row = i / per, e = (i - row * per) * ew;
    const int t = row / 5, seg = row - t * 5;
    const int64_t n = static_cast<int64_t>(it.r) * T + t;
    const __nv_bfloat16* src;
    __nv_bfloat16* dst;
    if (seg < 3) {
      src = x + n * p.x_row + seg * dim + it.h * kD + e;
      dst = &sm.x[t][seg * kD + e];
    } else if (seg == 3) {
      src = og + n * p.og_row + it.h * kD + e;
      dst = &sm.og[t][e];
    } else {
      src = fa + n * p.fa_row + e;
      dst = &sm.fa[t][e];
    }
    if (rb == 8) {
      cp_async8(dst, src);
    } else if (rb == 4) {
      cp_async4(dst, src);
    } else {
      const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
      const uint32_t a = __ldg(s16), b = __ldg(s16 + 1), c = __ldg(s16 + 2), d = __ldg(s16 + 3);
      *reinterpret_cast<uint2*>(dst) = make_uint2(a | (b << 16), c | (d << 16));
    }
  }
}

// The item's x, output-gate and f_a rows by the build's path: 16-byte copies (V16, the rows
// 16-byte aligned) or the narrower ones above.
template <int T, bool FB, bool V16, bool BF>
__device__ __forceinline__ void issue_rows(const KdaParams& p, Smem<T, FB, BF>& sm, const Item& it,
                                           int tid) {
  if constexpr (V16) issue_operands<T>(p, sm, it, tid);
  else issue_operands_narrow<T>(p, sm, it, tid);
}

// cp.async of the item's conv history (positions off..off+2 of its 3 x 128 channels).
template <int T, bool FB, bool BF>
__device__ __forceinline__ void issue_window(const KdaParams& p, Smem<T, FB, BF>& sm, const Item& it,
                                             int tid_) {
  const int tid = opaque(tid_);
  const int dim = p.num_heads * kD;
  const char* base = opaque(static_cast<const char*>(p.conv_state)) + it.cslot * opaque(p.conv_slot_bytes);
  if (p.conv_chan == 1) {
    // SD: each (part, pos) is 128 contiguous channels = 16 (bf16) or 32 (fp32) chunks.
    auto sd = [&](auto per_c) {
      constexpr int per = decltype(per_c)::value;  // 16-byte chunks per (part, pos)
      constexpr int es = per / 8;
#pragma unroll 1
      for (int k = 0; k < (9 * per + kThreads - 1) / kThreads; ++k) {
        const int i = tid + k * kThreads;
        if (i >= 9 * per) break;
        const int pp = i / per, piece = i % per;
        const int part = pp / 3, pos = pp % 3;
        const char* src = base + (it.off + pos) * opaque(p.conv_pos_bytes) +
                          (part * dim + it.h * kD) * es + piece * 16;
        cp_async16(reinterpret_cast<char*>(sm.win) + i * 16, src);
      }
    };
    if (p.conv_state_fp32) sd(std::integral_constant<int, 32>());
    else sd(std::integral_constant<int, 16>());
  } else {
    // DS: channel rows are L contiguous elements, not 16-byte aligned: 4-byte words.
    const uint32_t* wbase = reinterpret_cast<const uint32_t*>(base);
    auto ds = [&](auto words_c) {
      constexpr int words = decltype(words_c)::value;  // 3 (fp32) or 2 (bf16) words per channel
#pragma unroll 1
      for (int k = 0; k < (3 * kD * words + kThreads - 1) / kThreads; ++k) {
        const int i = tid + k * kThreads;
        if (i >= 3 * kD * words) break;
        const int ch = i / words, wd = i % words;
        const int part = ch >> 7, d = ch & (kD - 1);
        const int64_t e0 = static_cast<int64_t>(part * dim + it.h * kD + d) * p.conv_chan + it.off;
        cp_async4(&sm.win[i], wbase + (words == 3 ? e0 : (e0 >> 1)) + wd);
      }
    };
    if (p.conv_state_fp32) ds(std::integral_constant<int, 3>());
    else ds(std::integral_constant<int, 2>());
  }
}

// cp.async of the head's conv taps, conv bias and dt_bias (L2-resident parameters); FB: also
// the head's 128 f_b rows (32 KiB, swizzled, see Smem::fb), and no conv bias (read from global).
template <int T, bool FB, bool BF>
__device__ __forceinline__ void issue_params(const KdaParams& p, Smem<T, FB, BF>& sm, int h, int tid_) {
  const int tid = opaque(tid_);
  const int dim = p.num_heads * kD;
  if (FB) {
    const uint4* fb = opaque(static_cast<const uint4*>(p.f_b)) + static_cast<int64_t>(h) * (kD * 16);
#pragma unroll
    for (int k = 0; k < kD * 16 / kThreads; ++k) {
      const int i = tid + k * kThreads, row = i >> 4, chunk = i & 15;
      cp_async16(&sm.fb[row * 16 + (chunk ^ ((row & 3) << 2))], fb + i);
    }
  }
  const char* cw = opaque(static_cast<const char*>(p.conv_weight));
  auto go = [&](auto es_c) {
    constexpr int es = decltype(es_c)::value;  // conv weight element size
    constexpr int per = 8 * es;                // 16-byte chunks per 128-channel row
    constexpr int nw = 12 * per;
    const int nb = (!FB && p.conv_bias) ? 3 * 32 : 0;
#pragma unroll 1
    for (int k = 0; k < (nw + 96 + 32 + kThreads - 1) / kThreads; ++k) {
      const int i = tid + k * kThreads;
      if (i >= nw + nb + 32) break;
      if (i < nw) {
        const int rowi = i / per, piece = i % per;  // rowi = part * 4 + tap
        cp_async16(reinterpret_cast<char*>(sm.cw) + i * 16,
                   cw + (static_cast<int64_t>(rowi) * dim + h * kD) * es + piece * 16);
      } else if (i < nw + nb) {
        const int j = i - nw, part = j >> 5, piece = j & 31;
        cp_async16(&sm.cbias[FB ? 0 : part][piece * 4], p.conv_bias + part * dim + h * kD + piece * 4);
      } else {
        const int piece = i - nw - nb;
        cp_async16(&sm.dtb[piece * 4], p.dt_bias + h * kD + piece * 4);
      }
    }
  };
  if (p.conv_weight_bf16) go(std::integral_constant<int, 2>());
  else go(std::integral_constant<int, 4>());
}

// Raw bits (bf16 in the low half) of the three history values of channel d of `part`.
template <int T, bool FB, bool BF>
__device__ __forceinline__ void read_window(const KdaParams& p, const Smem<T, FB, BF>& sm, const Item& it,
                                            int part, int d, uint32_t (&raw)[3]) {
  if (p.conv_chan == 1) {
    if (p.conv_state_fp32) {
#pragma unroll
      for (int e = 0; e < 3; ++e) raw[e] = sm.win[(part * 3 + e) * kD + d];
    } else {
      const uint16_t* w = reinterpret_cast<const uint16_t*>(sm.win);
#pragma unroll
      for (int e = 0; e < 3; ++e) raw[e] = w[(part * 3 + e) * kD + d];
    }
  } else if (p.conv_state_fp32) {
#pragma unroll
    for (int e = 0; e < 3; ++e) raw[e] = sm.win[(part * kD + d) * 3 + e];
  } else {
    const int dim = p.num_heads * kD;
    const int par = static_cast<int>(
        (static_cast<int64_t>(part * dim + it.h * kD + d) * p.conv_chan + it.off) & 1);
    const uint16_t* w = reinterpret_cast<const uint16_t*>(&sm.win[(part * kD + d) * 2]);
#pragma unroll
    for (int e = 0; e < 3; ++e) raw[e] = w[par + e];
  }
}

// cp.async of the 4-byte-aligned words holding beta[r*T + t, h] (any row stride). bf16 logits:
// the word's other half is a neighbouring element, or the 2 bytes after the tensor's last
// element (same aligned word, so never past a page or allocation granule); fp32 (activated)
// beta: the word is the element.
template <int T, bool FB, bool BF>
__device__ __forceinline__ void issue_beta(const KdaParams& p, Smem<T, FB, BF>& sm, const Item& it,
                                           int item, int tid) {
  if (tid < T) {
    const int64_t n = static_cast<int64_t>(it.r) * T + tid;
    const char* b = static_cast<const char*>(p.beta) +
                    (n * p.beta_row + it.h) * (p.beta_activated ? 4 : 2);
    cp_async4(&sm.beta_word[item & 1][tid],
              reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(b) & ~uintptr_t(3)));
  }
}
// beta of token t as staged: the bf16 logit's value, or the activated fp32 beta itself.
template <int T, bool FB, bool BF>
__device__ __forceinline__ float beta_value(const KdaParams& p, const Smem<T, FB, BF>& sm, const Item& it,
                                            int item, int t) {
  const uint32_t w = sm.beta_word[item & 1][t];
  if (p.beta_activated) return __uint_as_float(w);
  const int64_t n = static_cast<int64_t>(it.r) * T + t;
  const uintptr_t b = reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(p.beta) + n * p.beta_row + it.h);
  return bf2f(static_cast<uint16_t>((b & 2) ? (w >> 16) : (w & 0xffffu)));
}

// V16: the x / output-gate / f_a rows are 16-byte aligned (KdaParams.row_bytes == 16), staged
// with 16-byte copies; else the narrower path (issue_operands_narrow).
template <int T, bool FB, bool V16, bool BF>
__global__ void __launch_bounds__(kThreads, 2) kda_decode_kernel(const __grid_constant__ KdaParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem<T, FB, BF>& sm = *reinterpret_cast<Smem<T, FB, BF>*>(smem_raw);

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int H = p.num_heads;
  const int dim = H * kD;
  const int num_items = p.num_requests * H;
  const int G = gridDim.x;
  // CTA b walks the contiguous range [b*S1, (b+1)*S1), then takes every next item from the
  // atomic counter, whose items start at G*S1 (see the design note); S = 0 counts as S1 = 1
  // (the range is item b alone).
  const int S1 = max(p.static_items, 1);
  const int beg = static_cast<int>(blockIdx.x) * S1;

  if (tid == 0) {
    sm.item_end = num_items;
    sm.item_idx[0] = beg;
    sm.static_end = beg + S1;
  }
  if (tid < kD) {  // norm weight, shared by all heads
    // (its index through opaque(): otherwise ptxas keeps this store's shared-memory address
    // for the loop's [tid] accesses, a register held across the item loop that spills at T=8)
    const int i = opaque(tid);
    sm.nw[i] = p.norm_weight_bf16 ? bf2f(static_cast<const uint16_t*>(p.norm_weight)[i])
                                  : static_cast<const float*>(p.norm_weight)[i];
  }

  // ---- prologue: first item ----
  // Items are walked head-major (item = h * R + r): consecutive items of a CTA share the head,
  // so its conv taps / biases are staged once per head, and in the FB builds (T=1, BF) its f_b
  // rows too. (Otherwise the f_b fragments are re-read from L2 every item; the L1 hit rate
  // measured ~3%.)
  const int R = p.num_requests;
  // Everything below may read what the predecessor kernel wrote (slot ids, windows, pages,
  // operands): wait for it first.
  grid_dependency_wait();
  // The first slot row, by plain loads.
  {
    const int64_t row = static_cast<int64_t>(beg % R) * p.idx_row;
    if (tid < T) sm.slots[0][tid] = __ldcg(p.state_indices + row + tid);
    if (T > 1 && tid == kMaxT) sm.slots[0][8] = __ldcg(p.num_accepted + beg % R);
  }
  __syncthreads();
  {
    const Item first = item_at<T>(p, sm, 0, beg % R, beg / R);
    if (tid == 0) {
      sm.info[0] = first;
      sm.params_head = first.src > 0 ? first.h : -1;
    }
    if (first.src > 0) {
      issue_window<T>(p, sm, first, tid);
      issue_params<T>(p, sm, first.h, tid);
      cp_async_commit();
      issue_rows<T, FB, V16>(p, sm, first, tid);
      issue_beta<T>(p, sm, first, 0, tid);
      cp_async_commit();
      // The page last, in its own group, as in the loop (E then S): item 0's conv and gate
      // overlap its arrival, the loop waits for it before B2.
      issue_state<T>(p, sm, first, tid);
      cp_async_commit();
    }
    cp_async_wait<1>();  // everything of item 0 but its page
    __syncthreads();     // sm.info[0], sm.item_idx[0], item 0's operands
  }

  // n counts this CTA's iterations; its item's index is sm.item_idx[n & 1], (r, h) in
  // sm.info[n & 1]. Every buffer kept per item parity is kept per iteration parity.
  for (int n = 0; sm.item_idx[n & 1] < sm.item_end; ++n) {
    // cp.async groups: item n's operands (E) then its state page (S) were committed in that
    // order one iteration ago; wait for E only, so that the conv and gate below overlap the
    // page's arrival.
    cp_async_wait<1>();
    // The next item (the static range's next, then the counter's, by thread 0 for warp 0),
    // its index parked for everyone (read after B2), and its slot row (group L), needed when
    // it is prefetched below.
    if (warp == 0) {
      int nx = 0;
      if (lane == 0) {
        nx = sm.item_idx[n & 1] + 1;
        // (no counter when the static ranges hold every item, e.g. items <= CTAs: the
        // atomic's latency would only delay the next slot row; H200, R=8 T=1: 15.9 us
        // against 17.0 with the atomic)
        if (nx >= sm.static_end)
          nx = G * S1 >= sm.item_end ? sm.item_end : G * S1 + atomicAdd(p.sched, 1);
      }
      nx = __shfl_sync(0xffffffffu, nx, 0);
      if (lane == 0) sm.item_idx[(n + 1) & 1] = nx;
      if (nx < sm.item_end) issue_slots<T>(p, sm, n + 1, nx % R, tid);
    }
    cp_async_commit();
    // Item info lives in shared memory (written once per item by thread 0), not in registers.
#define CUR (sm.info[n & 1])
    // (re-read from shared memory where used: held in a register from here to the
    // recurrence, it spills in the bf16-state builds at T = 2..4)
#define LIVE (*reinterpret_cast<volatile const int*>(&CUR.src) > 0)
#define H_CUR (CUR.h)
#define ROW0 (static_cast<int64_t>(CUR.r) * T)  // first token row of the item
    auto* out = static_cast<__nv_bfloat16*>(p.out);

    if (!LIVE) {
      // Dead item: T rows of zeros, nothing else.
      if (tid < kD) {
#pragma unroll
        for (int t = 0; t < T; ++t) out[(ROW0 + t) * p.out_row + H_CUR * kD + tid] = __float2bfloat16_rn(0.f);
      }
    } else {
      // ---- f_b fragments of the head (L2), in flight across B1; the page itself is only
      // waited for before B2 ----
      const int d = tid & (kD - 1);
      const int g = lane >> 2, tig = lane & 3;
      const int feat0 = warp * 16 + g;  // gate features feat0 and feat0 + 8
      // The MMA's k index is permuted (identically for A = f_b and B = f_a): k-steps 2p and
      // 2p+1 cover the gate-rank columns [32p, 32p+32), and thread (g, tig) owns columns
      // 32p + 8tig .. +7 of that slice, so its A fragment is one 16-byte load per row and
      // k-step pair. The slices are exactly gate_mode 1's chains.
      // (FB: from the head's rows staged in shared memory, after B1; else from L2, in flight
      // across B1.)
      uint32_t afr[8][4];
      auto load_afr = [&]() {
        // (the global rows only without FB, which reads sm.fb below)
        const uint4* fb = FB ? nullptr : reinterpret_cast<const uint4*>(
            static_cast<const __nv_bfloat16*>(p.f_b) + static_cast<int64_t>(H_CUR * kD + feat0) * kD) + tig;
#pragma unroll
        for (int pp = 0; pp < 4; ++pp) {
          uint4 r0, r1;  // rows feat0, feat0 + 8 (same swizzle: feat0 + 8 = feat0 mod 4)
          if (FB) {
            const int ch = (4 * pp + tig) ^ ((feat0 & 3) << 2);
            r0 = sm.fb[feat0 * 16 + ch];
            r1 = sm.fb[(feat0 + 8) * 16 + ch];
          } else {
            r0 = __ldg(fb + 4 * pp);
            r1 = __ldg(fb + 4 * pp + 8 * kD / 8);
          }
          afr[2 * pp][0] = r0.x; afr[2 * pp][1] = r1.x; afr[2 * pp][2] = r0.y; afr[2 * pp][3] = r1.y;
          afr[2 * pp + 1][0] = r0.z; afr[2 * pp + 1][1] = r1.z;
          afr[2 * pp + 1][2] = r0.w; afr[2 * pp + 1][3] = r1.w;
        }
      };
      if (!FB) load_afr();
      if (tid < T) {
        const float b = beta_value<T>(p, sm, CUR, n, tid);
        sm.beta[tid] = p.beta_activated ? b : sigmoidf_fast(b);  // activated: used as it is
      }
      __syncthreads();  // B1: operands, window, parameters (FB: f_b rows), beta visible
      if (FB) load_afr();

      const bool rec = p.record != 0;
      // ---- gate projection on the tensor cores: rg[feat][token] ----
      {
        // gate_mode 0: one accumulator chain over the 8 k-steps. gate_mode 1: four chains over
        // k-steps {0,1}, {2,3}, {4,5}, {6,7}, computed one after another and summed in order,
        // ((c0 + c1) + c2) + c3.
        float tot[4] = {0.f, 0.f, 0.f, 0.f}, c[4] = {0.f, 0.f, 0.f, 0.f};
        const bool four = p.gate_mode != 0;
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          uint2 b = make_uint2(0u, 0u);
          if (g < T) b = *reinterpret_cast<const uint2*>(&sm.fa[g][32 * (ks >> 1) + 8 * tig + 4 * (ks & 1)]);
          mma_bf16(c, afr[ks], b.x, b.y);
          if (four && (ks & 1)) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              tot[j] = ks == 1 ? c[j] : tot[j] + c[j];
              c[j] = 0.f;
            }
          }
        }
        // The raw gate, rounded once to bf16, parks in sm.alpha; warps 4-7 turn it into the
        // decay after B2, one feature per thread.
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int tok = 2 * tig + (j & 1);
          if (tok < T) sm.alpha[tok][feat0 + (j >> 1) * 8] = bf16r(four ? tot[j] : c[j]);
        }
      }

      // ---- conv + SiLU (+ window write-back) ----
      {
        const int partA = (tid < kD) ? 0 : 2;
        float ssq[T];
#pragma unroll 1
        for (int pi = 0; pi < 2; ++pi) {
          if (pi == 1 && tid >= kD) break;
          const int part = pi == 0 ? partA : 1;
          float w[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int wi = (part * 4 + e) * kD + d;
            w[e] = p.conv_weight_bf16 ? bf2f(reinterpret_cast<const uint16_t*>(sm.cw)[wi])
                                      : __uint_as_float(sm.cw[wi]);
          }
          const float bias = !p.conv_bias ? 0.f
                             : FB ? __ldg(p.conv_bias + part * dim + H_CUR * kD + d) : sm.cbias[part][d];
          float s[T + 3];
          uint32_t hraw[3];
          read_window<T>(p, sm, CUR, part, d, hraw);
#pragma unroll
          for (int e = 0; e < 3; ++e)
            s[e] = p.conv_state_fp32 ? __uint_as_float(hraw[e]) : bf2f(static_cast<uint16_t>(hraw[e]));
#pragma unroll
          for (int t = 0; t < T; ++t) s[3 + t] = __bfloat162float(sm.x[t][part * kD + d]);
#pragma unroll
          for (int t = 0; t < T; ++t) {
            float acc = bias;
#pragma unroll
            for (int e = 0; e < 4; ++e) acc = fmaf(s[t + e], w[e], acc);
            const float y = bf16r(siluf_fast(acc));
            ssq[t] = y * y;
            if (part == 0) {
              sm.q[t][d] = y;
            } else if (part == 1) {
              sm.k[t][d] = y;
              if (rec) {
                auto* kg = static_cast<uint16_t*>(p.kg_record);
                kg[((static_cast<int64_t>(CUR.cslot) * H + H_CUR) * T + t) * (2 * kD) + d] =
                    f2bf_raw(y);
              }
            } else {
              sm.v[t][d] = y;
            }
          }
          if (part < 2) {
#pragma unroll
            for (int t = 0; t < T; ++t) {
              const float sum = warp_sum(ssq[t]);
              if (lane == 0) sm.red[t][warp][part] = sum;
            }
          }
          // Window rewrite from position 0: w1, w2, x_0..x_{T-1} (raw bits, cache dtype).
          const int64_t ch = static_cast<int64_t>(CUR.cslot) * p.conv_slot +
                             static_cast<int64_t>(part * dim + H_CUR * kD + d) * p.conv_chan;
          if (p.conv_state_fp32) {
            uint32_t* cs = static_cast<uint32_t*>(p.conv_state);
            cs[ch] = hraw[1];
            cs[ch + p.conv_pos] = hraw[2];
#pragma unroll
            for (int t = 0; t < T; ++t) cs[ch + (2 + t) * p.conv_pos] = __float_as_uint(s[3 + t]);
          } else {
            uint16_t* cs = static_cast<uint16_t*>(p.conv_state);
            cs[ch] = static_cast<uint16_t>(hraw[1]);
            cs[ch + p.conv_pos] = static_cast<uint16_t>(hraw[2]);
#pragma unroll
            for (int t = 0; t < T; ++t)
              cs[ch + (2 + t) * p.conv_pos] = __bfloat16_as_ushort(sm.x[t][part * kD + d]);
          }
        }
      }
      if (tid < kD) {
#pragma unroll
        for (int t = 0; t < T; ++t) sm.ogs[t][tid] = sigmoidf_fast(__bfloat162float(sm.og[t][tid]));
      }
      if (tid < T) {
        const Item it = CUR;
        long long wo;
        if (rec) {
          wo = ((static_cast<long long>(it.cslot) * H + it.h) * T + tid) * kD;
        } else {
          const int ws = T == 1 ? it.src : sm.slots[n & 1][tid];
          const bool ok = static_cast<unsigned>(ws) - 1u < static_cast<unsigned>(p.num_slots) - 1u;
          wo = ok ? static_cast<long long>(ws) * p.state_slot + static_cast<long long>(it.h) * (kD * kD) : -1;
        }
        sm.woff[tid] = wo;
      }
    }
    // Warps 4-7 own gate feature tid-128 after B2; its dt_bias is read now, before item n+1's
    // parameters may overwrite sm.dtb.
    const float dtb_f = (LIVE && tid >= kD) ? sm.dtb[tid - kD] : 0.f;
    cp_async_wait<0>();  // item n's state page (S) and item n+1's slot row (L)
    __syncthreads();     // B2: conv outputs, partial sums, raw gate visible; slots of n+1 visible

    // ---- prefetch item n+1, part E: operands, window, parameters, beta (their buffers are
    // free: the conv and gate are done). Issued before the page moves into registers. ----
    const int nx = sm.item_idx[(n + 1) & 1];
    const Item nxt = item_at<T>(p, sm, n + 1, nx % R, nx / R);
    const bool next_live = nx < sm.item_end && nxt.src > 0;
    const bool new_head = nxt.h != sm.params_head;  // params in smem belong to params_head
    if (tid == 0) sm.info[(n + 1) & 1] = nxt;       // read after B3 (no reader of this parity now)
    if (next_live) {
      issue_rows<T, FB, V16>(p, sm, nxt, tid);
      issue_window<T>(p, sm, nxt, tid);
      if (new_head) issue_params<T>(p, sm, nxt.h, tid);
      issue_beta<T>(p, sm, nxt, n + 1, tid);
      cp_async_commit();
    }

    float4 S[4][4];  // [m][c]: row tid/8 + 32m, columns key_col<BF>(tid%8, c)..+3
    // ---- state page: staging -> registers (each thread reads only the chunks it copied; bf16
    // widened to fp32 exactly) ----
    if (LIVE) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        if (BF) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 w = reinterpret_cast<const uint4*>(sm.state)[(m * 2 + h) * kThreads + tid];
            S[m][2 * h] = make_float4(bf2f(w.x & 0xffffu), bf2f(w.x >> 16), bf2f(w.y & 0xffffu), bf2f(w.y >> 16));
            S[m][2 * h + 1] = make_float4(bf2f(w.z & 0xffffu), bf2f(w.z >> 16), bf2f(w.w & 0xffffu), bf2f(w.w >> 16));
          }
        } else {
#pragma unroll
          for (int c = 0; c < 4; ++c) S[m][c] = sm.state[(m * 4 + c) * kThreads + tid];
        }
      }
    }
    // ---- prefetch item n+1, part S: the state page, each thread into the chunks it has just
    // read itself (so no barrier before), and before the norms and the decay below, so that
    // the page is in flight for their duration too ----
    if (next_live) {
      issue_state<T>(p, sm, nxt, tid);
      cp_async_commit();
    }
    if (LIVE) {
      if (tid < kD) {
        // ---- warps 0-3: L2 norm of q (with scale) and k, in place ----
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const float sq = ((sm.red[t][0][0] + sm.red[t][1][0]) + sm.red[t][2][0]) + sm.red[t][3][0];
          const float sk = ((sm.red[t][0][1] + sm.red[t][1][1]) + sm.red[t][2][1]) + sm.red[t][3][1];
          sm.q[t][tid] = (sm.q[t][tid] * rsqrtf(sq + 1e-6f)) * p.scale;
          sm.k[t][tid] = sm.k[t][tid] * rsqrtf(sk + 1e-6f);
        }
      } else {
        // ---- warps 4-7: decay of gate feature f from the raw gate, in place ----
        // Accurate expf / log1pf / division (no fast intrinsics): alpha is not rounded to
        // bf16 and multiplies every state element, so it must agree with the reference bit
        // for bit where the decay is exactly 1.
        const int f = tid - kD;
        const float A = expf(p.A_log[H_CUR]);
#pragma unroll 1
        for (int t = 0; t < T; ++t) {
          const float rg = sm.alpha[t][f];
          const float xg = rg + dtb_f;
          float gk;
          if (p.bounded_gate) {
            gk = p.lower_bound * (1.0f / (1.0f + expf(-(A * xg))));
          } else {
            gk = -A * (xg > 20.f ? xg : log1pf(expf(xg)));
          }
          sm.alpha[t][f] = expf(gk);
          if (p.record) {
            auto* kg = static_cast<uint16_t*>(p.kg_record);
            kg[((static_cast<int64_t>(CUR.cslot) * H + H_CUR) * T + t) * (2 * kD) + kD + f] = f2bf_raw(rg);
          }
        }
      }
    }
    __syncthreads();  // B3: normalised q, k, alpha visible
    if (tid == 0 && next_live) sm.params_head = nxt.h;  // all threads read it before B3

    if (LIVE) {
      // ---- recurrence ----
      const int row0 = tid >> 3, lane8 = tid & 7;
      const bool rec = p.record != 0;
#pragma unroll 1
      for (int t = 0; t < T; ++t) {
        // Row dot products: in-thread over two partial sums per row (x,z and y,w components,
        // chunks in order), combined p0 + p1, then across the row's 8 lanes (xor 1, 2, 4).
        float a[4][2];
#pragma unroll
        for (int m = 0; m < 4; ++m) a[m][0] = a[m][1] = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = key_col<BF>(lane8, c);
          const float4 al = *reinterpret_cast<const float4*>(&sm.alpha[t][col]);
          const float4 kk = *reinterpret_cast<const float4*>(&sm.k[t][col]);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            float4& s = S[m][c];
            s.x *= al.x; s.y *= al.y; s.z *= al.z; s.w *= al.w;
            a[m][0] = fmaf(s.x, kk.x, a[m][0]);
            a[m][1] = fmaf(s.y, kk.y, a[m][1]);
            a[m][0] = fmaf(s.z, kk.z, a[m][0]);
            a[m][1] = fmaf(s.w, kk.w, a[m][1]);
          }
        }
        const float bt = sm.beta[t];
        float u[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          float sk = a[m][0] + a[m][1];
          sk += __shfl_xor_sync(0xffffffffu, sk, 1);
          sk += __shfl_xor_sync(0xffffffffu, sk, 2);
          sk += __shfl_xor_sync(0xffffffffu, sk, 4);
          u[m] = bt * (sm.v[t][row0 + 32 * m] - sk);
          a[m][0] = a[m][1] = 0.f;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = key_col<BF>(lane8, c);
          const float4 kk = *reinterpret_cast<const float4*>(&sm.k[t][col]);
          const float4 qq = *reinterpret_cast<const float4*>(&sm.q[t][col]);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            float4& s = S[m][c];
            s.x = fmaf(u[m], kk.x, s.x);
            s.y = fmaf(u[m], kk.y, s.y);
            s.z = fmaf(u[m], kk.z, s.z);
            s.w = fmaf(u[m], kk.w, s.w);
            a[m][0] = fmaf(s.x, qq.x, a[m][0]);
            a[m][1] = fmaf(s.y, qq.y, a[m][1]);
            a[m][0] = fmaf(s.z, qq.z, a[m][0]);
            a[m][1] = fmaf(s.w, qq.w, a[m][1]);
          }
        }
        // The gated RMSNorm's sum of bf16(o)^2 is formed here, so that the epilogue needs one
        // barrier (B4): over this thread's 4 rows (every lane of a row holds the same o), then
        // over the warp's 4 rows (lanes 0, 8, 16, 24); one partial per warp in sm.red (free
        // since B3: the q/k partial sums were read before it). On the H200 0.3-1.1% faster
        // than sums formed in the epilogue behind a second barrier (R = 32 / 128 / 512, T = 1
        // and 5).
        float osq = 0.f;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          float o = a[m][0] + a[m][1];
          o += __shfl_xor_sync(0xffffffffu, o, 1);
          o += __shfl_xor_sync(0xffffffffu, o, 2);
          o += __shfl_xor_sync(0xffffffffu, o, 4);
          if (lane8 == 0) {
            sm.o[t][row0 + 32 * m] = o;
            if (rec) p.v_record[sm.woff[t] + row0 + 32 * m] = u[m];
          }
          const float ob = bf16r(o);
          osq = fmaf(ob, ob, osq);
        }
        osq += __shfl_xor_sync(0xffffffffu, osq, 8);
        osq += __shfl_xor_sync(0xffffffffu, osq, 16);
        if (lane == 0) (&sm.red[t][0][0])[warp] = osq;
        // State after token t (T=1: to the source slot; T>1: to state_indices[r, t], skipped
        // where that id is not in (0, slots)); record mode writes no state. Each fp32 warp
        // store covers 4 rows x 128 contiguous bytes.
        const long long wo = sm.woff[t];
        if (!rec && wo >= 0) {
          if (BF) {  // rounded once to nearest even, 4 bf16 per 8-byte store (a warp store
                     // covers half of each of 4 rows' 128-byte segments)
            auto* base = static_cast<__nv_bfloat16*>(p.state) + wo + row0 * kD + 8 * lane8;
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
              for (int c = 0; c < 4; ++c)
                *reinterpret_cast<uint2*>(base + m * 32 * kD + 64 * (c >> 1) + 4 * (c & 1)) =
                    make_uint2(pack_bf16(S[m][c].x, S[m][c].y), pack_bf16(S[m][c].z, S[m][c].w));
          } else {
            float* base = static_cast<float*>(p.state) + wo + row0 * kD + 4 * lane8;
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
              for (int c = 0; c < 4; ++c)
                *reinterpret_cast<float4*>(base + m * 32 * kD + 32 * c) = S[m][c];
          }
        }
      }
      __syncthreads();  // B4: o and the 8 warps' sums of squares complete

      // ---- epilogue: gated RMSNorm over the 128 o values of each token ----
      if (tid < kD) {
        const float* red = &sm.red[0][0][0];
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const float ob = bf16r(sm.o[t][tid]);
          const float* r8 = red + t * 8;
          const float tot = ((r8[0] + r8[1]) + (r8[2] + r8[3])) + ((r8[4] + r8[5]) + (r8[6] + r8[7]));
          const float rstd = rsqrtf(tot * (1.0f / kD) + p.norm_eps);
          const float y = ((ob * rstd) * sm.nw[tid]) * sm.ogs[t][tid];
          out[(ROW0 + t) * p.out_row + H_CUR * kD + tid] = __float2bfloat16_rn(y);
        }
      }
    }
#undef LIVE
#undef CUR
#undef H_CUR
#undef ROW0
  }

  // The last CTA to finish (it took its last item after every other CTA took theirs) leaves
  // both counters at zero for the next launch, which reads them only after its
  // griddepcontrol.wait.
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(p.sched + 1, 1) == G - 1) {
      p.sched[0] = 0;
      p.sched[1] = 0;
    }
  }
  // Dependents may be scheduled once every CTA got here (they read nothing we write before
  // their griddepcontrol.wait, which waits for this whole grid and its memory).
  __threadfence();
  trigger_dependents();
}

template <int T, bool FB, bool V16, bool BF>
cudaError_t launch_t(const KdaParams& p, cudaStream_t stream) {
  constexpr size_t smem = sizeof(Smem<T, FB, BF>);
  static_assert(smem <= 113 * 1024, "two CTAs per SM must fit");
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;

  // Per device: raise the dynamic smem limit once, and size the persistent grid.
  constexpr int kMaxDev = 64;
  static std::once_flag once[kMaxDev];
  static int ctas[kMaxDev];
  static cudaError_t init_err[kMaxDev];
  if (dev >= kMaxDev) return cudaErrorInvalidDevice;
  std::call_once(once[dev], [&] {
    init_err[dev] = cudaFuncSetAttribute(kda_decode_kernel<T, FB, V16, BF>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    int sms = 0, per_sm = 0;
    if (init_err[dev] == cudaSuccess)
      init_err[dev] = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (init_err[dev] == cudaSuccess)
      init_err[dev] = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kda_decode_kernel<T, FB, V16, BF>,
                                                                    kThreads, smem);
    ctas[dev] = sms * (per_sm > 0 ? per_sm : 1);
  });
  if (init_err[dev] != cudaSuccess) return init_err[dev];

  const int64_t items = static_cast<int64_t>(p.num_requests) * p.num_heads;
  if (items <= 0) return cudaSuccess;
  const int64_t grid = items < ctas[dev] ? items : ctas[dev];  // persistent: the resident CTAs
  KdaParams q = p;
  q.static_items = kda_decode_static_items(items, grid, p.static_fraction);

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kda_decode_kernel<T, FB, V16, BF>, q);
}

// The build of a T for the rows and the state dtype: 16-byte aligned rows take the 16-byte
// staging, others the narrow one; f_b rows in shared memory at T=1 and with bf16 pages (whose
// staging is 32 KiB smaller), else from L2.
template <int T>
cudaError_t launch_build(const KdaParams& p, cudaStream_t stream) {
  constexpr bool FB32 = T == 1;
  if (p.state_bf16)
    return p.row_bytes == 16 ? launch_t<T, true, true, true>(p, stream) : launch_t<T, true, false, true>(p, stream);
  return p.row_bytes == 16 ? launch_t<T, FB32, true, false>(p, stream) : launch_t<T, FB32, false, false>(p, stream);
}

// (T, fb_smem, state_bf16) of the builds (see launch_build)
constexpr bool has_build(int T, int fb_smem, int state_bf16) {
  return fb_smem == ((T == 1 || state_bf16) ? 1 : 0) && T >= 1 && T <= kMaxT;
}

template <int T>
size_t smem_bytes(int state_bf16) {
  return state_bf16 ? sizeof(Smem<T, true, true>) : sizeof(Smem<T, T == 1, false>);
}

}  // namespace

extern "C" cudaError_t kda_decode_launch(const KdaParams* params, cudaStream_t stream) {
  KdaParams q = *params;
  const int64_t es = q.conv_state_fp32 ? 4 : 2;
  q.conv_slot_bytes = q.conv_slot * es;
  q.conv_pos_bytes = q.conv_pos * es;
  const KdaParams* p = &q;
  if (p->num_heads < 1 || p->num_requests < 0 || p->window < p->T + 2) return cudaErrorInvalidValue;
  if (static_cast<int64_t>(p->num_requests) * p->num_heads > INT32_MAX) return cudaErrorInvalidValue;
  if (p->T > 1 && p->num_accepted == nullptr) return cudaErrorInvalidValue;
  if (p->sched == nullptr) return cudaErrorInvalidValue;
  if (!(p->static_fraction >= 0.f && p->static_fraction <= 1.f)) return cudaErrorInvalidValue;
  if (!has_build(p->T, p->fb_smem, p->state_bf16 != 0)) return cudaErrorInvalidValue;  // no such build
  if (p->record && (p->v_record == nullptr || p->kg_record == nullptr)) return cudaErrorInvalidValue;
  if (p->row_bytes != 16 && p->row_bytes != 8 && p->row_bytes != 4 && p->row_bytes != 2)
    return cudaErrorInvalidValue;
  switch (p->T) {
    case 1: return launch_build<1>(*p, stream);
    case 2: return launch_build<2>(*p, stream);
    case 3: return launch_build<3>(*p, stream);
    case 4: return launch_build<4>(*p, stream);
    case 5: return launch_build<5>(*p, stream);
    case 6: return launch_build<6>(*p, stream);
    case 7: return launch_build<7>(*p, stream);
    case 8: return launch_build<8>(*p, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" size_t kda_decode_smem_bytes(int T, int fb_smem, int state_bf16) {
  if (!has_build(T, fb_smem, state_bf16 != 0)) return 0;
  switch (T) {
    case 1: return smem_bytes<1>(state_bf16);
    case 2: return smem_bytes<2>(state_bf16);
    case 3: return smem_bytes<3>(state_bf16);
    case 4: return smem_bytes<4>(state_bf16);
    case 5: return smem_bytes<5>(state_bf16);
    case 6: return smem_bytes<6>(state_bf16);
    case 7: return smem_bytes<7>(state_bf16);
    case 8: return smem_bytes<8>(state_bf16);
    default: return 0;
  }
}

extern "C" int kda_decode_threads(void) { return kThreads; }

extern "C" int kda_decode_static_items(long long items, long long ctas, float static_fraction) {
  if (ctas < 1 || items < 1) return 0;
  return static_cast<int>(static_cast<double>(static_fraction) * static_cast<double>(items) /
                          static_cast<double>(ctas));
}
