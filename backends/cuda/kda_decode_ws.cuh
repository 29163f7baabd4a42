// EXPERIMENT (KDA_CUDA_WS=1 builds, -DKDA_WS): a warp-specialised T=1 kernel. Included by
// kda_decode.cu inside its anonymous namespace; uses that file's helpers and Smem<1, true>.
//
// One CTA per SM, 512 threads. Threads 0-255 ("prep") run, for item j, exactly the current
// kernel's per-item phases up to B3 (gate MMA from the staged f_b rows, conv + SiLU + window
// write-back, sigmoid(output gate), q/k L2 norms, decay), on the same thread mapping, with
// 256-thread named barriers in place of __syncthreads, then hand q-hat, k-hat, alpha, v, beta,
// sigmoid(og) and the write offset to the math warps through a double-buffered hand-off area.
// Threads 256-511 ("math") hold item n's page in registers (the same layout as the current
// kernel), request item n+2's page into the staging buffer it just left (two 64 KiB buffers),
// run the recurrence and its 16-byte state stores, and the gated RMSNorm epilogue. So item
// n+1's prep runs while item n's page is written back: the per-item chain of the current
// kernel (top to B3, ~3.4 us of ~9.5 at R=128 T=1, e7ad006's trace) leaves the critical path.
//
// Hand-off: named barriers FULL[s] (prep arrives after writing hand[s], math syncs) and
// EMPTY[s] (math arrives when done with hand[s], prep syncs before rewriting it), s = item
// parity; strict alternation per barrier id holds because each side waits on the other
// between two of its arrivals.

constexpr int kWsThreads = 2 * kThreads;
constexpr int kBarPrep = 1, kBarMath = 2, kBarFull = 3, kBarEmpty = 5;

__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// Trace builds (KDA_TRACE): clock64 of item n's point k, in the base kernel's trace layout
// (tools/bench/cuda_trace.py) but with other points: prep (thread 0) 0 its operands arrived,
// 1 B1, 2 B2, 3 handed over; math (thread 256) 4 hand-off received, 5 page in registers and
// the next one requested, 6 stores issued, 7 hand-off area released.
#ifdef KDA_TRACE
#define WS_STAMP(n, k, who)                                                                    \
  do {                                                                                         \
    if (p.trace != nullptr && tid == (who) && blockIdx.x < kTraceCtas && (n) < kTraceItems)   \
      p.trace[static_cast<int64_t>(blockIdx.x) * kTraceStride + 8 + kTracePoints * (n) + (k)] = clock64(); \
  } while (0)
#else
#define WS_STAMP(n, k, who) \
  do {                      \
  } while (0)
#endif

struct __align__(16) WsHand {
  float q[kD], k[kD], alpha[kD], v[kD], ogs[kD], o[kD];
  float red[8];
  long long woff;
  float beta;
  int r, h, live, done, next_ok;
  Item next;  // the item whose page the math warps request now (two ahead)
};

// Item operands (x, output gate, f_a rows, conv window, beta words), double-buffered by item
// parity so that item j+1's are requested at the top of item j.
struct __align__(16) WsOps {
  __nv_bfloat16 x[1][3 * kD];
  __nv_bfloat16 og[1][kD];
  __nv_bfloat16 fa[1][kFaStride];
  uint32_t win[3 * 3 * kD];
  uint32_t beta_word[2][kMaxT];
};

struct __align__(16) WsSmem {
  Smem<1, true> s;               // prep's workspace (its x / og / fa / win unused); s.state is page buffer 0
  WsOps ops[3];                  // item j's operands in ops[j % 3], requested at the top of item j-2
  float4 page1[16 * kThreads];   // page buffer 1
  WsHand hand[2];
  int idx[8];                    // item index of iteration j (by j & 7), taken 5 ahead
  int slot[8];                   // its state slot id (T=1), requested 5 ahead
  Item info[8];                  // its item, derived 3 ahead
};

// Item from its index and slot id (T=1): dead (src = 0) unless the id is in (0, slots).
__device__ __forceinline__ Item ws_item(const KdaParams& p, int idx, int slot) {
  Item it;
  it.r = idx % p.num_requests;
  it.h = idx / p.num_requests;
  it.src = it.cslot = slot;
  it.off = 0;
  if (static_cast<unsigned>(slot) - 1u >= static_cast<unsigned>(p.num_slots) - 1u) it.src = 0;
  return it;
}

