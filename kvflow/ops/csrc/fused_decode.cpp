// kvflow C++ CPU kernel: a whole Llama-family decoder step for a few decode tokens over
// GGUF-packed weights, one call for all layers (``FusedDecoder.forward``).
// Python side and documentation: kvflow/layers/fused_decode.py.
// Built on first use by kvflow.ops.build (torch.utils.cpp_extension.load, -O3 -march=$KVFLOW_CPU_MARCH).
//
// It reuses the other kernels' routines by including their sources (their bindings left out,
// KVFLOW_NO_BINDINGS; kvflow.ops.build hashes the included sources into this build's name):
// gguf_matmul.cpp's activation quantization (quantize_rows) and packed GEMV (dispatch_packed),
// paged_attention.cpp's decode attention (decode_kernel). Per layer and token row m:
//
//   h = RMSNorm(x) w_in                     (rms_norm.cpp's arithmetic)
//   qkv = h Wqkv^T (+ b)                    (one activation quantization for Q, K and V)
//   q, k = rotary(q, k) (neox, cos / signed sin tables, partial rotary passes the rest)
//   K/V cache[slot_mapping[m]] = k, v
//   o = paged decode attention(q, cache, block_tables[m], context_lens[m]) (GQA)
//   x = x + o Wo^T
//   h = RMSNorm(x) w_post; g, u = h Wgu^T; x = x + (silu(g) u) Wdown^T
//
// and after the last layer y = RMSNorm(x) w_final. Values are computed in float32 and rounded
// to the model dtype T where the PyTorch path stores a T tensor (norm outputs, projections,
// rotated heads, residual sums), so float32 and bfloat16 models follow the PyTorch path's
// roundings up to the order of float32 sums.

#define KVFLOW_NO_BINDINGS 1
#include "gguf_matmul.cpp"
#include "paged_attention.cpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Float8_e4m3fn.h>
#include <mutex>
#include <tuple>
#include <variant>

namespace kvflow_fused {

template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

#if defined(GG_AVX2)
// e^x for 8 floats, x clamped to [-87.3, 88] (e^88 = 1.65e38): paged_attention.cpp's exp8_cephes.
inline __m256 exp8(__m256 x) {
  return exp8_cephes(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f)));
}

