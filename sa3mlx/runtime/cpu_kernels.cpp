// AVX2/FMA kernels for MLX's x86 CPU backend: softmax, sigmoid, SwiGLU, RMSNorm and RoPE with their backward
// passes, each an MLX primitive evaluated row by row in one pass over memory, rows split over the cores; and
// the AdamW step over every adapter tensor at once. Built and loaded by sa3mlx/runtime/native.py, which passes
// the exp constants of sa3mlx/runtime/kernels.py as macros (SA3_*); the VJPs are wired in Python (kernels.py).
// Every row (or fixed chunk) is computed by one thread in a fixed order, so results do not depend on the
// thread count.
#include <immintrin.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr int W = 8;  // floats per __m256
constexpr size_t ELEMENTS_PER_THREAD = 1 << 16;  // below this much work a row range stays on one thread

// e^x for x <= 0 (Cody-Waite reduction x = n·ln2 + r, the polynomial of kernels.py, 2^n from the
// exponent bits); 0 below SA3_EXP_LO, NaN kept.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(SA3_EXP_LO);
  const __m256 xc = _mm256_max_ps(lo, x);  // operand order keeps NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(SA3_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SA3_LN2_HI), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SA3_LN2_LO), r);
  __m256 p = _mm256_set1_ps(SA3_C5);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SA3_C4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SA3_C3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SA3_C2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SA3_C1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SA3_C0));
  const __m256 e_r = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 value = _mm256_mul_ps(e_r, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), value);
}

// sigmoid(x) = 1/(1+e^-x) for x >= 0, e^x/(1+e^x) below, with e = e^-|x| (no overflow)
inline __m256 sigmoid8(__m256 x) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 e = exp_nonpositive(_mm256_xor_ps(_mm256_and_ps(x, abs_mask), _mm256_set1_ps(-0.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 numerator = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_div_ps(numerator, _mm256_add_ps(one, e));
}

// lanes [0, count) of a partial vector, for the tail of a row
inline __m256i tail_mask(int count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes);
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float horizontal_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// f(i, lanes) over [0, n) in blocks of W, the last block masked to `lanes`
template <class F>
inline void for_blocks(int n, F f) {
  int i = 0;
  for (; i + W <= n; i += W) f(i, W);
  if (i < n) f(i, n - i);
}

inline __m256 load(const float* p, int lanes) {
  return lanes == W ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(lanes));
}

inline void store(float* p, __m256 v, int lanes) {
  if (lanes == W) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, tail_mask(lanes), v);
  }
}

void softmax_row(const float* x, float* out, int n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  for_blocks(n, [&](int i, int lanes) {
    const __m256 v = load(x + i, lanes);
    m = _mm256_max_ps(m, lanes == W ? v : _mm256_blendv_ps(m, v, _mm256_castsi256_ps(tail_mask(lanes))));
  });
  const __m256 row_max = _mm256_set1_ps(horizontal_max(m));
  __m256 total = _mm256_setzero_ps();
  for_blocks(n, [&](int i, int lanes) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(load(x + i, lanes), row_max));
    if (lanes < W) e = _mm256_and_ps(e, _mm256_castsi256_ps(tail_mask(lanes)));
    total = _mm256_add_ps(total, e);
    store(out + i, e, lanes);
  });
  const __m256 normalizer = _mm256_set1_ps(1.0f / horizontal_sum(total));
  for_blocks(n, [&](int i, int lanes) { store(out + i, _mm256_mul_ps(load(out + i, lanes), normalizer), lanes); });
}

// dx = s·g - s·Σ(s·g), MLX's softmax VJP
void softmax_vjp_row(const float* s, const float* g, float* dx, int n) {
  __m256 total = _mm256_setzero_ps();
  for_blocks(n, [&](int i, int lanes) {
    total = _mm256_fmadd_ps(load(s + i, lanes), load(g + i, lanes), total);  // masked lanes load 0
  });
  const __m256 dot = _mm256_set1_ps(horizontal_sum(total));
  for_blocks(n, [&](int i, int lanes) {
    const __m256 sv = load(s + i, lanes);
    store(dx + i, _mm256_fnmadd_ps(sv, dot, _mm256_mul_ps(sv, load(g + i, lanes))), lanes);
  });
}

