// Paged attention on CPU through XLA's FFI: each query reads its row's keys and values straight
// from the pool, once, with an online softmax over blocks of keys (flash decoding).
//
// The XLA formulations (serving/runner/paged_kv.py, `loop`) gather each block of pages into the layout
// XLA:CPU's dot kernels want and make several passes over it; on a 2-core machine they ran a
// decode step's attention 3-8x slower than PyTorch's scaled_dot_product_attention over a
// contiguous cache of the same size. Here a query's scores and weighted values are computed in
// one pass over the pool, rows spread over XLA's intra-op thread pool.
//
// Semantics (those of PagedKV.attend): query t of row b, at position p = positions[b, t],
// attends to the keys at positions s <= p (and s > p - window when window > 0) whose logical
// page s / K lies in the row's table (s / K < W); position s of row b lives at slot s % K of
// pool page table[b, s / K]. Scores are q . k * scale, soft-capped by cap * tanh(x / cap) when
// softcap > 0. A query that sees no key gets zeros.
//
// Shapes (row-major): q [B, T, N, H]; positions int32 [B, T]; kv [L, P, K, 2G, H] with head g's
// keys at 2g and its values at 2g + 1; table int32 [B, W]; layer int32 []; window int32 []
// (0: none; a buffer, since a model's layers may differ in it inside one scan); out [B, T, N, H].
// Query head n uses kv head n / (N / G). Float32 or bfloat16 for q / out; float32, bfloat16 or
// float8 e4m3 (EngineConfig.kv_cache_dtype=fp8) for kv.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 64;         // keys scored before the running softmax is rescaled
constexpr int kMaxHeads = 16;      // query heads per kv head
constexpr int kMaxWidth = 4096;    // query heads per kv head x head width

inline float Widen(float x) { return x; }
inline float Widen(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
// float8 e4m3 (OCP's e4m3fn: bias 7, no infinities, S.1111.111 is NaN), widened by a table of
// its 256 values.
struct E4M3 {
  uint8_t bits;
};
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      float x = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                              : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if ((b & 127) == 127) x = std::numeric_limits<float>::quiet_NaN();
      value[b] = (b & 128) ? -x : x;
    }
  }
};
const E4M3Table kE4M3;
inline float Widen(E4M3 x) { return kE4M3.value[x.bits]; }