// 8 floats rounded to bfloat16 and back (round to nearest even, as c10::BFloat16; NaN kept).
inline __m256 rnd_bf16(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

template <typename T>
inline __m256 rnd8(__m256 x) {
  if constexpr (std::is_same<T, float>::value) return x;
  else return rnd_bf16(x);
}

// Eight T values as float32 (bfloat16: the upper half of a float32, exact).
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight floats that a T holds exactly (rounded by rnd8<T>) stored as T (bfloat16: the upper halves).
inline void st8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void st8(c10::BFloat16* p, __m256 v) {
  const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// act[i] = T(T(silu(g)) u) with g = T(gu[i]), u = T(gu[n + i]) for i < n: the PyTorch path's
// F.silu(gate) * up in T (silu(g) = g / (1 + e^-g)). bfloat16 in vectors (the vector e^x is
// within 2 ulp, ATen's within 1; after the bfloat16 roundings the two agreed on every one of
// 71,680 random values); float32 with std::exp, element by element: the int8 activations of the
// next product amplify a last-bit change, and a float32 model's greedy tokens against its
// dequantized reference (tests/quantization/test_gguf_native.py) moved with the vector e^x.
template <typename T>
void silu_mul(const float* gu, int64_t n, float* act) {
  int64_t i = 0;
#if defined(GG_AVX2)
  if constexpr (!std::is_same<T, float>::value)
  for (; i + 8 <= n; i += 8) {
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 g = rnd8<T>(_mm256_loadu_ps(gu + i)), u = rnd8<T>(_mm256_loadu_ps(gu + n + i));
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = rnd8<T>(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    _mm256_storeu_ps(act + i, rnd8<T>(_mm256_mul_ps(s, u)));
  }
#endif
  for (; i < n; ++i) {
    const float g = rnd<T>(gu[i]), u = rnd<T>(gu[n + i]);
    act[i] = rnd<T>(rnd<T>(g / (1.f + std::exp(-g))) * u);
  }
}

// One stored part of a linear's rows: packed (gguf_pack's layout) rows [offset, offset + n).
struct Segment {
  torch::Tensor packed;
  int qt;
  int64_t offset, n, ldg;
  PFmt pf;
};

// A linear's weight: GGUF-packed segments, or one dense bfloat16 weight prepacked for oneDNN
// (``torch.ops.mkldnn._reorder_linear_weight``, as kvflow.layers.linear's PackedLinear holds it),
// multiplied by the same oneDNN call as the PyTorch path (mkldnn::_linear_pointwise).
struct Linear {
  std::vector<Segment> segs;
  int64_t K = 0, N = 0;
  torch::Tensor bias;  // GGUF: float32 [N] or undefined
  torch::Tensor dense;                       // the prepacked weight [N, K], or undefined (GGUF)
  c10::optional<torch::Tensor> dense_bias;   // bfloat16 [N], as the PyTorch path passes it
};

using LinearOp = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);

// oneDNN's linear on a prepacked weight (registered by PyTorch under mkldnn::_linear_pointwise).
inline const c10::TypedOperatorHandle<LinearOp>& onednn_linear() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearOp>();
  return op;
}

struct Layer {
  torch::Tensor ln_in, ln_post;  // float32 [H]
  Linear qkv, o, gate_up, down;
};

using SegmentSpec = std::tuple<torch::Tensor, int64_t, int64_t, int64_t>;  // packed, qtype, offset, rows
// A linear as add_layer takes it: a prepacked dense bfloat16 weight, or its GGUF segments.
using LinearSpec = std::variant<torch::Tensor, std::vector<SegmentSpec>>;

class FusedDecoder {
 public:
  FusedDecoder(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               double eps, double scale, torch::Tensor final_norm)
      : H_(hidden), nh_(num_heads), nkv_(num_kv_heads), D_(head_dim), I_(intermediate), eps_(eps), scale_(scale) {
    TORCH_CHECK(hidden > 0 && hidden % 32 == 0, "hidden_size: a positive multiple of 32, got ", hidden);
    TORCH_CHECK(intermediate > 0 && intermediate % 32 == 0, "intermediate_size: a positive multiple of 32, got ",
                intermediate);
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads: a multiple of num_kv_heads");
    TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= 512 && (num_heads * head_dim) % 32 == 0,
                "head_dim: even, at most 512, num_heads * head_dim a multiple of 32");
    final_norm_ = norm_weight(final_norm, "final_norm");
  }

  // Each linear: its GGUF segments (packed, qtype, offset, rows) or a prepacked dense bfloat16
  // weight (then the model dtype must be bfloat16).
  void add_layer(torch::Tensor ln_in, const LinearSpec& qkv, c10::optional<torch::Tensor> qkv_bias,
                 const LinearSpec& o, torch::Tensor ln_post, const LinearSpec& gate_up, const LinearSpec& down) {
    Layer l;
    l.ln_in = norm_weight(ln_in, "ln_in");
    l.ln_post = norm_weight(ln_post, "ln_post");
    l.qkv = linear(qkv, H_, (nh_ + 2 * nkv_) * D_, "qkv");
    if (qkv_bias.has_value()) {
      TORCH_CHECK(qkv_bias->numel() == l.qkv.N, "qkv_bias: [", l.qkv.N, "]");
      if (l.qkv.dense.defined()) l.qkv.dense_bias = qkv_bias->to(torch::kBFloat16).contiguous();
      else l.qkv.bias = qkv_bias->to(torch::kFloat32).contiguous();
    }
    l.o = linear(o, nh_ * D_, H_, "o");
    l.gate_up = linear(gate_up, H_, 2 * I_, "gate_up");
    l.down = linear(down, I_, H_, "down");
    for (const Linear* x : {&l.qkv, &l.o, &l.gate_up, &l.down}) has_dense_ = has_dense_ || x->dense.defined();
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The paged caches, one (K, V) per layer: [num_blocks, block_size, num_kv_heads, head_dim],
  // contiguous, all of one shape and dtype.
  void set_kv_caches(const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "kv caches: one K and one V per layer (",
                layers_.size(), ")");
    for (size_t i = 0; i < k.size(); ++i) {
      TORCH_CHECK(k[i].device().is_cpu() && k[i].dim() == 4 && k[i].is_contiguous() && v[i].is_contiguous() &&
                      v[i].sizes() == k[i].sizes() && k[i].scalar_type() == v[i].scalar_type() &&
                      k[i].sizes() == k[0].sizes() && k[i].scalar_type() == k[0].scalar_type() &&
                      k[i].size(2) == nkv_ && k[i].size(3) == D_,
                  "kv caches: contiguous [num_blocks, block_size, ", nkv_, ", ", D_, "] of one dtype");
    }
    k_ = k;
    v_ = v;
    quantized_ = false;
  }

  // An int8 / fp8 (e4m3fn) paged cache instead (kvflow.attention.kv_cache's layout), per layer:
  // codes uint8 [num_blocks, block_size, num_kv_heads, head_dim] (K, V; fp8 codes as their
  // bytes), scales float16 [num_blocks, block_size, num_kv_heads] (K, V); lut float32 [256] (a
  // code's value), code_format 1 (int8) or 2 (fp8: paged_attention_quantized's); key_offsets:
  // per layer a float32 [num_kv_heads * head_dim] subtracted from the keys before they are
  // quantized (in the model dtype: LlamaAttention._key_offset), or an empty tensor for none.
  // New K/V are quantized as kv_cache.quantize_kv does (per token and head, symmetric: scale =
  // max(amax / qmax, 1e-8), code = round-half-even (int8) or e4m3fn-rounded (fp8) of x / scale
  // clamped to +-qmax, the scale stored as float16); attention is paged_attention_quantized's.
  void set_quantized_kv_caches(const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v,
                               const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
                               torch::Tensor lut, int64_t code_format, const std::vector<torch::Tensor>& key_offsets) {
    const size_t L = layers_.size();
    TORCH_CHECK(k.size() == L && v.size() == L && k_scales.size() == L && v_scales.size() == L && key_offsets.size() == L,
                "quantized kv caches: one K, V, K scale, V scale and key offset per layer (", L, ")");
    TORCH_CHECK(code_format == CODES_INT8 || code_format == CODES_FP8_E4M3, "code_format: 1 (int8) or 2 (fp8), got ",
                code_format);
    TORCH_CHECK(lut.scalar_type() == torch::kFloat32 && lut.numel() == 256 && lut.is_contiguous(), "lut: float32 [256]");
    for (size_t i = 0; i < L; ++i) {
      TORCH_CHECK(k[i].device().is_cpu() && k[i].scalar_type() == torch::kUInt8 && v[i].scalar_type() == torch::kUInt8 &&
                      k[i].dim() == 4 && k[i].is_contiguous() && v[i].is_contiguous() && v[i].sizes() == k[i].sizes() &&
                      k[i].sizes() == k[0].sizes() && k[i].size(2) == nkv_ && k[i].size(3) == D_,
                  "quantized kv caches: contiguous uint8 [num_blocks, block_size, ", nkv_, ", ", D_, "]");
      for (const torch::Tensor* sc : {&k_scales[i], &v_scales[i]})
        TORCH_CHECK(sc->scalar_type() == torch::kHalf && sc->is_contiguous() && sc->dim() == 3 &&
                        sc->size(0) == k[i].size(0) && sc->size(1) == k[i].size(1) && sc->size(2) == nkv_,
                    "quantized kv caches: scales float16 [num_blocks, block_size, ", nkv_, "]");
      TORCH_CHECK(key_offsets[i].numel() == 0 || (key_offsets[i].scalar_type() == torch::kFloat32 &&
                                                  key_offsets[i].is_contiguous() && key_offsets[i].numel() == nkv_ * D_),
                  "key_offsets: float32 [", nkv_ * D_, "] or empty");
    }
    k_ = k;
    v_ = v;
    k_scales_ = k_scales;
    v_scales_ = v_scales;
    key_offsets_ = key_offsets;
    lut_ = lut;
    code_format_ = code_format;
    quantized_ = true;
  }

  // x [M, H] (the token embeddings, model dtype) -> the final hidden states [M, H] after the
  // last RMSNorm. cos / sin [M, 1, R] (R <= head_dim, even), slot_mapping int64 [M] (negative:
  // not stored), block_tables int64 [M, W], context_lens int32 [M] (after this step's write).
  // Layers [first, last) only (last < 0: to the end): x is then the residual stream entering
  // layer first, and the result the one leaving layer last - 1, normalized only when last is
  // the end (one call per layer computes what one call for all does: the benchmark's baseline).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor context_lens, int64_t first, int64_t last) {
    std::lock_guard<std::mutex> guard(mutex_);  // the scratch buffers serve one forward at a time
    TORCH_CHECK(!k_.empty(), "set_kv_caches first");
    const int64_t L = num_layers();
    if (last < 0) last = L;
    TORCH_CHECK(0 <= first && first < last && last <= L, "layers [", first, ", ", last, ") outside 0 .. ", L);
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == H_ && x.is_contiguous(), "x: contiguous [M, ", H_,
                "]");
    TORCH_CHECK(quantized_ || x.scalar_type() == k_[0].scalar_type(), "x and the kv caches must share a dtype");
    const int64_t M = x.size(0);
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 3 && cos.size(0) == M &&
                    cos.size(1) == 1 && cos.sizes() == sin.sizes() && cos.size(2) % 2 == 0 && cos.size(2) <= D_ &&
                    cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
                "cos / sin: contiguous [M, 1, rotary_dim] of x's dtype");
    auto slots = slot_mapping.contiguous();
    auto tables = block_tables.contiguous();
    auto ctx = context_lens.contiguous();
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == M, "slot_mapping: int64 [M]");
    TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 2 && tables.size(0) == M,
                "block_tables: int64 [M, W]");
    TORCH_CHECK(ctx.scalar_type() == torch::kInt32 && ctx.numel() == M, "context_lens: int32 [M]");
    const int64_t num_blocks = k_[0].size(0), bs = k_[0].size(1), width = tables.size(1);
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int32_t* cp = ctx.data_ptr<int32_t>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t r = 0; r < M; ++r) {  // every block and slot touched must exist (as paged_decode_attention)
      TORCH_CHECK(cp[r] >= 1 && cp[r] <= width * bs, "context_lens[", r, "] = ", cp[r],
                  " is outside 1 .. block_tables width * block_size = ", width * bs);
      for (int64_t b = 0; b < (cp[r] + bs - 1) / bs; ++b)
        TORCH_CHECK(tp[r * width + b] >= 0 && tp[r * width + b] < num_blocks, "block_tables[", r, ", ", b, "] = ",
                    tp[r * width + b], " is not a block of the cache (", num_blocks, " blocks)");
      TORCH_CHECK(sp[r] < num_blocks * bs, "slot_mapping[", r, "] = ", sp[r], " is outside the cache");
    }
    auto y = torch::empty({M, H_}, x.options());
    if (M == 0) return y;
    TORCH_CHECK(!(has_dense_ && x.scalar_type() != torch::kBFloat16), "dense (oneDNN-prepacked) weights need a bfloat16 x");
    if (x.scalar_type() == torch::kFloat32)
      run<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(2), sp, tp, width, cp, M,
                 first, last, y.data_ptr<float>());
    else {
      TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
      run<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(),
                         cos.size(2), sp, tp, width, cp, M, first, last, y.data_ptr<c10::BFloat16>());
    }
    return y;
  }

 private:
  static torch::Tensor norm_weight(const torch::Tensor& w, const char* name) {
    TORCH_CHECK(w.dim() == 1, name, ": [hidden]");
    return w.to(torch::kFloat32).contiguous();
  }

  static Linear linear(const LinearSpec& spec, int64_t K, int64_t N, const char* name) {
    Linear l;
    l.K = K;
    l.N = N;
    if (const torch::Tensor* w = std::get_if<torch::Tensor>(&spec)) {
      TORCH_CHECK(w->is_mkldnn() && w->scalar_type() == torch::kBFloat16 && w->dim() == 2 && w->size(0) == N &&
                      w->size(1) == K,
                  name, ": a prepacked bfloat16 weight [", N, ", ", K, "] (mkldnn::_reorder_linear_weight's result)");
      l.dense = *w;
      return l;
    }
    const auto& specs = std::get<std::vector<SegmentSpec>>(spec);
    int64_t covered = 0;
    for (const auto& s : specs) {
      Segment seg;
      seg.packed = std::get<0>(s);
      seg.qt = static_cast<int>(std::get<1>(s));
      seg.offset = std::get<2>(s);
      seg.n = std::get<3>(s);
      TORCH_CHECK(block_bytes(seg.qt) > 0, name, ": GGML type ", seg.qt, " is not supported");
      TORCH_CHECK(K % block_elems(seg.qt) == 0, name, ": K = ", K, " is not a multiple of the block");
      TORCH_CHECK(seg.offset == covered && seg.n > 0, name, ": segments must cover the rows in order");
      seg.pf = pfmt(seg.qt);
      seg.ldg = K / seg.pf.sb * seg.pf.sb_bytes();
      TORCH_CHECK(seg.packed.device().is_cpu() && seg.packed.scalar_type() == torch::kUInt8 &&
                      seg.packed.is_contiguous() && seg.packed.dim() == 2 && seg.packed.size(0) == (seg.n + G - 1) / G &&
                      seg.packed.size(1) == seg.ldg,
                  name, ": packed uint8 [", (seg.n + G - 1) / G, ", ", seg.ldg, "] (gguf_pack's result)");
      covered += seg.n;
      l.segs.push_back(seg);
    }
    TORCH_CHECK(covered == N, name, ": segments cover ", covered, " of ", N, " rows");
    return l;
  }

  // y [M, l.N] (float32, rows of l.N) = x [M, l.K] W^T + bias: x quantized once for all segments.
  template <typename Tin>
  void matmul(const Tin* x, int64_t M, const Linear& l, float* y) {
    if (l.dense.defined()) return matmul_dense(x, M, l, y);
    const int64_t K = l.K, nb = K / 32;
    q_.resize(M * K);
    d_.resize(M * nb);
    s16_.resize(M * 2 * nb);
    s32_.resize(M * nb);
    i16_.resize(M * 2 * nb);
    quantize_rows(x, K, M, K, q_.data(), d_.data(), s16_.data(), s32_.data(), i16_.data());
    const float* bias = l.bias.defined() ? l.bias.data_ptr<float>() : nullptr;
    const PAct a{q_.data(), d_.data(), s32_.data(), i16_.data(), K};
    for (const Segment& s : l.segs) {
      dispatch_packed<float>(s.qt, s.packed.data_ptr<uint8_t>(), s.ldg, a, M, s.n, bias ? bias + s.offset : nullptr,
                             y + s.offset, l.N);
    }
  }

  // The dense case of matmul: x (bfloat16 values) as a bfloat16 tensor, oneDNN's linear (the
  // PyTorch path's call, so the same bfloat16 result), widened into y.
  template <typename Tin>
  void matmul_dense(const Tin* x, int64_t M, const Linear& l, float* y) {
    torch::Tensor xt;
    if constexpr (std::is_same<Tin, c10::BFloat16>::value) {
      xt = torch::from_blob(const_cast<Tin*>(x), {M, l.K}, torch::kBFloat16);
    } else {
      xt = torch::empty({M, l.K}, torch::kBFloat16);
      store_row(x, M * l.K, xt.data_ptr<c10::BFloat16>());
    }
    const torch::Tensor out = onednn_linear().call(xt, l.dense, l.dense_bias, "none",
                                                   c10::List<std::optional<at::Scalar>>(), std::nullopt);
    TORCH_CHECK(out.is_contiguous() && out.size(0) == M && out.size(1) == l.N, "oneDNN linear: unexpected output");
    const c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
    int64_t i = 0;
#if defined(GG_AVX2)
    for (; i + 8 <= M * l.N; i += 8) _mm256_storeu_ps(y + i, ld8(o + i));
#endif
    for (; i < M * l.N; ++i) y[i] = static_cast<float>(o[i]);
  }

  // Rows of the residual stream x [M, H] (float32 holding T values): with p, first the residual
  // add x = T(x + T(p)) (the PyTorch path's sum of two T tensors); then, with w, the RMSNorm
  // y = T(x * rsqrt(mean(x^2) + eps) * w), rms_norm.cpp's arithmetic (16 partial sums of
  // squares by index, fused multiply-adds, added in a fixed order). Rows in parallel from 16.
  template <typename T>
  void add_rms(float* x, const float* p, const float* w, int64_t M, float* y) {
    const int64_t n = H_;  // a multiple of 32 (checked at construction)
    const float eps = static_cast<float>(eps_);
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* xr = x + r * n;
        const float* pr = p ? p + r * n : nullptr;
        float part[16] = {};
        int64_t i = 0;
#if defined(GG_AVX2)
        __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
        for (; i + 16 <= n; i += 16) {
          __m256 a = _mm256_loadu_ps(xr + i), b = _mm256_loadu_ps(xr + i + 8);
          if (pr) {
            a = rnd8<T>(_mm256_add_ps(a, rnd8<T>(_mm256_loadu_ps(pr + i))));
            b = rnd8<T>(_mm256_add_ps(b, rnd8<T>(_mm256_loadu_ps(pr + i + 8))));
            _mm256_storeu_ps(xr + i, a);
            _mm256_storeu_ps(xr + i + 8, b);
          }
          p0 = _mm256_fmadd_ps(a, a, p0);
          p1 = _mm256_fmadd_ps(b, b, p1);
        }
        _mm256_storeu_ps(part, p0);
        _mm256_storeu_ps(part + 8, p1);
#endif
        for (; i < n; ++i) {
          float v = xr[i];
          if (pr) xr[i] = v = rnd<T>(v + rnd<T>(pr[i]));
          part[i % 16] = std::fma(v, v, part[i % 16]);
        }
        if (!w) continue;
        float ss = 0.f;
        for (int j = 0; j < 16; ++j) ss += part[j];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
        float* yr = y + r * n;
        i = 0;
#if defined(GG_AVX2)
        const __m256 iv = _mm256_set1_ps(inv);
        for (; i + 8 <= n; i += 8)
          _mm256_storeu_ps(yr + i, rnd8<T>(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), iv), _mm256_loadu_ps(w + i))));