void sigmoid_row(const float* x, float* out, int n) {
  for_blocks(n, [&](int i, int lanes) { store(out + i, sigmoid8(load(x + i, lanes)), lanes); });
}

// row of h = [value | gate] (2n) -> value·gate·sigmoid(gate) (n)
void swiglu_row(const float* h, float* out, int n) {
  for_blocks(n, [&](int i, int lanes) {
    const __m256 gate = load(h + n + i, lanes);
    const __m256 silu = _mm256_mul_ps(gate, sigmoid8(gate));
    store(out + i, _mm256_mul_ps(load(h + i, lanes), silu), lanes);
  });
}

// d value = g·silu(gate); d gate = g·value·s·(1 + gate·(1 - s)), s = sigmoid(gate); dh may alias h
void swiglu_vjp_row(const float* h, const float* g, float* dh, int n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for_blocks(n, [&](int i, int lanes) {
    const __m256 value = load(h + i, lanes), gate = load(h + n + i, lanes), gv = load(g + i, lanes);
    const __m256 s = sigmoid8(gate);
    const __m256 d_silu = _mm256_mul_ps(gv, value);
    const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(gate, _mm256_sub_ps(one, s), one));
    store(dh + i, _mm256_mul_ps(gv, _mm256_mul_ps(gate, s)), lanes);
    store(dh + n + i, _mm256_mul_ps(d_silu, slope), lanes);
  });
}

int available_cores() {
  if (const char* forced = std::getenv("SA3MLX_KERNEL_THREADS")) return std::max(1, std::atoi(forced));
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// body(first_row, last_row) over [0, rows), split in contiguous ranges over up to the available cores
template <class F>
void parallel_rows(int64_t rows, int64_t row_elements, F body) {
  static const int cores = available_cores();
  const int64_t by_work = std::max<int64_t>(1, rows * row_elements / ELEMENTS_PER_THREAD);
  const int threads = static_cast<int>(std::min<int64_t>({cores, by_work, rows}));
  if (threads <= 1) {
    body(int64_t{0}, rows);
    return;
  }
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) workers.emplace_back(body, rows * t / threads, rows * (t + 1) / threads);
  body(int64_t{0}, rows / threads);
  for (auto& w : workers) w.join();
}

void check_rows(const mx::array& a, const char* op) {
  if (a.dtype() != mx::float32 || !a.flags().row_contiguous) {
    throw std::invalid_argument(std::string(op) + ": expects a row-contiguous float32 array");
  }
}

