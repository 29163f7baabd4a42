// Torch extension around kda_decode_launch: tensors -> KdaParams, launched on the current
// CUDA stream. Validation of shapes and dtypes is the caller's (kda.config.KdaArgs); this file
// checks only what the kernel's addressing relies on (devices, alignment, layouts), cheaply.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kda_decode.h"

namespace {

bool aligned(const at::Tensor& t, int bytes) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
}

void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "kda cuda: ", name, " is on ", t.device(),
              ", expected ", ref.device());
}

// One decode step, in place. The tensors come in the order of kda.config.KdaArgs's fields (the
// launcher passes the record itself, `ext.step(*args, ...)`), then the configuration (with the
// form of beta), then the launch policy: `sched` the current stream's two int32 counters of the
// item schedule (zero before the first launch, left at zero by each), `static_fraction` and
// `fb_smem` from backends/cuda/policy.py (see KdaParams in kda_decode.h).
void step(const at::Tensor& x, const at::Tensor& conv_weight,
          const c10::optional<at::Tensor>& conv_bias, const at::Tensor& conv_state,
          const at::Tensor& f_a, const at::Tensor& f_b, const at::Tensor& beta,
          const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& state,
          const at::Tensor& state_indices, const at::Tensor& output_gate,
          const at::Tensor& norm_weight, const c10::optional<at::Tensor>& num_accepted_tokens,
          const c10::optional<at::Tensor>& v_record, const c10::optional<at::Tensor>& kg_record,
          const at::Tensor& out, int64_t num_heads, int64_t T, double scale, double norm_eps,
          c10::optional<double> lower_bound, int64_t gate_mode, bool record, bool beta_activated,
          const at::Tensor& sched, double static_fraction, bool fb_smem) {
  TORCH_CHECK(x.is_cuda(), "kda cuda: tensors must be on a CUDA device");
  for (const auto* t : {&conv_weight, &conv_state, &f_a, &f_b, &beta, &A_log, &dt_bias, &state,
                        &state_indices, &output_gate, &norm_weight, &out}) {
    check_cuda(*t, x, "an input");
  }
  const int window = static_cast<int>(conv_state.size(2));
  const int64_t es = conv_state.element_size();
  const bool sd = conv_state.stride(1) == 1;
  // Addressing the kernel relies on (the 16-byte cp.async staging of the pages, windows and
  // parameters; rows of x / output_gate / f_a at any element alignment, see row_bytes below).
  TORCH_CHECK(aligned(x, 2) && aligned(output_gate, 2) && aligned(f_a, 2) && aligned(out, 2) &&
                  aligned(state, 16) && aligned(conv_weight, 16) && aligned(dt_bias, 16) &&
                  aligned(conv_state, 16) && aligned(f_b, 4),
              "kda cuda: operand data must be 16-byte aligned (x / output_gate / f_a / out: 2)");
  TORCH_CHECK(x.stride(1) == 1 && output_gate.stride(1) == 1 && f_a.stride(1) == 1,
              "kda cuda: x / output_gate / f_a rows must be contiguous");
  TORCH_CHECK(beta.scalar_type() == (beta_activated ? at::kFloat : at::kBFloat16),
              "kda cuda: beta must be ", beta_activated ? "float32 (beta_activated)" : "bfloat16",
              ", got ", beta.scalar_type());
  TORCH_CHECK(state.scalar_type() == at::kFloat || state.scalar_type() == at::kBFloat16,
              "kda cuda: state must be float32 or bfloat16, got ", state.scalar_type());
  TORCH_CHECK((state.stride(0) * state.element_size()) % 16 == 0 && state.stride(1) == 128 * 128 &&
                  state.stride(2) == 128 && state.stride(3) == 1,
              "kda cuda: state must be [slots, H, 128, 128] with contiguous inner dims and a slot "
              "stride of a multiple of 16 bytes");
  TORCH_CHECK((conv_state.stride(0) * es) % 16 == 0,
              "kda cuda: conv_state slot stride must be a multiple of 16 bytes");
  TORCH_CHECK(sd ? (conv_state.stride(2) * es) % 16 == 0 : conv_state.stride(2) == 1,
              "kda cuda: conv_state must be window-first [s, 1, 3dim] or dim-first [s, L, 1]");
  if (conv_bias) {
    check_cuda(*conv_bias, x, "conv_bias");
    TORCH_CHECK(aligned(*conv_bias, 16), "kda cuda: conv_bias must be 16-byte aligned");
  }
  if (num_accepted_tokens) check_cuda(*num_accepted_tokens, x, "num_accepted_tokens");
  if (record) {
    TORCH_CHECK(v_record && kg_record, "kda cuda: record mode needs v_record and kg_record");
    check_cuda(*v_record, x, "v_record");
    check_cuda(*kg_record, x, "kg_record");
  }

  KdaParams p{};
  p.x = x.data_ptr();
  p.conv_weight = conv_weight.data_ptr();
  p.conv_bias = conv_bias ? conv_bias->data_ptr<float>() : nullptr;
  p.conv_state = conv_state.data_ptr();
  p.f_a = f_a.data_ptr();
  p.f_b = f_b.data_ptr();
  p.beta = beta.data_ptr();
  p.A_log = A_log.data_ptr<float>();
  p.dt_bias = dt_bias.data_ptr<float>();
  p.state = state.data_ptr();
  p.state_indices = state_indices.data_ptr<int32_t>();
  p.num_accepted = num_accepted_tokens ? num_accepted_tokens->data_ptr<int32_t>() : nullptr;
  p.output_gate = output_gate.data_ptr();
  p.norm_weight = norm_weight.data_ptr();
  p.out = out.data_ptr();
  p.v_record = record ? v_record->data_ptr<float>() : nullptr;
  p.kg_record = record ? kg_record->data_ptr() : nullptr;

  p.x_row = x.stride(0);
  p.og_row = output_gate.stride(0);
  p.fa_row = f_a.stride(0);
  p.out_row = out.stride(0);
  p.beta_row = beta.stride(0);
  p.idx_row = state_indices.dim() > 1 ? state_indices.stride(0) : 1;
  p.state_slot = state.stride(0);
  p.conv_slot = conv_state.stride(0);
  p.conv_chan = conv_state.stride(1);
  p.conv_pos = conv_state.stride(2);

  p.num_requests = static_cast<int>(state_indices.size(0));
  p.num_heads = static_cast<int>(num_heads);
  p.T = static_cast<int>(T);
  p.window = window;
  p.num_slots = static_cast<int>(state.size(0));
  p.scale = static_cast<float>(scale);
  p.norm_eps = static_cast<float>(norm_eps);
  p.bounded_gate = lower_bound.has_value() ? 1 : 0;
  p.lower_bound = lower_bound.has_value() ? static_cast<float>(*lower_bound) : 0.f;
  p.gate_mode = static_cast<int>(gate_mode);
  p.record = record ? 1 : 0;
  p.conv_state_fp32 = conv_state.scalar_type() == at::kFloat ? 1 : 0;
  p.conv_weight_bf16 = conv_weight.scalar_type() == at::kBFloat16 ? 1 : 0;
  p.norm_weight_bf16 = norm_weight.scalar_type() == at::kBFloat16 ? 1 : 0;
  p.beta_activated = beta_activated ? 1 : 0;
  p.state_bf16 = state.scalar_type() == at::kBFloat16 ? 1 : 0;
  // The rows' widest common access (KdaParams.row_bytes): the lowest set bit of every address
  // and row pitch in bytes, capped at 16.
  uint64_t rows = 16;
  for (const auto* t : {&x, &output_gate, &f_a}) {
    rows |= reinterpret_cast<uintptr_t>(t->data_ptr());
    if (t->size(0) > 1) rows |= static_cast<uint64_t>(t->stride(0)) * t->element_size();
  }
  p.row_bytes = static_cast<int>(rows & (~rows + 1));
  const bool fb_build = T == 1 || p.state_bf16;
  TORCH_CHECK(fb_smem == fb_build, "kda cuda: the T=", T, p.state_bf16 ? " bf16-state" : " fp32-state",
              " build ", fb_build ? "stages" : "does not stage", " f_b in shared memory, got fb_smem=",
              fb_smem);
  p.fb_smem = fb_smem ? 1 : 0;
  check_cuda(sched, x, "sched");
  TORCH_CHECK(sched.scalar_type() == at::kInt && sched.numel() >= 2 && sched.is_contiguous(),
              "kda cuda: sched must be a contiguous int32 tensor of >= 2 elements, got ",
              sched.scalar_type(), " with ", sched.numel(), " elements");
  p.sched = sched.data_ptr<int32_t>();
  TORCH_CHECK(static_fraction >= 0.0 && static_fraction <= 1.0,
              "kda cuda: static_fraction must be in [0, 1], got ", static_fraction);
  p.static_fraction = static_cast<float>(static_fraction);

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = kda_decode_launch(&p, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "kda cuda: launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused KDA decode step (CUDA C++, sm_90a)";
  m.def("step", &step, "One fused KDA decode step, in place (see backends/cuda/kda_decode.h)",
        py::arg("x"), py::arg("conv_weight"), py::arg("conv_bias"), py::arg("conv_state"),
        py::arg("f_a"), py::arg("f_b"), py::arg("beta"), py::arg("A_log"), py::arg("dt_bias"),
        py::arg("state"), py::arg("state_indices"), py::arg("output_gate"),
        py::arg("norm_weight"), py::arg("num_accepted_tokens"), py::arg("v_record"),
        py::arg("kg_record"), py::arg("out"), py::arg("num_heads"), py::arg("T"),
        py::arg("scale"), py::arg("norm_eps"), py::arg("lower_bound"), py::arg("gate_mode"),
        py::arg("record"), py::arg("beta_activated"), py::arg("sched"),
        py::arg("static_fraction"), py::arg("fb_smem"));
}