#endif
        for (; i < n; ++i) yr[i] = rnd<T>(xr[i] * inv * w[i]);
      }
    });
  }

  // Token row m of the QKV product: rounded to T, the query and key heads rotated (rotary.cpp's
  // roundings: T(x cos) + x' sin, x' the other half's value, sin signed), the query heads
  // written to q [M, qs] and the key / value heads to the cache slot (when slot >= 0).
  template <typename T>
  void rotate_and_store(float* row, const T* c, const T* s, int64_t R, int64_t slot, T* qm, T* kd, T* vd) {
    const int64_t qs = nh_ * D_, kvs = nkv_ * D_, nqkv = qs + 2 * kvs, half = R / 2;
    int64_t i = 0;
#if defined(GG_AVX2)
    for (; i + 8 <= nqkv; i += 8) _mm256_storeu_ps(row + i, rnd8<T>(_mm256_loadu_ps(row + i)));
#endif
    for (; i < nqkv; ++i) row[i] = rnd<T>(row[i]);  // the projection's output in T
    alignas(32) float rot[512];
    for (int64_t hd = 0; hd < nh_ + nkv_; ++hd) {
      float* xh = row + hd * D_;
      int64_t d = 0;
#if defined(GG_AVX2)
      if (half % 8 == 0)
        for (; d < R; d += 8) {
          const __m256 a = rnd8<T>(_mm256_mul_ps(_mm256_loadu_ps(xh + d), ld8(c + d)));
          const __m256 r = _mm256_loadu_ps(xh + (d < half ? d + half : d - half));
          if constexpr (std::is_same<T, float>::value) _mm256_store_ps(rot + d, _mm256_fmadd_ps(r, ld8(s + d), a));
          else _mm256_store_ps(rot + d, rnd8<T>(_mm256_add_ps(a, _mm256_mul_ps(r, ld8(s + d)))));
        }
#endif
      for (; d < R; ++d) {
        const float a = rnd<T>(xh[d] * static_cast<float>(c[d]));
        const float r = xh[d < half ? d + half : d - half];
        // float32: addcmul's fused multiply-add; bfloat16: its float opmath
        if constexpr (std::is_same<T, float>::value) rot[d] = std::fma(r, static_cast<float>(s[d]), a);
        else rot[d] = rnd<T>(a + r * static_cast<float>(s[d]));
      }
      std::memcpy(xh, rot, R * sizeof(float));
    }
    store_row(row, qs, qm);
    if (slot >= 0) {  // (kd, vd: the slot's K / V rows)
      store_row(row + qs, kvs, kd);
      store_row(row + qs + kvs, kvs, vd);
    }
  }

  // The K and V heads of one token (kv: K's nkv * D values, then V's, T values as float) into a
  // quantized cache's slot: kv_cache.quantize_kv's arithmetic (see set_quantized_kv_caches),
  // the keys first less the layer's key offset (rounded to T, as the PyTorch path's k - offset).
  template <typename T>
  void store_codes(int64_t li, const float* kv, int64_t slot) {
    const int64_t kvs = nkv_ * D_;
    const float* off = key_offsets_[li].numel() ? key_offsets_[li].data_ptr<float>() : nullptr;
    const float qmax = code_format_ == CODES_INT8 ? 127.f : 448.f;
    for (int kind = 0; kind < 2; ++kind) {
      uint8_t* codes = (kind == 0 ? k_ : v_)[li].data_ptr<uint8_t>() + slot * kvs;
      c10::Half* scales = reinterpret_cast<c10::Half*>((kind == 0 ? k_scales_ : v_scales_)[li].data_ptr<at::Half>()) + slot * nkv_;
      for (int64_t h = 0; h < nkv_; ++h) {
        alignas(32) float x[512];
        float amax = 0.f;
        for (int64_t d = 0; d < D_; ++d) {
          float e = kv[kind * kvs + h * D_ + d];
          if (kind == 0 && off) e = rnd<T>(e - off[h * D_ + d]);
          x[d] = e;
          amax = std::max(amax, std::fabs(e));
        }
        float sc = amax / qmax;
        if (sc < 1e-8f) sc = 1e-8f;
        for (int64_t d = 0; d < D_; ++d) {
          float y = x[d] / sc;
          y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
          codes[h * D_ + d] = code_format_ == CODES_INT8 ? static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)))
                                                         : c10::Float8_e4m3fn(y).x;
        }
        scales[h] = c10::Half(sc);
      }
    }
  }

  // dst[i] = T(src[i]) for i < n, src holding T values.
  template <typename T>
  static void store_row(const float* src, int64_t n, T* dst) {
    int64_t i = 0;
#if defined(GG_AVX2)
    for (; i + 8 <= n; i += 8) st8(dst + i, _mm256_loadu_ps(src + i));
#endif
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }

  template <typename T>
  void run(const T* x, const T* cos, const T* sin, int64_t R, const int64_t* slots, const int64_t* tables,
           int64_t width, const int32_t* ctx, int64_t M, int64_t first, int64_t last, T* out) {
    const int64_t qs = nh_ * D_, kvs = nkv_ * D_, nqkv = qs + 2 * kvs;
    res_.resize(M * H_);
    h_.resize(M * H_);
    qkv_.resize(M * nqkv);
    proj_.resize(M * std::max(H_, 2 * I_));
    act_.resize(M * I_);
    std::vector<T> q(M * qs), att(M * qs);
    if (quantized_) {  // one query token per request: query_start 0 .. M
      qf_.resize(M * qs);
      of_.resize(M * qs);
      starts_.resize(M + 1);
      for (int64_t r = 0; r <= M; ++r) starts_[r] = static_cast<int32_t>(r);
    }
    for (int64_t i = 0; i < M * H_; ++i) res_[i] = static_cast<float>(x[i]);
    const int64_t slot_stride = kvs, bs = k_[0].size(1);
    // The per-row parts run over the rows in parallel (from 8 rows, or 16 for the norms) and in
    // vectors; the residual add that ends a block is fused with the norm that starts the next.
    add_rms<T>(res_.data(), nullptr, layers_[first].ln_in.data_ptr<float>(), M, h_.data());
    for (int64_t li = first; li < last; ++li) {
      const Layer& l = layers_[li];
      T* kc = quantized_ ? nullptr : k_[li].data_ptr<T>();
      T* vc = quantized_ ? nullptr : v_[li].data_ptr<T>();
      // Attention block.
      matmul(h_.data(), M, l.qkv, qkv_.data());
      at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) {
          const bool store = slots[m] >= 0 && !quantized_;
          rotate_and_store<T>(qkv_.data() + m * nqkv, cos + m * R, sin + m * R, R, store ? slots[m] : -1,
                              q.data() + m * qs, store ? kc + slots[m] * slot_stride : nullptr,
                              store ? vc + slots[m] * slot_stride : nullptr);
          if (quantized_ && slots[m] >= 0) store_codes<T>(li, qkv_.data() + m * nqkv + qs, slots[m]);
        }
      });
      const int64_t group = nh_ / nkv_;
      if (quantized_) {  // paged_attention_quantized's pass: q in float32, the output rounded to T once
        for (int64_t i = 0; i < M * qs; ++i) qf_[i] = static_cast<float>(q[i]);
        quantized_attention(qf_.data(), k_[li].data_ptr<uint8_t>(), v_[li].data_ptr<uint8_t>(),
                            reinterpret_cast<const c10::Half*>(k_scales_[li].data_ptr<at::Half>()),
                            reinterpret_cast<const c10::Half*>(v_scales_[li].data_ptr<at::Half>()),
                            lut_.data_ptr<float>(), code_format_, tables, width, starts_.data(), ctx, M, nh_, nkv_,
                            D_, bs, static_cast<float>(scale_), of_.data());
        for (int64_t i = 0; i < M * qs; ++i) att[i] = static_cast<T>(of_[i]);
      } else {
        with_shape<T>(D_, group, [&](auto hd, auto g) {
          decode_kernel<T, decltype(hd)::value, decltype(g)::value>(
              q.data(), kc, vc, tables, ctx, att.data(), M, nh_, nkv_, D_, bs, width, static_cast<float>(scale_), qs,
              D_, qs, D_);
        });
      }
      matmul(att.data(), M, l.o, proj_.data());
      // MLP block.
      add_rms<T>(res_.data(), proj_.data(), l.ln_post.data_ptr<float>(), M, h_.data());
      matmul(h_.data(), M, l.gate_up, proj_.data());
      at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) silu_mul<T>(proj_.data() + m * 2 * I_, I_, act_.data() + m * I_);
      });
      matmul(act_.data(), M, l.down, proj_.data());
      // The residual, and the norm that follows it: the next layer's, the final one, or none
      // when the call stops before the end.
      const float* next_norm = li + 1 < last ? layers_[li + 1].ln_in.data_ptr<float>()
                               : last == num_layers() ? final_norm_.data_ptr<float>()
                                                      : nullptr;
      add_rms<T>(res_.data(), proj_.data(), next_norm, M, h_.data());
    }
    const std::vector<float>& y = last < num_layers() ? res_ : h_;
    for (int64_t i = 0; i < M * H_; ++i) out[i] = static_cast<T>(y[i]);
  }

  int64_t H_, nh_, nkv_, D_, I_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
  bool has_dense_ = false;  // a linear with a prepacked bfloat16 weight (bfloat16 models only)
  std::vector<torch::Tensor> k_, v_;
  // a quantized cache (set_quantized_kv_caches): its scales, key offsets, code table and format
  bool quantized_ = false;
  std::vector<torch::Tensor> k_scales_, v_scales_, key_offsets_;
  torch::Tensor lut_;
  int64_t code_format_ = 0;
  std::vector<float> qf_, of_;
  std::vector<int32_t> starts_;
  std::mutex mutex_;
  // Scratch, reused across steps (one forward at a time: the engine's step loop).
  std::vector<int8_t> q_;
  std::vector<float> d_, s16_, s32_, res_, h_, qkv_, proj_, act_;
  std::vector<int32_t> i16_;
};

}  // namespace kvflow_fused

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using kvflow_fused::FusedDecoder;
  pybind11::class_<FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, torch::Tensor>())
      .def("add_layer", &FusedDecoder::add_layer)
      .def("set_kv_caches", &FusedDecoder::set_kv_caches)
      .def("set_quantized_kv_caches", &FusedDecoder::set_quantized_kv_caches)
      .def("num_layers", &FusedDecoder::num_layers)
      .def("forward", &FusedDecoder::forward, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("context_lens"),
           pybind11::arg("first") = 0, pybind11::arg("last") = -1, pybind11::call_guard<pybind11::gil_scoped_release>());
}