// output buffer: the donated input's when it may be overwritten row by row, else a new one
void allocate(mx::array& out, const mx::array& donor) {
  if (donor.is_donatable() && donor.nbytes() == out.nbytes() && donor.flags().row_contiguous) {
    out.copy_shared_buffer(donor);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

// new buffers for every output, the arrays registered with the stream's encoder (kept alive until its task ran)
mx::cpu::CommandEncoder& encoder_with_new_outputs(mx::Stream stream, const std::vector<mx::array>& inputs,
                                                  std::vector<mx::array>& outputs) {
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& out : outputs) encoder.set_output_array(out);
  return encoder;
}

class RowPrimitive : public mx::Primitive {
 public:
  enum class Kind { Softmax, SoftmaxVjp, Sigmoid, SwiGLU, SwiGLUVjp };
  RowPrimitive(mx::Stream stream, Kind kind) : mx::Primitive(stream), kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (const auto& a : inputs) check_rows(a, name());
    auto& out = outputs[0];
    const auto& x = inputs[0];
    const int64_t n = x.ndim() == 0 ? 1 : x.shape(-1);
    const int64_t rows = n == 0 ? 0 : x.size() / n;
    allocate(out, kind_ == Kind::SoftmaxVjp ? inputs[1] : x);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const float* a0 = x.data<float>();
    const float* a1 = inputs.size() > 1 ? inputs[1].data<float>() : nullptr;
    float* o = out.data<float>();
    encoder.dispatch([kind = kind_, a0, a1, o, rows, n]() {
      parallel_rows(rows, n, [=](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) {
          switch (kind) {
            case Kind::Softmax: softmax_row(a0 + r * n, o + r * n, n); break;
            case Kind::SoftmaxVjp: softmax_vjp_row(a0 + r * n, a1 + r * n, o + r * n, n); break;
            case Kind::Sigmoid: sigmoid_row(a0 + r * n, o + r * n, n); break;
            case Kind::SwiGLU: swiglu_row(a0 + r * n, o + r * (n / 2), n / 2); break;
            case Kind::SwiGLUVjp: swiglu_vjp_row(a0 + r * n, a1 + r * (n / 2), o + r * n, n / 2); break;
          }
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("sa3mlx native kernels run on the CPU only");
  }

  const char* name() const override {
    switch (kind_) {
      case Kind::Softmax: return "Sa3Softmax";
      case Kind::SoftmaxVjp: return "Sa3SoftmaxVjp";
      case Kind::Sigmoid: return "Sa3Sigmoid";
      case Kind::SwiGLU: return "Sa3SwiGLU";
      default: return "Sa3SwiGLUVjp";
    }
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* same = dynamic_cast<const RowPrimitive*>(&other);
    return same != nullptr && same->kind_ == kind_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    if (kind_ == Kind::SwiGLU) shape.back() /= 2;
    return {shape};
  }

 private:
  Kind kind_;
};

mx::array row_op(RowPrimitive::Kind kind, std::vector<mx::array> inputs, mx::Shape shape) {
  for (auto& a : inputs) {
    if (a.dtype() != mx::float32) throw std::invalid_argument("sa3mlx native kernels take float32 only");
    a = mx::contiguous(a);  // shares the buffer when already row-contiguous
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(std::move(shape), mx::float32, std::make_shared<RowPrimitive>(stream, kind), std::move(inputs));
}

mx::array softmax(const mx::array& x) { return row_op(RowPrimitive::Kind::Softmax, {x}, x.shape()); }

mx::array softmax_vjp(const mx::array& s, const mx::array& g) {
  if (s.shape() != g.shape()) throw std::invalid_argument("softmax_vjp: s and g differ in shape");
  return row_op(RowPrimitive::Kind::SoftmaxVjp, {s, g}, s.shape());
}

mx::array sigmoid(const mx::array& x) { return row_op(RowPrimitive::Kind::Sigmoid, {x}, x.shape()); }

mx::array swiglu(const mx::array& h) {
  if (h.ndim() == 0 || h.shape(-1) % 2 != 0) throw std::invalid_argument("swiglu: last axis must be even");
  auto shape = h.shape();
  shape.back() /= 2;
  return row_op(RowPrimitive::Kind::SwiGLU, {h}, shape);
}

mx::array swiglu_vjp(const mx::array& h, const mx::array& g) {
  auto half = h.shape();
  if (half.empty() || half.back() % 2 != 0) throw std::invalid_argument("swiglu_vjp: last axis must be even");
  half.back() /= 2;
  if (g.shape() != half) throw std::invalid_argument("swiglu_vjp: g must have h's shape with half its last axis");
  return row_op(RowPrimitive::Kind::SwiGLUVjp, {h, g}, h.shape());
}

// ---- RMSNorm and its backward, rows read in place at any leading strides ----
// MLX's CPU runs both as 4-6 separate single-threaded passes. Formulas as MLX's fast.rms_norm:
// y = (x·r)·w, r = 1/sqrt(mean(x²) + eps); dx = r·(w·g) - x·r³·Σ(w·g·x)/n.
// Strides are only known at evaluation: a last axis that is not contiguous (a matmul gradient's
// transposed view, say) is gathered into `owned` inside the task, when the data is ready.
struct RowAddress {
  const float* data;
  std::vector<int64_t> shape, strides;  // the leading axes
  int64_t n, last_stride;
  std::shared_ptr<std::vector<float>> owned;

  explicit RowAddress(const mx::array& a)
      : data(a.data<float>()), n(a.shape(-1)), last_stride(a.strides().back()) {
    for (int axis = 0; axis + 1 < a.ndim(); ++axis) {
      shape.push_back(a.shape(axis));
      strides.push_back(a.strides()[axis]);
    }
  }

  const float* strided_row(int64_t r) const {
    int64_t offset = 0;
    for (int axis = static_cast<int>(shape.size()) - 1; axis >= 0; --axis) {
      offset += (r % shape[axis]) * strides[axis];
      r /= shape[axis];
    }
    return data + offset;
  }

  void gather_if_strided(int64_t rows) {
    if (last_stride == 1 || n <= 1) return;
    owned = std::make_shared<std::vector<float>>(rows * n);
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = strided_row(r);
      for (int64_t j = 0; j < n; ++j) (*owned)[r * n + j] = src[j * last_stride];
    }
  }

  const float* row(int64_t r) const { return owned ? owned->data() + r * n : strided_row(r); }
};

inline float inverse_rms(const float* x, int n, float eps) {
  __m256 squares = _mm256_setzero_ps();
  for_blocks(n, [&](int i, int lanes) {
    const __m256 v = load(x + i, lanes);
    squares = _mm256_fmadd_ps(v, v, squares);
  });
  return 1.0f / std::sqrt(horizontal_sum(squares) / n + eps);
}

void rms_norm_row(const float* x, const float* w, float* out, int n, float eps) {
  const __m256 r = _mm256_set1_ps(inverse_rms(x, n, eps));
  for_blocks(n, [&](int i, int lanes) {
    store(out + i, _mm256_mul_ps(_mm256_mul_ps(load(x + i, lanes), r), load(w + i, lanes)), lanes);
  });
}

void rms_norm_vjp_row(const float* x, const float* w, const float* g, float* dx, int n, float eps) {
  const float r = inverse_rms(x, n, eps);
  __m256 dot = _mm256_setzero_ps();
  for_blocks(n, [&](int i, int lanes) {
    dot = _mm256_fmadd_ps(_mm256_mul_ps(load(w + i, lanes), load(g + i, lanes)), load(x + i, lanes), dot);
  });
  const __m256 rv = _mm256_set1_ps(r), coefficient = _mm256_set1_ps(r * r * r * horizontal_sum(dot) / n);
  for_blocks(n, [&](int i, int lanes) {
    const __m256 wg = _mm256_mul_ps(load(w + i, lanes), load(g + i, lanes));
    store(dx + i, _mm256_fnmadd_ps(load(x + i, lanes), coefficient, _mm256_mul_ps(rv, wg)), lanes);
  });
}

class RmsNormPrimitive : public mx::Primitive {
 public:
  RmsNormPrimitive(mx::Stream stream, float eps, bool backward)
      : mx::Primitive(stream), eps_(eps), backward_(backward) {}

  // inputs: x, w (forward); x, w, g (backward) -> one row-contiguous output shaped as x
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &x = inputs[0], &w = inputs[1];
    auto& encoder = encoder_with_new_outputs(stream(), inputs, outputs);
    auto& out = outputs[0];
    const int n = x.ndim() == 0 ? 1 : x.shape(-1);
    const int64_t rows = n == 0 ? 0 : x.size() / n;
    RowAddress xs(x);
    std::optional<RowAddress> gs;
    if (backward_) gs.emplace(inputs[2]);
    encoder.dispatch([xs, gs, w = w.data<float>(), o = out.data<float>(), n, rows, eps = eps_]() mutable {
      xs.gather_if_strided(rows);
      if (gs) gs->gather_if_strided(rows);
      parallel_rows(rows, n, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) {
          if (gs) {
            rms_norm_vjp_row(xs.row(r), w, gs->row(r), o + r * n, n, eps);
          } else {
            rms_norm_row(xs.row(r), w, o + r * n, n, eps);
          }
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("sa3mlx native kernels run on the CPU only");
  }

  const char* name() const override { return backward_ ? "Sa3RmsNormVjp" : "Sa3RmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* same = dynamic_cast<const RmsNormPrimitive*>(&other);
    return same != nullptr && same->eps_ == eps_ && same->backward_ == backward_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_;
  bool backward_;
};

mx::array rms_norm_op(std::vector<mx::array> inputs, float eps, bool backward) {
  const auto& x = inputs[0];
  if (x.ndim() == 0 || inputs[1].ndim() != 1 || inputs[1].shape(0) != x.shape(-1)) {
    throw std::invalid_argument("rms_norm: expects x [..., n] and a weight [n]");
  }
  if (backward && inputs[2].shape() != x.shape()) throw std::invalid_argument("rms_norm_vjp: g must have x's shape");
  for (auto& a : inputs) {
    if (a.dtype() != mx::float32) throw std::invalid_argument("rms_norm: float32 only");
  }
  inputs[1] = mx::contiguous(inputs[1]);
  auto shape = x.shape();
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(std::move(shape), mx::float32, std::make_shared<RmsNormPrimitive>(stream, eps, backward),
                   std::move(inputs));
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) { return rms_norm_op({x, w}, eps, false); }

mx::array rms_norm_vjp(const mx::array& x, const mx::array& w, const mx::array& g, float eps) {
  return rms_norm_op({x, w, g}, eps, true);
}


// ---- RoPE with half-split (rotate_half) pairing, rows read in place ----
// x [..., L, D] by rows, cos/sin [L, R]: out = x·cos + rotate_half(x)·sin on the first R dims, the rest copied;
// the products rounded before the sum, as MLX evaluates the formula. The backward is its transpose:
// dx_i = g_i·c_i + g_{i+h}·s_{i+h}, dx_{i+h} = g_{i+h}·c_{i+h} − g_i·s_i (h = R/2).
void rope_row(const float* x, const float* c, const float* s, float* out, int n, int rot, bool backward) {
  const int half = rot / 2;
  for_blocks(half, [&](int i, int lanes) {
    const __m256 a = load(x + i, lanes), b = load(x + half + i, lanes);
    const __m256 c1 = load(c + i, lanes), c2 = load(c + half + i, lanes);
    const __m256 s1 = load(s + i, lanes), s2 = load(s + half + i, lanes);
    if (backward) {
      store(out + i, _mm256_add_ps(_mm256_mul_ps(a, c1), _mm256_mul_ps(b, s2)), lanes);
      store(out + half + i, _mm256_sub_ps(_mm256_mul_ps(b, c2), _mm256_mul_ps(a, s1)), lanes);
    } else {
      store(out + i, _mm256_sub_ps(_mm256_mul_ps(a, c1), _mm256_mul_ps(b, s1)), lanes);
      store(out + half + i, _mm256_add_ps(_mm256_mul_ps(b, c2), _mm256_mul_ps(a, s2)), lanes);
    }
  });
  std::copy(x + rot, x + n, out + rot);
}

class RopePrimitive : public mx::Primitive {
 public:
  RopePrimitive(mx::Stream stream, bool backward) : mx::Primitive(stream), backward_(backward) {}

  // inputs: x (or the cotangent), cos, sin -> one row-contiguous output shaped as x
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto &x = inputs[0], &cos = inputs[1], &sin = inputs[2];
    check_rows(cos, name());
    check_rows(sin, name());
    auto& encoder = encoder_with_new_outputs(stream(), inputs, outputs);
    auto& out = outputs[0];
    const int n = x.shape(-1), rot = cos.shape(-1), length = x.shape(-2);
    const int64_t rows = n == 0 ? 0 : x.size() / n;
    RowAddress xs(x);
    encoder.dispatch([xs, c = cos.data<float>(), s = sin.data<float>(), o = out.data<float>(), n, rot, length, rows,
                      backward = backward_]() mutable {
      xs.gather_if_strided(rows);
      parallel_rows(rows, n, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) {
          const int64_t position = r % length;
          rope_row(xs.row(r), c + position * rot, s + position * rot, o + r * n, n, rot, backward);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("sa3mlx native kernels run on the CPU only");
  }

  const char* name() const override { return backward_ ? "Sa3RopeVjp" : "Sa3Rope"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* same = dynamic_cast<const RopePrimitive*>(&other);
    return same != nullptr && same->backward_ == backward_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  bool backward_;
};

mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin, bool backward) {
  if (x.ndim() < 2 || cos.ndim() != 2 || sin.shape() != cos.shape() || cos.shape(0) != x.shape(-2) ||
      cos.shape(1) % 2 != 0 || cos.shape(1) > x.shape(-1)) {
    throw std::invalid_argument("rope: expects x [..., L, D] and cos, sin [L, R], R even and <= D");
  }
  for (const auto* a : {&x, &cos, &sin}) {
    if (a->dtype() != mx::float32) throw std::invalid_argument("rope: float32 only");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RopePrimitive>(stream, backward),
                   {x, mx::contiguous(cos), mx::contiguous(sin)});
}

// ---- AdamW over every adapter tensor at once, and sums of squares ----
// MLX runs the optimizer as a dozen small ops per tensor (~140 ms for 9.2 M values on 2 cores, most of it
// dispatch and allocation); here one pass reads p, g, m, v and writes p, m, v for all tensors. Work is cut
// into fixed chunks whose partial sums are added in order: the same bytes on any thread count.
constexpr int64_t CHUNK = 1 << 15;

struct Chunk {
  int tensor;
  int64_t begin, end;
};

std::vector<Chunk> chunks_of(const std::vector<mx::array>& tensors, size_t first, size_t count) {
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < count; ++t) {
    const int64_t size = tensors[first + t].size();
    for (int64_t b = 0; b < size; b += CHUNK) chunks.push_back({static_cast<int>(t), b, std::min(size, b + CHUNK)});
  }
  return chunks;
}

// out[t] = Σ partial[c] over tensor t's chunks, in chunk order
void sum_chunks(const std::vector<Chunk>& chunks, const std::vector<double>& partial, float* out, size_t count) {
  std::vector<double> total(count, 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) total[chunks[c].tensor] += partial[c];
  for (size_t t = 0; t < count; ++t) out[t] = static_cast<float>(total[t]);
}

double sum_squares_range(const float* x, int64_t n) {
  __m256 squares = _mm256_setzero_ps();
  for_blocks(static_cast<int>(n), [&](int i, int lanes) {
    const __m256 v = load(x + i, lanes);
    squares = _mm256_fmadd_ps(v, v, squares);
  });
  return horizontal_sum(squares);
}

void check_contiguous(const std::vector<mx::array>& inputs, const char* op) {
  for (const auto& a : inputs) {
    if (a.dtype() != mx::float32 || !a.flags().row_contiguous) {
      throw std::invalid_argument(std::string(op) + ": expects row-contiguous float32 arrays");
    }
  }
}

// inputs: n tensors -> one [n] vector of their sums of squares
class SumSquaresPrimitive : public mx::Primitive {
 public:
  explicit SumSquaresPrimitive(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    check_contiguous(inputs, name());
    auto& encoder = encoder_with_new_outputs(stream(), inputs, outputs);
    auto& out = outputs[0];
    std::vector<const float*> data;
    for (const auto& a : inputs) data.push_back(a.data<float>());
    encoder.dispatch([chunks = chunks_of(inputs, 0, inputs.size()), data, o = out.data<float>()]() {
      std::vector<double> partial(chunks.size());
      parallel_rows(static_cast<int64_t>(chunks.size()), CHUNK, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          const auto& k = chunks[c];
          partial[c] = sum_squares_range(data[k.tensor] + k.begin, k.end - k.begin);
        }
      });
      sum_chunks(chunks, partial, o, data.size());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("sa3mlx native kernels run on the CPU only");
  }

  const char* name() const override { return "Sa3SumSquares"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const SumSquaresPrimitive*>(&other) != nullptr;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{static_cast<int>(inputs.size())}};
  }
};

mx::array sum_squares(std::vector<mx::array> tensors) {
  for (auto& a : tensors) {
    if (a.dtype() != mx::float32) throw std::invalid_argument("sum_squares: float32 only");
    a = mx::contiguous(a);
  }
  const int n = static_cast<int>(tensors.size());
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array({n}, mx::float32, std::make_shared<SumSquaresPrimitive>(stream), std::move(tensors));
}

// The scalars of one update, computed in MLX as mlx.optimizers.AdamW computes them
enum Scalar { GRAD_SCALE, DECAY, STEP_SIZE, RSQRT_BIAS2, KEEP_NEW, SCALARS };

struct AdamWConstants {
  float b1, one_minus_b1, b2, one_minus_b2, eps;
};

// g = g·scale; p = p·decay; m = b1·m + (1-b1)·g; v = b2·v + (1-b2)·g²; p -= c1·m / (√v·c2 + eps);
// returns Σ g² (the clipped gradient's); the ops in MLX's order, unfused, as MLX's AdamW writes them
double adamw_range(const float* s, const AdamWConstants& k, const float* p, const float* g, const float* m,
                   const float* v, float* p_out, float* m_out, float* v_out, int64_t n) {
  const __m256 scale = _mm256_set1_ps(s[GRAD_SCALE]), decay = _mm256_set1_ps(s[DECAY]);
  const __m256 c1 = _mm256_set1_ps(s[STEP_SIZE]), c2 = _mm256_set1_ps(s[RSQRT_BIAS2]);
  const __m256 b1 = _mm256_set1_ps(k.b1), a1 = _mm256_set1_ps(k.one_minus_b1);
  const __m256 b2 = _mm256_set1_ps(k.b2), a2 = _mm256_set1_ps(k.one_minus_b2), eps = _mm256_set1_ps(k.eps);
  __m256 squares = _mm256_setzero_ps();
  for_blocks(static_cast<int>(n), [&](int i, int lanes) {
    const __m256 gv = _mm256_mul_ps(load(g + i, lanes), scale);
    const __m256 g2 = _mm256_mul_ps(gv, gv);
    squares = _mm256_add_ps(squares, g2);
    const __m256 mv = _mm256_add_ps(_mm256_mul_ps(b1, load(m + i, lanes)), _mm256_mul_ps(a1, gv));
    const __m256 vv = _mm256_add_ps(_mm256_mul_ps(b2, load(v + i, lanes)), _mm256_mul_ps(a2, g2));
    const __m256 denominator = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vv), c2), eps);
    const __m256 pv = _mm256_mul_ps(load(p + i, lanes), decay);
    store(p_out + i, _mm256_sub_ps(pv, _mm256_div_ps(_mm256_mul_ps(c1, mv), denominator)), lanes);
    store(m_out + i, mv, lanes);
    store(v_out + i, vv, lanes);
  });
  return horizontal_sum(squares);
}

// inputs: scalars [SCALARS], then n each of p, g, m, v -> n each of p, m, v, then [n] Σ(clipped g)²;
// scalars[KEEP_NEW] == 0 (a non-finite step) copies p, m, v through and gives zero sums. Each output has
// all the others as siblings, and MLX's graph and compile work grow with their square: callers pass a
// few dozen tensors at a time (kernels.ADAMW_GROUP).
class AdamWPrimitive : public mx::Primitive {
 public:
  AdamWPrimitive(mx::Stream stream, AdamWConstants constants) : mx::Primitive(stream), k_(constants) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    check_contiguous(inputs, name());
    const size_t n = (inputs.size() - 1) / 4;
    auto& encoder = encoder_with_new_outputs(stream(), inputs, outputs);
    std::vector<const float*> in;
    std::vector<float*> out;
    for (const auto& a : inputs) in.push_back(a.data<float>());
    for (auto& a : outputs) out.push_back(a.data<float>());
    encoder.dispatch([chunks = chunks_of(inputs, 1, n), in, out, n, k = k_]() {
      const float* s = in[0];
      std::vector<double> partial(chunks.size(), 0.0);
      parallel_rows(static_cast<int64_t>(chunks.size()), CHUNK, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          const auto& ch = chunks[c];
          const size_t t = ch.tensor;
          const int64_t b = ch.begin, len = ch.end - ch.begin;
          const float *p = in[1 + t] + b, *g = in[1 + n + t] + b, *m = in[1 + 2 * n + t] + b, *v = in[1 + 3 * n + t] + b;
          float *p_out = out[t] + b, *m_out = out[n + t] + b, *v_out = out[2 * n + t] + b;
          if (s[KEEP_NEW] != 0.0f) {
            partial[c] = adamw_range(s, k, p, g, m, v, p_out, m_out, v_out, len);
          } else {
            std::copy(p, p + len, p_out);
            std::copy(m, m + len, m_out);
            std::copy(v, v + len, v_out);
          }
        }
      });
      sum_chunks(chunks, partial, out[3 * n], n);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("sa3mlx native kernels run on the CPU only");
  }

  const char* name() const override { return "Sa3AdamW"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* same = dynamic_cast<const AdamWPrimitive*>(&other);
    return same != nullptr && std::memcmp(&same->k_, &k_, sizeof(k_)) == 0;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const size_t n = (inputs.size() - 1) / 4;
    std::vector<mx::Shape> shapes;
    for (int copy = 0; copy < 3; ++copy) {
      for (size_t t = 0; t < n; ++t) shapes.push_back(inputs[1 + t].shape());
    }
    shapes.push_back({static_cast<int>(n)});
    return shapes;
  }

 private:
  AdamWConstants k_;
};

std::vector<mx::array> adamw(const mx::array& scalars, const std::vector<mx::array>& params,
                             const std::vector<mx::array>& grads, const std::vector<mx::array>& ms,
                             const std::vector<mx::array>& vs, float b1, float one_minus_b1, float b2,
                             float one_minus_b2, float eps) {
  const size_t n = params.size();
  if (grads.size() != n || ms.size() != n || vs.size() != n) throw std::invalid_argument("adamw: list lengths differ");
  if (scalars.shape() != mx::Shape{SCALARS} || scalars.dtype() != mx::float32) {
    throw std::invalid_argument("adamw: scalars must be float32 [5]");
  }
  std::vector<mx::array> inputs{mx::contiguous(scalars)};
  for (const auto* group : {&params, &grads, &ms, &vs}) {
    for (size_t t = 0; t < n; ++t) {
      const auto& a = (*group)[t];
      if (a.dtype() != mx::float32 || a.shape() != params[t].shape()) {
        throw std::invalid_argument("adamw: every p, g, m, v must be float32 of its parameter's shape");
      }
      inputs.push_back(mx::contiguous(a));
    }
  }
  std::vector<mx::Shape> shapes;
  for (int copy = 0; copy < 3; ++copy) {
    for (const auto& p : params) shapes.push_back(p.shape());
  }
  shapes.push_back({static_cast<int>(n)});
  auto stream = mx::default_stream(mx::Device::cpu);
  AdamWConstants constants{b1, one_minus_b1, b2, one_minus_b2, eps};
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(3 * n + 1, mx::float32),
                                std::make_shared<AdamWPrimitive>(stream, constants), std::move(inputs));
}

}  // namespace

NB_MODULE(_sa3mlx_cpu, m) {
  m.def("softmax", &softmax, "softmax over the last axis");
  m.def("softmax_vjp", &softmax_vjp, "s·g - s·Σ(s·g) over the last axis");
  m.def("sigmoid", &sigmoid);
  m.def("swiglu", &swiglu, "h = [value | gate] on the last axis -> value·silu(gate)");
  m.def("swiglu_vjp", &swiglu_vjp, "the gradient w.r.t. h of swiglu(h) for cotangent g");
  m.def("rms_norm", &rms_norm, "(x·r)·w over the last axis, r = 1/sqrt(mean(x²) + eps)");
  m.def("rope", &rope, "x·cos + rotate_half(x)·sin on the first R dims (backward: its transpose)");
  m.def("sum_squares", &sum_squares, "[Σ x² of each array], deterministic on any thread count");
  m.def("adamw", &adamw, "one AdamW step over lists of p, g, m, v -> (p..., m..., v..., [Σ (g·scale)²])");
  m.def("rms_norm_vjp", &rms_norm_vjp, "the gradient w.r.t. x of rms_norm(x, w, eps) for cotangent g");
}