__global__ void __launch_bounds__(kWsThreads, 1) kda_decode_ws_kernel(const __grid_constant__ KdaParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  WsSmem& W = *reinterpret_cast<WsSmem*>(smem_raw);
  Smem<1, true>& sm = W.s;
  constexpr int T = 1;
  const int tid = threadIdx.x;
  TRACE(0, global_timer());
  TRACE(3, clock64());
  const int H = p.num_heads, R = p.num_requests;
  const int dim = H * kD;
  const int num_items = R * H;
  const int G = gridDim.x;
  const bool dynamic = p.sched != nullptr;
  const int S1 = max(p.static_items, 1);
  const int beg = dynamic ? static_cast<int>(blockIdx.x) * S1
                          : static_cast<int>((static_cast<int64_t>(blockIdx.x) * num_items) / G);
  const int end = dynamic ? num_items
                          : static_cast<int>((static_cast<int64_t>(blockIdx.x + 1) * num_items) / G);
  const int static_end = dynamic ? beg + S1 : end;
  auto next_index = [&](int cur) {
    int nx = cur + 1;
    if (dynamic && nx >= static_end) nx = G * S1 >= end ? end : G * S1 + atomicAdd(p.sched, 1);
    return nx;
  };

  if (tid < kD) {
    sm.nw[tid] = p.norm_weight_bf16 ? bf2f(static_cast<const uint16_t*>(p.norm_weight)[tid])
                                    : static_cast<const float*>(p.norm_weight)[tid];
  }
  grid_dependency_wait();
  TRACE(4, clock64());
  if (p.early_trigger) trigger_dependents();
  if (tid == 0) {
    // items 0..4 of this CTA; the slot ids of 0..2 now, of 3 and 4 with item 0's operands
    int i = beg;
    for (int k = 0; k < 5; ++k) {
      W.idx[k] = i;
      if (k < 3) {
        const int sl = i < end ? __ldcg(p.state_indices + static_cast<int64_t>(i % R) * p.idx_row) : 0;
        W.info[k] = ws_item(p, i < end ? i : 0, sl);
      } else if (i < end) {
        cp_async4(&W.slot[k], p.state_indices + static_cast<int64_t>(i % R) * p.idx_row);
      }
      i = i < end ? next_index(i) : end;
    }
  }
  __syncthreads();
  TRACE(5, clock64());

  if (tid >= kThreads) {
    // ================= math warps =================
    const int mtid = tid - kThreads;
    const int row0 = mtid >> 3, lane8 = mtid & 7, mwarp = mtid >> 5, lane = mtid & 31;
    auto issue_page = [&](float4* buf, const Item& it) {
      const float* base = p.state + static_cast<int64_t>(it.src) * p.state_slot +
                          static_cast<int64_t>(it.h) * (kD * kD) + row0 * kD + 4 * lane8;
#pragma unroll
      for (int j = 0; j < 16; ++j) cp_async16(&buf[j * kThreads + mtid], base + (j >> 2) * 32 * kD + 32 * (j & 3));
    };
    {
      const Item a = W.info[0], b = W.info[1];
      if (a.src > 0) issue_page(sm.state, a);
      cp_async_commit();
      if (W.idx[1] < end && b.src > 0) issue_page(W.page1, b);
      cp_async_commit();
    }
    named_arrive(kBarEmpty + 0, kWsThreads);
    named_arrive(kBarEmpty + 1, kWsThreads);
    auto* out = static_cast<__nv_bfloat16*>(p.out);
    const bool rec = p.record != 0;
    for (int n = 0;; ++n) {
      named_sync(kBarFull + (n & 1), kWsThreads);
      WsHand& hd = W.hand[n & 1];
      if (hd.done) break;
      WS_STAMP(n, 4, kThreads);
      float4* buf = (n & 1) ? W.page1 : sm.state;
      cp_async_wait<1>();  // page n (page n+1 may still be in flight)
      const bool live = hd.live != 0;
      float4 S[4][4];
      if (live) {
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
          for (int c = 0; c < 4; ++c) S[m][c] = buf[(m * 4 + c) * kThreads + mtid];
      }
      if (hd.next_ok) issue_page(buf, hd.next);
      cp_async_commit();
      WS_STAMP(n, 5, kThreads);
      if (live) {
        float a[4][2];
#pragma unroll
        for (int m = 0; m < 4; ++m) a[m][0] = a[m][1] = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = 4 * (lane8 + 8 * c);
          const float4 al = *reinterpret_cast<const float4*>(&hd.alpha[col]);
          const float4 kk = *reinterpret_cast<const float4*>(&hd.k[col]);
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
        const float bt = hd.beta;
        float u[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          float sk = a[m][0] + a[m][1];
          sk += __shfl_xor_sync(0xffffffffu, sk, 1);
          sk += __shfl_xor_sync(0xffffffffu, sk, 2);
          sk += __shfl_xor_sync(0xffffffffu, sk, 4);
          u[m] = bt * (hd.v[row0 + 32 * m] - sk);
          a[m][0] = a[m][1] = 0.f;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = 4 * (lane8 + 8 * c);
          const float4 kk = *reinterpret_cast<const float4*>(&hd.k[col]);
          const float4 qq = *reinterpret_cast<const float4*>(&hd.q[col]);
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
        const long long wo = hd.woff;
        float osq = 0.f;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          float o = a[m][0] + a[m][1];
          o += __shfl_xor_sync(0xffffffffu, o, 1);
          o += __shfl_xor_sync(0xffffffffu, o, 2);
          o += __shfl_xor_sync(0xffffffffu, o, 4);
          if (lane8 == 0) {
            hd.o[row0 + 32 * m] = o;
            if (rec) p.v_record[wo + row0 + 32 * m] = u[m];
          }
          const float ob = bf16r(o);
          osq = fmaf(ob, ob, osq);
        }
        osq += __shfl_xor_sync(0xffffffffu, osq, 8);
        osq += __shfl_xor_sync(0xffffffffu, osq, 16);
        if (lane == 0) hd.red[mwarp] = osq;
        if (!rec && wo >= 0) {
          float* base = p.state + wo + row0 * kD + 4 * lane8;
#pragma unroll
          for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int c = 0; c < 4; ++c) *reinterpret_cast<float4*>(base + m * 32 * kD + 32 * c) = S[m][c];
        }
      }
      WS_STAMP(n, 6, kThreads);
      named_sync(kBarMath, kThreads);  // o and the sums of squares complete
      if (live && mtid < kD) {
        const float* r8 = hd.red;
        const float ob = bf16r(hd.o[mtid]);
        const float tot = ((r8[0] + r8[1]) + (r8[2] + r8[3])) + ((r8[4] + r8[5]) + (r8[6] + r8[7]));
        const float rstd = rsqrtf(tot * (1.0f / kD) + p.norm_eps);
        const float y = ((ob * rstd) * sm.nw[mtid]) * hd.ogs[mtid];
        out[static_cast<int64_t>(hd.r) * p.out_row + hd.h * kD + mtid] = __float2bfloat16_rn(y);
      }
      named_arrive(kBarEmpty + (n & 1), kWsThreads);
      WS_STAMP(n, 7, kThreads);
    }
  } else {
    // ================= prep warps (the current kernel's phases, T=1, f_b staged) =================
    const int warp = tid >> 5, lane = tid & 31;
    {
      const Item first = W.info[0];
      if (tid == 0) sm.params_head = first.src > 0 ? first.h : -1;
      if (first.src > 0) {
        issue_window<T>(p, W.ops[0], first, tid);
        issue_params<T>(p, sm, first.h, tid);
        issue_operands<T>(p, W.ops[0], first, tid);
        issue_beta<T>(p, W.ops[0], first, 0, tid);
      }
      const Item second = W.info[1];
      if (W.idx[1] < end && second.src > 0) {
        issue_window<T>(p, W.ops[1], second, tid);
        issue_operands<T>(p, W.ops[1], second, tid);
        issue_beta<T>(p, W.ops[1], second, 1, tid);
      }
      cp_async_commit();
    }
    // cp.async groups of the prep threads, in commit order: A_j at the top of item j (item
    // j+2's operands, item j+5's slot id), P_j after B2 of item j, only when item j+1 has a
    // new head (its parameters). The top of item j needs A_{j-2} and P_{j-1}: it leaves A_{j-1}
    // in flight unless P_{j-1} was committed after it.
    bool p_pending = true;  // the prologue's group
    auto* out = static_cast<__nv_bfloat16*>(p.out);
    const bool rec = p.record != 0;
    for (int j = 0;; ++j) {
      WsHand& hd = W.hand[j & 1];
      if (W.idx[j & 7] >= end) {
        named_sync(kBarEmpty + (j & 1), kWsThreads);
        if (tid == 0) hd.done = 1;
        named_arrive(kBarFull + (j & 1), kWsThreads);
        break;
      }
      if (p_pending) cp_async_wait<0>();
      else cp_async_wait<1>();  // item j's operands, window, beta (A_{j-2}), parameters
      WS_STAMP(j, 0, 0);
      TRACE(7, j + 1);
      // A_j: item j+5's index (static: the range's next; dynamic: the counter) and slot id,
      // item j+2's operands.
      if (tid == 0) {
        const int i4 = W.idx[(j + 4) & 7];
        const int nx = i4 < end ? next_index(i4) : end;
        W.idx[(j + 5) & 7] = nx;
        if (nx < end) cp_async4(&W.slot[(j + 5) & 7], p.state_indices + static_cast<int64_t>(nx % R) * p.idx_row);
      }
      {
        const Item n2 = W.info[(j + 2) & 7];
        if (W.idx[(j + 2) & 7] < end && n2.src > 0) {
          WsOps& nop = W.ops[(j + 2) % 3];
          issue_operands<T>(p, nop, n2, tid);
          issue_window<T>(p, nop, n2, tid);
          issue_beta<T>(p, nop, n2, j + 2, tid);
        }
      }
      cp_async_commit();
      WsOps& op = W.ops[j % 3];
#define CUR (W.info[j & 7])
#define H_CUR (CUR.h)
      const bool live = CUR.src > 0;
      if (!live) {
        if (tid < kD) out[static_cast<int64_t>(CUR.r) * p.out_row + H_CUR * kD + tid] = __float2bfloat16_rn(0.f);
      } else {
        const int d = tid & (kD - 1);
        const int g = lane >> 2, tig = lane & 3;
        const int feat0 = warp * 16 + g;
        if (tid == 0) sm.beta[0] = sigmoidf_fast(beta_value<T>(p, op, CUR, j, 0));
        named_sync(kBarPrep, kThreads);  // B1: operands, window, parameters, f_b rows, beta
        WS_STAMP(j, 1, 0);
        uint32_t afr[8][4];
#pragma unroll
        for (int pp = 0; pp < 4; ++pp) {
          const int ch = (4 * pp + tig) ^ ((feat0 & 3) << 2);
          const uint4 r0 = sm.fb[feat0 * 16 + ch];
          const uint4 r1 = sm.fb[(feat0 + 8) * 16 + ch];
          afr[2 * pp][0] = r0.x; afr[2 * pp][1] = r1.x; afr[2 * pp][2] = r0.y; afr[2 * pp][3] = r1.y;
          afr[2 * pp + 1][0] = r0.z; afr[2 * pp + 1][1] = r1.z;
          afr[2 * pp + 1][2] = r0.w; afr[2 * pp + 1][3] = r1.w;
        }
        {
          float tot[4] = {0.f, 0.f, 0.f, 0.f}, c[4] = {0.f, 0.f, 0.f, 0.f};
          const bool four = p.gate_mode != 0;
#pragma unroll
          for (int ks = 0; ks < 8; ++ks) {
            uint2 b = make_uint2(0u, 0u);
            if (g < T) b = *reinterpret_cast<const uint2*>(&op.fa[g][32 * (ks >> 1) + 8 * tig + 4 * (ks & 1)]);
            mma_bf16(c, afr[ks], b.x, b.y);
            if (four && (ks & 1)) {
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                tot[q] = ks == 1 ? c[q] : tot[q] + c[q];
                c[q] = 0.f;
              }
            }
          }
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int tok = 2 * tig + (q & 1);
            if (tok < T) sm.alpha[tok][feat0 + (q >> 1) * 8] = bf16r(four ? tot[q] : c[q]);
          }
        }
        {
          const int partA = (tid < kD) ? 0 : 2;
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
            const float bias = !p.conv_bias ? 0.f : __ldg(p.conv_bias + part * dim + H_CUR * kD + d);
            float s[4];
            uint32_t hraw[3];
            read_window<T>(p, op, CUR, part, d, hraw);
#pragma unroll
            for (int e = 0; e < 3; ++e)
              s[e] = p.conv_state_fp32 ? __uint_as_float(hraw[e]) : bf2f(static_cast<uint16_t>(hraw[e]));
            s[3] = __bfloat162float(op.x[0][part * kD + d]);
            float acc = bias;
#pragma unroll
            for (int e = 0; e < 4; ++e) acc = fmaf(s[e], w[e], acc);
            const float y = bf16r(siluf_fast(acc));
            if (part == 0) {
              sm.q[0][d] = y;
            } else if (part == 1) {
              sm.k[0][d] = y;
              if (rec) {
                auto* kg = static_cast<uint16_t*>(p.kg_record);
                kg[((static_cast<int64_t>(CUR.cslot) * H + H_CUR) * T) * (2 * kD) + d] = f2bf_raw(y);
              }
            } else {
              sm.v[0][d] = y;
            }
            if (part < 2) {
              const float sum = warp_sum(y * y);
              if (lane == 0) sm.red[0][warp][part] = sum;
            }
            const int64_t ch = static_cast<int64_t>(CUR.cslot) * p.conv_slot +
                               static_cast<int64_t>(part * dim + H_CUR * kD + d) * p.conv_chan;
            if (p.conv_state_fp32) {
              uint32_t* cs = static_cast<uint32_t*>(p.conv_state);
              cs[ch] = hraw[1];
              cs[ch + p.conv_pos] = hraw[2];
              cs[ch + 2 * p.conv_pos] = __float_as_uint(s[3]);
            } else {
              uint16_t* cs = static_cast<uint16_t*>(p.conv_state);
              cs[ch] = static_cast<uint16_t>(hraw[1]);
              cs[ch + p.conv_pos] = static_cast<uint16_t>(hraw[2]);
              cs[ch + 2 * p.conv_pos] = __bfloat16_as_ushort(op.x[0][part * kD + d]);
            }
          }
        }
        if (tid < kD) sm.ogs[0][tid] = sigmoidf_fast(__bfloat162float(op.og[0][tid]));
        if (tid == 0) {
          const Item it = CUR;
          long long wo;
          if (rec) {
            wo = (static_cast<long long>(it.cslot) * H + it.h) * kD;
          } else {
            wo = static_cast<long long>(it.src) * p.state_slot + static_cast<long long>(it.h) * (kD * kD);
          }
          sm.woff[0] = wo;
        }
      }
      const float dtb_f = (live && tid >= kD) ? sm.dtb[tid - kD] : 0.f;
      named_sync(kBarPrep, kThreads);   // B2
      WS_STAMP(j, 2, 0);
      if (tid == 0) {  // item j+3 (its slot id came with A_{j-2}, which thread 0 has waited for)
        const int i3 = W.idx[(j + 3) & 7];
        W.info[(j + 3) & 7] = ws_item(p, i3 < end ? i3 : 0, i3 < end ? W.slot[(j + 3) & 7] : 0);
      }
      // P_j: item j+1's head parameters, if its head is new (item j is done with them now).
      const int nx = W.idx[(j + 1) & 7];
      const Item nxt = W.info[(j + 1) & 7];
      const bool next_live = nx < end && nxt.src > 0;
      const bool new_head = nxt.h != sm.params_head;
      p_pending = next_live && new_head;
      if (p_pending) {
        issue_params<T>(p, sm, nxt.h, tid);
        cp_async_commit();
      }
      if (live) {
        if (tid < kD) {
          const float sq = ((sm.red[0][0][0] + sm.red[0][1][0]) + sm.red[0][2][0]) + sm.red[0][3][0];
          const float sk = ((sm.red[0][0][1] + sm.red[0][1][1]) + sm.red[0][2][1]) + sm.red[0][3][1];
          sm.q[0][tid] = (sm.q[0][tid] * rsqrtf(sq + 1e-6f)) * p.scale;
          sm.k[0][tid] = sm.k[0][tid] * rsqrtf(sk + 1e-6f);
        } else {
          const int f = tid - kD;
          const float A = expf(p.A_log[H_CUR]);
          const float rg = sm.alpha[0][f];
          const float xg = rg + dtb_f;
          float gk;
          if (p.bounded_gate) {
            gk = p.lower_bound * (1.0f / (1.0f + expf(-(A * xg))));
          } else {
            gk = -A * (xg > 20.f ? xg : log1pf(expf(xg)));
          }
          sm.alpha[0][f] = expf(gk);
          if (rec) {
            auto* kg = static_cast<uint16_t*>(p.kg_record);
            kg[((static_cast<int64_t>(CUR.cslot) * H + H_CUR) * T) * (2 * kD) + kD + f] = f2bf_raw(rg);
          }
        }
      }
      named_sync(kBarPrep, kThreads);  // B3
      if (tid == 0 && next_live) sm.params_head = nxt.h;
      // Hand item j to the math warps.
      named_sync(kBarEmpty + (j & 1), kWsThreads);
      if (live) {
        if (tid < kD) {
          hd.q[tid] = sm.q[0][tid];
          hd.k[tid] = sm.k[0][tid];
          hd.ogs[tid] = sm.ogs[0][tid];
        } else {
          hd.alpha[tid - kD] = sm.alpha[0][tid - kD];
          hd.v[tid - kD] = sm.v[0][tid - kD];
        }
      }
      if (tid == 0) {
        const Item it = CUR;
        const Item n2 = W.info[(j + 2) & 7];
        hd.live = live;
        hd.r = it.r;
        hd.h = it.h;
        hd.woff = sm.woff[0];
        hd.beta = sm.beta[0];
        hd.done = 0;
        hd.next = n2;
        hd.next_ok = W.idx[(j + 2) & 7] < end && n2.src > 0;
      }
      named_arrive(kBarFull + (j & 1), kWsThreads);
      WS_STAMP(j, 3, 0);
