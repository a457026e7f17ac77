// The decode/verify forward of a Llama/Qwen-family decoder in one call: embedding, every layer (RMSNorm,
// QKV, q/k norms, RoPE, cache write, attention, O-proj, residual, MLP) and the head, for rows of several
// requests at once. The hidden state stays fp32 between ops; only the linear kernel's path decides where
// activations are rounded (to bf16 on amx and avx512bf16). Every op is row-local or per (row, head) with a fixed
// order, so a row's logits do not depend on the other rows of the pass.
//
// Included: torch's pybind11 glue (its at::Tensor caster) and the ATen ops used, not torch/extension.h,
// which also parses torch's whole C++ frontend (about 30 s of compile a file).
#include <torch/csrc/utils/pybind.h>  // first: it includes Python.h

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <vector>

#include "attention.h"
#include "common.h"
#include "linear.h"
#include "tiles.h"

namespace specstand {

static std::vector<float> to_floats(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return {};
  at::Tensor f = t.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

// RMSNorm of one row of width `dim` (a multiple of 8): x * (1 / sqrt(mean(x^2) + eps)) * weight
__attribute__((target_clones("avx2", "default"), flatten)) static void rms_norm_row(const float* x, float* y,
                                                                                  int64_t dim, const float* weight,
                                                                                  float eps) {
  v8f squares = v8_splat(0.0f);
  for (int64_t i = 0; i < dim; i += 8) squares = squares + v8_load(x + i) * v8_load(x + i);
  const v8f inv = v8_splat(1.0f / std::sqrt(v8_sum(squares) / float(dim) + eps));
  for (int64_t i = 0; i < dim; i += 8) v8_store(y + i, (v8_load(x + i) * inv) * v8_load(weight + i));
}

// y = silu(gate) * up for one row of the fused [gate | up] output.
__attribute__((target_clones("avx2", "default"), flatten)) static void silu_mul_row(const float* gate_up, float* y,
                                                                                  int64_t width) {
  for (int64_t i = 0; i < width; i += 8) v8_store(y + i, silu_mul(v8_load(gate_up + i), v8_load(gate_up + width + i)));
}

__attribute__((target_clones("avx2", "default"), flatten)) static void add_row(float* x, const float* y,
                                                                             int64_t width) {
  for (int64_t i = 0; i < width; i += 8) v8_store(x + i, v8_load(x + i) + v8_load(y + i));
}

// f(r) for every row; a few rows stay on the calling thread (a pool wake-up costs more than their work).
template <typename F>
static void for_rows(int64_t rows, const F& f) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

// Where a forward spends its time (`benchmarks/pass_cost.py --profile` prints it).
enum Phase { kLinear, kAttention, kHead, kOther, kPhases };
static const char* const kPhaseNames[kPhases] = {"linear", "attention", "head", "other"};

struct PhaseClock {
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(double* seconds, Phase phase) {
    const auto now = std::chrono::steady_clock::now();
    seconds[phase] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

inline Isa runnable(int64_t isa) {
  TORCH_CHECK(cpu_has(static_cast<Isa>(isa)), "this CPU cannot run that path");
  return static_cast<Isa>(isa);
}

// A packed weight handed over from Python: the decoder's layers take these, and drafter layers and
// benchmarks call them directly. bf16 weights, or Q8_0 blocks (int8 values + fp16 scales per 32 k).
struct Linear {
  PackedLinear packed;
  Linear(const at::Tensor& weight, int64_t isa) : packed(pack_linear(weight, runnable(isa))) {}
  Linear(const at::Tensor& q, const at::Tensor& d, int64_t isa) : packed(pack_linear_q8_0(q, d, runnable(isa))) {}
  at::Tensor forward(const at::Tensor& x) const {
    at::Tensor input = x.to(at::kFloat).contiguous();
    TORCH_CHECK(input.size(-1) == packed.k, "x must end in ", packed.k);
    const int64_t m = input.numel() / packed.k;
    std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
    shape.back() = packed.n;
    at::Tensor y = at::empty(shape, at::kFloat);
    linear(packed, input.data_ptr<float>(), m, packed.k, y.data_ptr<float>(), packed.n);
    return y;
  }
  // A [gate | up] weight's activation silu(gate) * up as the down projection reads it on amx: bf16 in tile order
  // (fused: linear_silu_mul; else linear, the decoder's silu_mul_row and the amx rounding into tiles). For tests.
  at::Tensor silu_mul_tiles(const at::Tensor& x, bool fused) const {
    TORCH_CHECK(fuses_silu_mul(packed), "silu_mul_tiles takes a [gate | up] weight linear_silu_mul runs");
    const at::Tensor input = x.to(at::kFloat).contiguous();
    TORCH_CHECK(input.dim() == 2 && input.size(1) == packed.k, "x must be [rows, ", packed.k, "]");
    const int64_t m = input.size(0), I = packed.n / 2, padded = (m + 15) / 16 * 16;
    at::Tensor tiles = at::zeros({padded * I}, at::kBFloat16);
    auto* act = reinterpret_cast<uint16_t*>(tiles.data_ptr());
    if (fused) {
      linear_silu_mul(packed, input.data_ptr<float>(), m, packed.k, act);
      return tiles;
    }
    std::vector<float> gate_up(m * 2 * I), rows(m * I);
    linear(packed, input.data_ptr<float>(), m, packed.k, gate_up.data(), 2 * I);
    for (int64_t r = 0; r < m; ++r) silu_mul_row(&gate_up[r * 2 * I], &rows[r * I], I);
    round_rows_to_bf16_tiles(rows.data(), m, I, I, act, I);
    return tiles;
  }
};

struct DecoderLayer {
  PackedLinear qkv, o_proj, gate_up, down;
  std::vector<float> input_norm, post_attention_norm, qkv_bias, q_norm, k_norm;
};

class Decoder {
 public:
  Decoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
          int64_t isa)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        eps_(float(eps)), isa_(static_cast<Isa>(isa)) {
    TORCH_CHECK(hidden % 8 == 0 && head_dim % 8 == 0 && intermediate % 8 == 0 && heads % kv_heads == 0,
                "the compiled forward needs hidden, head and MLP widths in multiples of 8");
    TORCH_CHECK(cpu_has(isa_), "this CPU cannot run the ", isa_name(isa_), " kernels");
  }

  // The linears come packed (Linear), each for this decoder's path, in either weight format.
  void add_layer(const Linear& qkv, const at::Tensor& qkv_bias, const Linear& o_proj, const at::Tensor& q_norm,
                 const at::Tensor& k_norm, const at::Tensor& input_norm, const at::Tensor& post_attention_norm,
                 const Linear& gate_up, const Linear& down) {
    for (const Linear* lin : {&qkv, &o_proj, &gate_up, &down})
      TORCH_CHECK(lin->packed.isa == isa_, "a linear packed for ", isa_name(lin->packed.isa), ", not ", isa_name(isa_));
    DecoderLayer layer;
    layer.qkv = qkv.packed;
    layer.o_proj = o_proj.packed;
    layer.gate_up = gate_up.packed;
    layer.down = down.packed;
    layer.qkv_bias = to_floats(qkv_bias);
    layer.q_norm = to_floats(q_norm);
    layer.k_norm = to_floats(k_norm);
    layer.input_norm = to_floats(input_norm);
    layer.post_attention_norm = to_floats(post_attention_norm);
    TORCH_CHECK(layer.qkv.n == (heads_ + 2 * kv_heads_) * head_dim_ && layer.qkv.k == hidden_, "qkv shape");
    TORCH_CHECK(layer.gate_up.n == 2 * intermediate_ && layer.down.k == intermediate_, "mlp shape");
    layers_.push_back(std::move(layer));
  }

  void set_head(const at::Tensor& embed_tokens, const at::Tensor& final_norm, const Linear& lm_head,
                const at::Tensor& rope) {
    TORCH_CHECK(lm_head.packed.isa == isa_, "the head is packed for another path");
    TORCH_CHECK(embed_tokens.scalar_type() == at::kBFloat16 && embed_tokens.is_contiguous(), "embedding: bf16");
    embed_ = embed_tokens;  // shared with the Python model, not copied
    final_norm_ = to_floats(final_norm);
    lm_head_ = lm_head.packed;
    rope_ = rope.to(at::kFloat).contiguous();  // [positions, head_dim / 2, (cos, sin)]
    TORCH_CHECK(rope_.dim() == 3 && rope_.size(1) * 2 == head_dim_, "rope table shape");
  }

  // tokens, slots, positions: [rows] int64. keys/values: [layers, slots, kv heads, capacity, head_dim] bf16,
  // written (rounded to nearest even) at (slot, position) of every row. Returns fp32 logits
  // [len(logit_rows), vocab] of the rows listed in logit_rows, and the hidden states of tap_layers
  // (0: embedding, i: output of layer i, num_layers: final normed state) of every row.
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(const at::Tensor& tokens, const at::Tensor& slots,
                                                           const at::Tensor& positions, at::Tensor& keys,
                                                           at::Tensor& values, const std::vector<int64_t>& tap_layers,
                                                           const std::vector<int64_t>& logit_rows) {
    const std::lock_guard<std::mutex> one_pass_at_a_time(busy_);  // the scratch buffers are the decoder's
    PhaseClock clock;
    const int64_t rows = tokens.size(0), layers = int64_t(layers_.size());
    TORCH_CHECK(lm_head_.n > 0, "set_head was not called");
    TORCH_CHECK(slots.size(0) == rows && positions.size(0) == rows, "tokens, slots and positions differ in length");
    TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16 &&
                    keys.is_contiguous() && values.is_contiguous() &&
                    keys.sizes() == values.sizes() && keys.dim() == 5 && keys.size(0) == layers &&
                    keys.size(2) == kv_heads_ && keys.size(4) == head_dim_,
                "the KV cache must be bf16 [layers, slots, kv heads, capacity, head_dim]");
    const at::Tensor tok = tokens.to(at::kLong).contiguous(), slot = slots.to(at::kLong).contiguous(),
                     pos = positions.to(at::kLong).contiguous();
    const int64_t* tok_p = tok.data_ptr<int64_t>();
    const int64_t* slot_p = slot.data_ptr<int64_t>();
    const int64_t* pos_p = pos.data_ptr<int64_t>();
    const int64_t num_slots = keys.size(1), capacity = keys.size(3);
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(0 <= tok_p[r] && tok_p[r] < embed_.size(0), "token id ", tok_p[r], " is out of the vocabulary");
      TORCH_CHECK(0 <= slot_p[r] && slot_p[r] < num_slots, "slot ", slot_p[r], " does not exist");
      TORCH_CHECK(0 <= pos_p[r] && pos_p[r] < capacity && pos_p[r] < rope_.size(0), "position ", pos_p[r],
                  " is past the cache");
    }
    for (int64_t r : logit_rows) TORCH_CHECK(0 <= r && r < rows, "logit row ", r, " is not a row of the pass");
    const int64_t H = hidden_, D = head_dim_, q_size = heads_ * D, kv_size = kv_heads_ * D;
    const int64_t qkv_width = q_size + 2 * kv_size, I = intermediate_;
    Scratch& b = scratch_;
    b.h.resize(rows * H), b.xn.resize(rows * H), b.qkv.resize(rows * qkv_width), b.attn.resize(rows * q_size);
    b.tmp.resize(rows * H);
    if (fused_mlp_layers() < int64_t(layers_.size())) b.gu.resize(rows * 2 * I), b.act.resize(rows * I);
    std::vector<float>&h = b.h, &xn = b.xn, &qkv = b.qkv, &attn = b.attn, &tmp = b.tmp, &gu = b.gu, &act = b.act;
    const auto* embed = reinterpret_cast<const uint16_t*>(embed_.data_ptr());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < H; ++i) h[r * H + i] = bf16_to_float(embed[tok_p[r] * H + i]);

    std::vector<at::Tensor> taps;
    auto tap = [&](int64_t index, const std::vector<float>& state) {
      for (int64_t wanted : tap_layers)
        if (wanted == index) taps.push_back(at::from_blob(const_cast<float*>(state.data()), {rows, H}).clone());
    };
    tap(0, h);
    const float scale = 1.0f / std::sqrt(float(D));
    const float* rope = rope_.data_ptr<float>();
    clock.lap(seconds_, kOther);
    for (int64_t l = 0; l < layers; ++l) {
      const DecoderLayer& layer = layers_[l];
      for_rows(rows, [&](int64_t r) { rms_norm_row(&h[r * H], &xn[r * H], H, layer.input_norm.data(), eps_); });
      clock.lap(seconds_, kOther);
      linear(layer.qkv, xn.data(), rows, H, qkv.data(), qkv_width);
      clock.lap(seconds_, kLinear);
      const int64_t layer_size = num_slots * kv_heads_ * capacity * D;
      uint16_t* layer_keys = reinterpret_cast<uint16_t*>(keys.data_ptr()) + l * layer_size;
      uint16_t* layer_values = reinterpret_cast<uint16_t*>(values.data_ptr()) + l * layer_size;
      for_rows(rows, [&](int64_t r) {
        float* row = qkv.data() + r * qkv_width;
        if (!layer.qkv_bias.empty())
          for (int64_t i = 0; i < qkv_width; ++i) row[i] += layer.qkv_bias[i];
        if (!layer.q_norm.empty()) {
          for (int64_t head = 0; head < heads_; ++head)
            rms_norm_row(row + head * D, row + head * D, D, layer.q_norm.data(), eps_);
          for (int64_t head = 0; head < kv_heads_; ++head)
            rms_norm_row(row + q_size + head * D, row + q_size + head * D, D, layer.k_norm.data(), eps_);
        }
        const float* angle = rope + pos_p[r] * D;  // D / 2 (cos, sin) pairs
        for (int64_t head = 0; head < heads_ + kv_heads_; ++head)
          for (int64_t i = 0; i < D / 2; ++i) {
            float* x = row + head * D + 2 * i;
            const float c = angle[2 * i], s = angle[2 * i + 1], x0 = x[0], x1 = x[1];
            x[0] = x0 * c - x1 * s;
            x[1] = x0 * s + x1 * c;
          }
        for (int64_t kv = 0; kv < kv_heads_; ++kv) {
          const int64_t at = ((slot_p[r] * kv_heads_ + kv) * capacity + pos_p[r]) * D;
          for (int64_t i = 0; i < D; ++i) {
            layer_keys[at + i] = float_to_bf16(row[q_size + kv * D + i]);
            layer_values[at + i] = float_to_bf16(row[q_size + kv_size + kv * D + i]);
          }
        }
      });
      clock.lap(seconds_, kOther);
      // every row's K/V is in the cache before any row attends: a verify row sees the draft rows before it
      const CacheView cache{layer_keys, layer_values, num_slots, kv_heads_, capacity, D};
      decode_attention(isa_, qkv.data(), qkv_width, attn.data(), rows, heads_, slot_p, pos_p, cache, scale);
      clock.lap(seconds_, kAttention);
      linear(layer.o_proj, attn.data(), rows, q_size, tmp.data(), H);
      clock.lap(seconds_, kLinear);
      for_rows(rows, [&](int64_t r) {
        add_row(&h[r * H], &tmp[r * H], H);
        rms_norm_row(&h[r * H], &xn[r * H], H, layer.post_attention_norm.data(), eps_);
      });
      clock.lap(seconds_, kOther);
      if (fuses_mlp(layer)) {
        b.act_tiles.resize((rows + 15) / 16 * 16 * I);
        linear_silu_mul(layer.gate_up, xn.data(), rows, H, b.act_tiles.data());
        linear_from_tiles(layer.down, b.act_tiles.data(), rows, tmp.data(), H);
        clock.lap(seconds_, kLinear);
      } else {
        linear(layer.gate_up, xn.data(), rows, H, gu.data(), 2 * I);
        clock.lap(seconds_, kLinear);
        for_rows(rows, [&](int64_t r) { silu_mul_row(&gu[r * 2 * I], &act[r * I], I); });
        clock.lap(seconds_, kOther);
        linear(layer.down, act.data(), rows, I, tmp.data(), H);
        clock.lap(seconds_, kLinear);
      }
      for_rows(rows, [&](int64_t r) { add_row(&h[r * H], &tmp[r * H], H); });
      if (l + 1 != layers) tap(l + 1, h);
      clock.lap(seconds_, kOther);
    }
    for_rows(rows, [&](int64_t r) { rms_norm_row(&h[r * H], &xn[r * H], H, final_norm_.data(), eps_); });
    tap(layers, xn);
    const int64_t out_rows = int64_t(logit_rows.size());
    std::vector<float> head_in(out_rows * H);
    for (int64_t i = 0; i < out_rows; ++i) std::memcpy(&head_in[i * H], &xn[logit_rows[i] * H], H * sizeof(float));
    at::Tensor out = logits_buffer(out_rows);
    clock.lap(seconds_, kOther);
    linear(lm_head_, head_in.data(), out_rows, H, out.data_ptr<float>(), lm_head_.n);
    clock.lap(seconds_, kHead);
    return {out, taps};
  }