inline void Narrow(float x, float* out) { *out = x; }
inline void Narrow(float x, uint16_t* out) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) {
    *out = 0x7fc0;
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  *out = static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0, in a form the compiler vectorizes (std::exp stays a scalar call without
// -ffast-math): 2^n * e^f with |f| <= ln(2) / 2 by Cephes' expf polynomial (relative error
// about 1e-7); below -87 it returns about 2^-126 (the caller's weights there are negligible).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Shape {
  int64_t b, t, n, h, g, pages, page, w, layers;
  int64_t window;
  float scale, softcap;
};

// One (row, kv head): every query of the row, for the r query heads of kv head g together, and
// for as many of the row's T queries at once as fit (a verify step's K+1 tokens): each key and
// value is read once for all of these lanes, each lane scoring the keys its position sees.
template <int64_t kWidth, typename Q, typename KV>
void AttendRowHead(const Shape& s, const Q* q, const int32_t* positions, const KV* kv,
                   const int32_t* table, int64_t layer, int64_t row, int64_t g, Q* out) {
  const int64_t r = s.n / s.g, h = kWidth > 0 ? kWidth : s.h;
  const int64_t token_stride = 2 * s.g * h;  // between positions in a page
  const KV* pool = kv + layer * s.pages * s.page * token_stride;
  const int32_t* row_table = table + row * s.w;
  const int64_t limit = s.w * s.page;  // positions past the table are not the row's
  // Queries taken together: as many as the lanes' scores and accumulators hold.
  const int64_t together =
      std::max<int64_t>(1, std::min({s.t, kMaxHeads / r, kMaxWidth / (r * h)}));

  alignas(64) float query[kMaxWidth], acc[kMaxWidth], scores[kMaxHeads * kBlock];
  float m[kMaxHeads], l[kMaxHeads];
  int64_t lo[kMaxHeads], hi[kMaxHeads];  // each lane's keys: positions lo .. hi - 1
  const KV* records[kBlock];
  for (int64_t t0 = 0; t0 < s.t; t0 += together) {
    const int64_t queries = std::min(together, s.t - t0), lanes = queries * r;
    int64_t first = limit, last = -1;
    for (int64_t tt = 0; tt < queries; ++tt) {
      const int64_t p = positions[row * s.t + t0 + tt];
      const int64_t end = std::min<int64_t>(p, limit - 1) + 1;
      const int64_t begin = s.window > 0 ? std::max<int64_t>(0, p - s.window + 1) : 0;
      const int64_t head0 = (row * s.t + t0 + tt) * s.n + g * r;  // the first of its r heads
      for (int64_t j = 0; j < r; ++j) lo[tt * r + j] = begin, hi[tt * r + j] = end;
      for (int64_t i = 0; i < r * h; ++i)
        query[tt * r * h + i] = Widen(q[head0 * h + i]) * s.scale;
      first = std::min(first, begin), last = std::max(last, end - 1);
    }
    std::fill(acc, acc + lanes * h, 0.f);
    std::fill(m, m + lanes, -std::numeric_limits<float>::infinity());
    std::fill(l, l + lanes, 0.f);
    for (int64_t start = first; start <= last; start += kBlock) {
      const int64_t end = std::min<int64_t>(start + kBlock, last + 1), n = end - start;
      // The block's records (keys of head g, then its values), walking the row's pages.
      int64_t index = start / s.page, offset = start % s.page;
      for (int64_t i = 0; i < n; ++i) {
        records[i] = pool + (static_cast<int64_t>(row_table[index]) * s.page + offset) *
                                token_stride + 2 * g * h;
        if (++offset == s.page) offset = 0, ++index;
      }
      for (int64_t i = 0; i < n; ++i) {
        const KV* k = records[i];
        for (int64_t j = 0; j < lanes; ++j) {
          if (start + i < lo[j] || start + i >= hi[j]) continue;
          const float* qj = query + j * h;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < h; ++c) dot += qj[c] * Widen(k[c]);
          scores[j * kBlock + i] = dot;
        }
      }
      for (int64_t j = 0; j < lanes; ++j) {
        // The lane's keys in this block: a ... b - 1 (none: the lane skips the block).
        const int64_t a = std::max<int64_t>(lo[j] - start, 0), b = std::min(hi[j] - start, n);
        if (a >= b) continue;
        float* sj = scores + j * kBlock;
        if (s.softcap > 0.f)
          for (int64_t i = a; i < b; ++i) sj[i] = s.softcap * std::tanh(sj[i] / s.softcap);
        const float m_new = std::max(m[j], *std::max_element(sj + a, sj + b));
        const float rescale = l[j] > 0.f ? ExpNonPositive(m[j] - m_new) : 0.f;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = a; i < b; ++i) {
          sj[i] = ExpNonPositive(sj[i] - m_new);
          sum += sj[i];
        }
        l[j] = l[j] * rescale + sum;
        m[j] = m_new;
        for (int64_t c = 0; c < h; ++c) acc[j * h + c] *= rescale;
      }
      for (int64_t i = 0; i < n; ++i) {
        const KV* v = records[i] + h;
        for (int64_t j = 0; j < lanes; ++j) {
          if (start + i < lo[j] || start + i >= hi[j]) continue;
          const float weight = scores[j * kBlock + i];
          float* aj = acc + j * h;
#pragma omp simd
          for (int64_t c = 0; c < h; ++c) aj[c] += weight * Widen(v[c]);
        }
      }
    }
    for (int64_t tt = 0; tt < queries; ++tt) {
      const int64_t head0 = (row * s.t + t0 + tt) * s.n + g * r;
      for (int64_t j = 0; j < r; ++j) {
        const float* aj = acc + (tt * r + j) * h;
        const float inv = l[tt * r + j] > 0.f ? 1.f / l[tt * r + j] : 0.f;
        for (int64_t i = 0; i < h; ++i) Narrow(aj[i] * inv, &out[(head0 + j) * h + i]);
      }
    }
  }
}