#undef CUR
#undef H_CUR
    }
    if (dynamic && tid == 0) {
      __threadfence();
      if (atomicAdd(p.sched + 1, 1) == G - 1) {
        p.sched[0] = 0;
        p.sched[1] = 0;
      }
    }
  }
  if (!p.early_trigger) {
    __threadfence();
    trigger_dependents();
  }
#ifdef KDA_TRACE
  __syncthreads();
#endif
  TRACE(6, clock64());
  TRACE(1, global_timer());
  TRACE(2, sm_id());
}

cudaError_t launch_ws(const KdaParams& p, cudaStream_t stream) {
  constexpr size_t smem = sizeof(WsSmem);
  static_assert(sizeof(WsSmem) <= 227 * 1024, "one CTA per SM must fit");
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  constexpr int kMaxDev = 64;
  static std::once_flag once[kMaxDev];
  static int ctas[kMaxDev];
  static cudaError_t init_err[kMaxDev];
  if (dev >= kMaxDev) return cudaErrorInvalidDevice;
  std::call_once(once[dev], [&] {
    init_err[dev] = cudaFuncSetAttribute(kda_decode_ws_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    int sms = 0, per_sm = 0;
    if (init_err[dev] == cudaSuccess)
      init_err[dev] = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (init_err[dev] == cudaSuccess)
      init_err[dev] = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kda_decode_ws_kernel,
                                                                    kWsThreads, smem);
    ctas[dev] = sms * (per_sm > 0 ? per_sm : 1);
  });
  if (init_err[dev] != cudaSuccess) return init_err[dev];
  const int64_t items = static_cast<int64_t>(p.num_requests) * p.num_heads;
  if (items <= 0) return cudaSuccess;
  int64_t grid = ctas[dev];
  if (items < grid) grid = items;
  KdaParams q = p;
  q.static_items = p.sched != nullptr ? kda_decode_static_items(items, grid, p.static_fraction) : 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kWsThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.use_pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kda_decode_ws_kernel, q);
}
