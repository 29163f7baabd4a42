// Plain-C interface of the fused KDA decode kernel (backends/cuda/kda_decode.cu).
//
// No torch headers: the torch binding (binding.cpp) fills a KdaParams from tensors, and a
// plain C++ host program can do the same. Strides are in elements of the tensor's own dtype.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct KdaParams {
  // ---- tensors (device pointers) ----
  const void* x;              // [N, 3*dim] bf16, row stride x_row (any alignment: row_bytes)
  const void* conv_weight;    // [3, 4, dim] fp32 or bf16 (conv_weight_bf16), contiguous
  const float* conv_bias;     // [3*dim] fp32 or nullptr
  void* conv_state;           // [slots, 3*dim, L] bf16 or fp32 (conv_state_fp32)
  const void* f_a;            // [N, 128] bf16, row stride fa_row
  const void* f_b;            // [dim, 128] bf16, contiguous
  const void* beta;           // [N, H] bf16 logits, or fp32 with beta_activated; row stride beta_row
  const float* A_log;         // [H]
  const float* dt_bias;       // [dim]
  void* state;                // [slots, H, 128, 128] fp32, or bf16 (state_bf16); slot stride state_slot
  const int32_t* state_indices;       // [R] (T=1) or [R, T], row stride idx_row
  const int32_t* num_accepted;        // [R] (T>1), else nullptr
  const void* output_gate;    // [N, dim] bf16, row stride og_row
  const void* norm_weight;    // [128] fp32 or bf16 (norm_weight_bf16)
  void* out;                  // [N, dim] bf16, row stride out_row
  float* v_record;            // [slots, H, T, 128] fp32 (record), else nullptr
  void* kg_record;            // [slots, H, T, 256] bf16 (record), else nullptr

  // ---- strides (elements) ----
  int64_t x_row, og_row, fa_row, out_row, beta_row, idx_row;
  int64_t state_slot;
  int64_t conv_slot, conv_chan, conv_pos;  // conv_state strides: SD = [s, 1, 3dim], DS = [s, L, 1]
  int64_t conv_slot_bytes, conv_pos_bytes;  // the same two strides in bytes (filled by the launcher)

  // ---- sizes ----
  int num_requests;  // R
  int num_heads;     // H
  int T;             // tokens per request, 1..8
  int window;        // L >= T + 2
  int num_slots;     // slots in the state pool (and conv cache): ids outside (0, num_slots) are null

  // ---- scalars and flags ----
  float scale;        // q scale
  float norm_eps;     // RMSNorm eps
  float lower_bound;  // bounded gate only
  int bounded_gate;   // 0 = softplus (Kimi-Linear), 1 = lower_bound * sigmoid(A * x)
  int gate_mode;      // 0 = one MMA chain, 1 = four chains ((c0+c1)+c2)+c3
  int record;         // 1 = record mode (state not written; v_record / kg_record written)
  int conv_state_fp32;
  int conv_weight_bf16;
  int norm_weight_bf16;
  int beta_activated;  // 1: beta is fp32, already passed through the sigmoid (used as it is)
  int state_bf16;      // 1: the state pool is bf16 (pages widened to fp32 on load, every state
                       // written rounded once to nearest even); 0: fp32
  // 16, 8, 4 or 2: the largest power of two up to 16 dividing the data address and, with more
  // than one row, the row pitch in bytes of x, output_gate and f_a. 16 selects the build that
  // stages those rows with 16-byte cp.async; below it a build stages them with row_bytes-wide
  // cp.async (8, 4) or element loads (2). Any other value is rejected.
  int row_bytes;
  // The item schedule's two int32 counters in device memory (required), zero before the first
  // launch and left at zero by every launch (the last CTA resets them). CTA b first walks its
  // static range (below), then takes each next item from counter 0 (atomicAdd); counter 1
  // counts finished CTAs. One counter pair must not serve two launches that run at the same
  // time (e.g. on two streams).
  int* sched;
  // The fraction f in [0, 1] of the items walked in static contiguous ranges before the
  // counter's: CTA b first walks [b*S, (b+1)*S), S = floor(f * items / CTAs), then takes items
  // from counter 0 (which hands out items CTAs*S onwards). 0 = from the second item on (CTA b
  // starts with item b).
  float static_fraction;
  int static_items;  // S (filled by the launcher)
  // Selects the build: 1 = the head's f_b rows (32 KiB) are staged in shared memory once per
  // head instead of the MMA fragments being read from L2 for every item. The builds stage them
  // at T=1 and with a bf16 state (whose page staging is 32 KiB smaller), and read them from L2
  // at T=2..8 with an fp32 state; any other (T, fb_smem, state_bf16) is rejected.
  int fb_smem;
} KdaParams;

// Launches one decode step on `stream`, with programmatic stream serialization (PDL), on the
// persistent grid (the resident CTAs, at most R * H). Returns the launch's error code
// (cudaSuccess when nothing needs doing, e.g. R == 0; cudaErrorInvalidValue for parameters
// outside the above). Never synchronizes.
cudaError_t kda_decode_launch(const KdaParams* params, cudaStream_t stream);

// Dynamic shared memory one CTA of the T-token build uses, in bytes; 0 for a (T, fb_smem,
// state_bf16) that has no build (see KdaParams.fb_smem).
size_t kda_decode_smem_bytes(int T, int fb_smem, int state_bf16);

// Number of threads per CTA.
int kda_decode_threads(void);

// Items of each CTA's static range: floor(static_fraction * items / ctas) (0 when ctas < 1 or
// items < 1).
int kda_decode_static_items(long long items, long long ctas, float static_fraction);

#ifdef __cplusplus
}
#endif