// Work items (row, kv head) claimed from a shared counter by the calling thread and by tasks on
// XLA's intra-op pool; the caller returns once every item is claimed and no task is mid-item
// (a task that starts later finds nothing left and only drops its reference to the state).
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
  int64_t items = 0;
};

template <typename Q, typename KV>
ffi::Error Attend(ffi::ThreadPool pool, const Shape& s, const Q* q, const int32_t* positions,
                  const KV* kv, const int32_t* table, int64_t layer, Q* out) {
  auto work = std::make_shared<Work>();
  work->items = s.b * s.g;
  auto run = [s, q, positions, kv, table, layer, out](Work& w) {
    w.active.fetch_add(1);
    for (int64_t item; (item = w.next.fetch_add(1)) < w.items;) {
      const int64_t row = item / s.g, g = item % s.g;
      switch (s.h) {  // the common head widths unrolled
        case 32: AttendRowHead<32>(s, q, positions, kv, table, layer, row, g, out); break;
        case 64: AttendRowHead<64>(s, q, positions, kv, table, layer, row, g, out); break;
        case 128: AttendRowHead<128>(s, q, positions, kv, table, layer, row, g, out); break;
        default: AttendRowHead<0>(s, q, positions, kv, table, layer, row, g, out);
      }
    }
    w.active.fetch_sub(1);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work, run] { run(*work); });
  run(*work);
  while (work->active.load() > 0) std::this_thread::yield();
  return ffi::Error::Success();
}

// Attend with q and out as Q (float32 or bfloat16 bits) and the pool as its own element type.
template <typename Q>
ffi::Error WithKV(ffi::ThreadPool pool, const Shape& s, const void* q, const int32_t* positions,
                  ffi::AnyBuffer kv, const int32_t* table, int64_t layer, void* out) {
  const Q* query = static_cast<const Q*>(q);
  Q* result = static_cast<Q*>(out);
  switch (kv.element_type()) {
    case ffi::DataType::F32:
      return Attend(pool, s, query, positions, static_cast<const float*>(kv.untyped_data()),
                    table, layer, result);
    case ffi::DataType::BF16:
      return Attend(pool, s, query, positions, static_cast<const uint16_t*>(kv.untyped_data()),
                    table, layer, result);
    case ffi::DataType::F8E4M3FN:
      return Attend(pool, s, query, positions, static_cast<const E4M3*>(kv.untyped_data()),
                    table, layer, result);
    default:
      return ffi::Error::InvalidArgument("paged attention: a float32, bfloat16 or float8 e4m3 "
                                         "pool only");
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q,
                              ffi::Buffer<ffi::S32> positions, ffi::AnyBuffer kv,
                              ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> window_buffer,
                              ffi::Result<ffi::AnyBuffer> out, float scale, float softcap) {
  const int64_t window = window_buffer.typed_data()[0];
  const auto qd = q.dimensions(), kvd = kv.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kvd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q [B,T,N,H], kv [L,P,K,2G,H], "
                                       "table [B,W] expected");
  Shape s{qd[0], qd[1], qd[2], qd[3], kvd[3] / 2, kvd[1], kvd[2], td[1], kvd[0],
          window, scale, softcap};
  if (kvd[4] != s.h || s.g == 0 || s.n % s.g != 0 || td[0] != s.b)
    return ffi::Error::InvalidArgument("paged attention: shapes do not agree");
  if (s.n / s.g > kMaxHeads || s.n / s.g * s.h > kMaxWidth)
    return ffi::Error::InvalidArgument("paged attention: too many query heads per kv head");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= s.layers)
    return ffi::Error::InvalidArgument("paged attention: layer out of range");
  const int32_t* pos = positions.typed_data();
  const int32_t* tab = table.typed_data();
  switch (q.element_type()) {
    case ffi::DataType::F32:
      return WithKV<float>(pool, s, q.untyped_data(), pos, kv, tab, l, out->untyped_data());
    case ffi::DataType::BF16:
      return WithKV<uint16_t>(pool, s, q.untyped_data(), pos, kv, tab, l, out->untyped_data());
    default:
      return ffi::Error::InvalidArgument("paged attention: float32 or bfloat16 q only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