  // Seconds per phase (linear, attention, head, other) since the last call; then starts afresh.
  std::map<std::string, double> take_profile() {
    std::map<std::string, double> taken;
    for (int phase = 0; phase < kPhases; ++phase) {
      taken[kPhaseNames[phase]] = seconds_[phase];
      seconds_[phase] = 0.0;
    }
    return taken;
  }

  std::string isa() const { return isa_name(isa_); }

  // Layers whose MLP runs fused (fuses_mlp): all of them on amx with bf16 weights, else none.
  int64_t fused_mlp_layers() const {
    return std::count_if(layers_.begin(), layers_.end(), [&](const DecoderLayer& l) { return fuses_mlp(l); });
  }

 private:
  // amx: the MLP's gate/up and activation in one kernel whose output the down projection reads as it is (its
  // time counts as linear in the profile)
  bool fuses_mlp(const DecoderLayer& layer) const {
    return fuses_silu_mul(layer.gate_up) && layer.down.isa == Isa::amx && layer.down.format == Format::bf16;
  }

  // Buffers of a pass, kept between passes: freshly allocated ones cost a page fault per 4 KiB, as much as
  // the head's weight reads for a 64-row verify's logits.
  struct Scratch {
    std::vector<float> h, xn, qkv, attn, tmp, gu, act;
    AlignedVector<uint16_t> act_tiles;  // the fused MLP's activation, in the down projection's tile order
  };

  // The logits tensor of the last pass is reused once the caller holds no tensor on its storage.
  at::Tensor logits_buffer(int64_t rows) {
    const bool free = logits_.defined() && logits_.use_count() == 1 && logits_.storage().use_count() == 1;
    if (!free || logits_.size(0) < rows) logits_ = at::empty({std::max<int64_t>(rows, 1), lm_head_.n}, at::kFloat);
    return logits_.narrow(0, 0, rows);
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  float eps_;
  Isa isa_;
  std::vector<DecoderLayer> layers_;
  double seconds_[kPhases] = {};
  at::Tensor embed_, rope_;
  std::vector<float> final_norm_;
  PackedLinear lm_head_;
  std::mutex busy_;
  Scratch scratch_;
  at::Tensor logits_;
};

}  // namespace specstand

namespace {

using specstand::Isa;
using specstand::Linear;
using specstand::runnable;

// decode_attention on tensors, for tests: q [rows, heads * head_dim] fp32, keys/values [slots, kv_heads,
// capacity, head_dim] bf16, slots/positions [rows] int64; row r attends over positions 0..positions[r].
at::Tensor attention(int64_t isa, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                     const at::Tensor& slots, const at::Tensor& positions, double scale) {
  const Isa path = runnable(isa);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [rows, heads * head_dim] fp32");
  TORCH_CHECK(keys.dim() == 4 && keys.scalar_type() == at::kBFloat16 && keys.is_contiguous() &&
                  values.sizes() == keys.sizes() && values.scalar_type() == at::kBFloat16 && values.is_contiguous(),
              "keys, values: [slots, kv_heads, capacity, head_dim] bf16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slots.numel() == q.size(0) && positions.numel() == q.size(0),
              "slots, positions: int64, one per row");
  const int64_t rows = q.size(0), head_dim = keys.size(3), heads = q.size(1) / head_dim;
  TORCH_CHECK(heads * head_dim == q.size(1) && heads % keys.size(1) == 0, "heads must be a multiple of kv_heads");
  const at::Tensor s = slots.contiguous(), p = positions.contiguous();
  const int64_t *slot_p = s.data_ptr<int64_t>(), *pos_p = p.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slot_p[r] >= 0 && slot_p[r] < keys.size(0) && pos_p[r] >= 0 && pos_p[r] < keys.size(2),
                "a row's slot or position is outside the cache");
  const specstand::CacheView cache{reinterpret_cast<const uint16_t*>(keys.data_ptr()),
                                   reinterpret_cast<const uint16_t*>(values.data_ptr()), keys.size(0), keys.size(1),
                                   keys.size(2), head_dim};
  at::Tensor out = at::empty({rows, heads * head_dim}, q.options());
  specstand::decode_attention(path, q.data_ptr<float>(), q.size(1), out.data_ptr<float>(), rows,
                              heads, slot_p, pos_p, cache, float(scale));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_has", [](int64_t isa) { return specstand::cpu_has(static_cast<Isa>(isa)); });
  m.def("isa_name", [](int64_t isa) { return std::string(specstand::isa_name(static_cast<Isa>(isa))); });
  m.def("peak_macs_per_second", [](int64_t isa, int64_t iterations) {
    return specstand::peak_macs_per_second(static_cast<Isa>(isa), iterations);
  });
  m.def("peak_macs_per_second_q8_0", [](int64_t isa, bool tiles, int64_t iterations) {
    return specstand::peak_macs_per_second_q8_0(static_cast<Isa>(isa), tiles, iterations);
  });
  m.def("attention", &attention);
  py::class_<Linear>(m, "Linear")
      .def(py::init<const at::Tensor&, int64_t>())
      .def(py::init<const at::Tensor&, const at::Tensor&, int64_t>())
      .def("forward", &Linear::forward)
      .def("silu_mul_tiles", &Linear::silu_mul_tiles);
  py::class_<specstand::Decoder>(m, "Decoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t>())
      .def("add_layer", &specstand::Decoder::add_layer)
      .def("set_head", &specstand::Decoder::set_head)
      .def("forward", &specstand::Decoder::forward)
      .def("take_profile", &specstand::Decoder::take_profile)
      .def_property_readonly("isa", &specstand::Decoder::isa)
      .def_property_readonly("fused_mlp_layers", &specstand::Decoder::fused_mlp_layers);
}
