// Paged decode attention on the CPU, for XLA through its FFI (pagedjax.device.cpu_attention):
//   PagedjaxPagedDecode  out[n, h, :] = softmax_j(scale * q[n, h] . k_j) . v_j over the first lengths[n] slots of
//                        sequence n's pages (block_tables[n]), keys and values of KV head h / (Hq / Hkv)
// q [N, Hq, D], k / v pages [Hkv, num_blocks, block_size, D] and out in float32 or bfloat16 (all the same), tables
// int32 [N, P], lengths int32 [N] (clipped to [0, P * block_size]; 0 gives zeros), table entries clipped to the
// pool (pallas_kernels.paged_attention's contract, no variants). Slots at or past a sequence's length are never
// read, so whatever they hold (NaN included) cannot reach the result.
//
// Each (sequence, KV head) is one task: its G = Hq / Hkv query heads walk the sequence's pages once, a page's keys
// scored against all G heads while they are in cache, and each page's scores folded into the running (max, weight
// sum, value sum) exactly, in float32 (flash attention's recurrence; pallas_kernels.dense.fold's rule). The XLA
// path gathers every chunk of pages into a buffer of its own first and reads it again for each dot; this reads
// the pool once. Tasks are split over XLA's intra-op thread pool as in int8_matmul.cc.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Vectors of 16 float32 lanes in GCC / Clang's vector extensions: one AVX-512 register, two AVX2 ones, four NEON
// ones, whatever the build's -march has (the kernel carries no intrinsics of its own).
constexpr int64_t kLanes = 16;
typedef float F16 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint16_t H16 __attribute__((vector_size(32)));

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline F16 Load(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline F16 Load(const uint16_t* p) {  // bfloat16: the high half of a float32
  H16 h;
  std::memcpy(&h, p, sizeof h);
  const U16 bits = __builtin_convertvector(h, U16) << 16;
  F16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline float Sum(F16 v) {
  const F8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const F4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Pairs of lanes summed: lanes 0-7 of the result hold a's 8 pair sums, lanes 8-15 b's, in order.
inline F16 Combine(F16 a, F16 b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Lane i of the result is the sum of t[i]'s lanes: 15 combines for 16 sums, where one sum at a time (`Sum`) takes
// about as many instructions each.
inline F16 Reduce(const F16 (&t)[kLanes]) {
  F16 u[8], w[4];
  for (int i = 0; i < 8; ++i) u[i] = Combine(t[2 * i], t[2 * i + 1]);
  for (int i = 0; i < 4; ++i) w[i] = Combine(u[2 * i], u[2 * i + 1]);
  return Combine(Combine(w[0], w[1]), Combine(w[2], w[3]));
}

inline void FromFloat(float x, float* out) { *out = x; }
// Round to nearest even, as XLA converts float32 to bfloat16 (a NaN stays a NaN).
inline void FromFloat(float x, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    *out = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7FFF + ((bits >> 16) & 1);
  *out = static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0 (every argument here: scores minus their running max) in float32 to about 1 ulp, 16 lanes
// at once: Cephes' expf (x = n ln 2 + r with n the nearest integer, |r| <= ln 2 / 2, a degree-7 polynomial in r,
// times 2^n). Below -87.3 (and -inf: an empty prior's weight) it gives 0; NaN stays NaN. std::exp is a scalar
// call per key, which was most of the kernel's time.
inline F16 Exp(F16 x) {
  const F16 t = x * 1.44269504088896341f - 0.5f;  // truncation rounds t <= -0.5 up: n = nearest(x log2 e)
  const F16 n = __builtin_convertvector(__builtin_convertvector(t, I16), F16);
  F16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I16 e = (__builtin_convertvector(n, I16) + 127) << 23;  // n >= -126 wherever x >= -87.3
  F16 two_n;
  std::memcpy(&two_n, &e, sizeof two_n);
  const F16 y = p * two_n;
  const F16 zero = {};
  return x < -87.3f ? zero : (x != x ? x : y);
}

float ExpScalar(float x) {
  F16 v = {};
  v[0] = x;
  return Exp(v)[0];
}

// A page's first `n` rows of head_dim values as float32: float32 pages as they are; bfloat16 ones widened once into
// `buffer`, not once for each query head that reads them.
inline const float* Widened(const float* page, int64_t, float*) { return page; }
inline const float* Widened(const uint16_t* page, int64_t n, float* buffer) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const F16 x = Load(page + i);
    std::memcpy(buffer + i, &x, sizeof x);
  }
  for (; i < n; ++i) buffer[i] = ToFloat(page[i]);
  return buffer;
}

struct Shape {
  int64_t num_q_heads, num_kv_heads, head_dim, num_blocks, block_size, pages;
};

// One sequence's G query heads of KV head h. head_dim is a multiple of 16 (the wrapper's condition);
// scratch: G * (2 * head_dim + block_size + 16) + 2 * block_size * head_dim floats.
template <typename T>
void DecodeOne(const T* q, const T* k, const T* v, const int32_t* table, int32_t length, T* out, const Shape& s,
               int64_t h, float scale, float* scratch) {
  const int64_t g_heads = s.num_q_heads / s.num_kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t chunks = d / kLanes, padded = (bs + kLanes - 1) / kLanes * kLanes;
  const int64_t len = std::clamp<int64_t>(length, 0, s.pages * bs);
  float* acc = scratch;                      // [G, D]: each head's running value sum
  float* scores = scratch + g_heads * d;     // [G, padded]: a page's scores, then its weights
  float* qf = scores + g_heads * padded;     // [G, D]: q in float32
  float* kw = qf + g_heads * d;              // [block_size, D] twice: a bfloat16 page's K and V widened
  float* vw = kw + bs * d;
  float m[256], z[256];                      // G <= 256 (the wrapper's condition)
  for (int64_t g = 0; g < g_heads; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    z[g] = 0.0f;
  }
  for (int64_t i = 0; i < g_heads * d; ++i) qf[i] = ToFloat(q[h * g_heads * d + i]);
  std::fill(acc, acc + g_heads * d, 0.0f);
  for (int64_t p = 0; p * bs < len; ++p) {
    const int64_t block = std::clamp<int64_t>(table[p], 0, s.num_blocks - 1);
    const int64_t keys = std::min(bs, len - p * bs);
    const T* kp = k + ((h * s.num_blocks + block) * bs) * d;
    const T* vp = v + ((h * s.num_blocks + block) * bs) * d;
    // The next page sits anywhere in the pool: ask for it while this one is computed (a decode step at batch 8
    // over 1k contexts 56.6 -> 48.2 ms; two, four or eight pages ahead measured the same as one).
    if ((p + 1) * bs < len) {
      const int64_t next = std::clamp<int64_t>(table[p + 1], 0, s.num_blocks - 1);
      const char* nk = reinterpret_cast<const char*>(k + ((h * s.num_blocks + next) * bs) * d);
      const char* nv = reinterpret_cast<const char*>(v + ((h * s.num_blocks + next) * bs) * d);
      for (int64_t b = 0; b < static_cast<int64_t>(bs * d * sizeof(T)); b += 64) {
        __builtin_prefetch(nk + b);
        __builtin_prefetch(nv + b);
      }
    }
    const float* kb = Widened(kp, keys * d, kw);
    const float* vb = Widened(vp, keys * d, vw);
    for (int64_t g = 0; g < g_heads; ++g) {
      for (int64_t j0 = 0; j0 < keys; j0 += kLanes) {
        // 16 keys' dot products as 16 vectors of partial sums, reduced together into one vector of 16 scores.
        // Rows past the page's last key repeat it (never read outside the page); their scores are dropped below.
        F16 t[kLanes] = {};
        for (int64_t c = 0; c < chunks; ++c) {
          const F16 qc = Load(qf + g * d + c * kLanes);
          for (int64_t jj = 0; jj < kLanes; ++jj) {
            t[jj] += qc * Load(kb + std::min(j0 + jj, keys - 1) * d + c * kLanes);
          }
        }
        const F16 sums = Reduce(t) * scale;
        std::memcpy(scores + g * padded + j0, &sums, sizeof sums);
      }
    }
    for (int64_t g = 0; g < g_heads; ++g) {
      float* sg = scores + g * padded;
      float top = m[g];
      for (int64_t j = 0; j < keys; ++j) top = std::max(top, sg[j]);
      // The running sums were weighted at m[g]: reweight them at the new max (0 for an empty prior).
      const float kept = ExpScalar(m[g] - top);
      for (int64_t j = keys; j < padded; ++j) sg[j] = -std::numeric_limits<float>::infinity();  // weight 0
      float sum = 0.0f;
      for (int64_t j = 0; j < padded; j += kLanes) {
        const F16 w = Exp(Load(sg + j) - top);
        std::memcpy(sg + j, &w, sizeof w);
        sum += Sum(w);
      }
      z[g] = kept * z[g] + sum;
      m[g] = top;
      for (int64_t c = 0; c < chunks; ++c) {  // the value sum of this chunk of lanes stays in a register
        F16 a = Load(acc + g * d + c * kLanes) * kept;
        for (int64_t j = 0; j < keys; ++j) a += sg[j] * Load(vb + j * d + c * kLanes);
        std::memcpy(acc + g * d + c * kLanes, &a, sizeof a);
      }
    }
  }
  for (int64_t g = 0; g < g_heads; ++g) {
    for (int64_t i = 0; i < d; ++i) {
      FromFloat(z[g] > 0.0f ? acc[g * d + i] / z[g] : 0.0f, out + (h * g_heads + g) * d + i);
    }
  }
}

struct Work {
  std::function<void(int64_t)> task;
  int64_t tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      task(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// task(i) for i in [0, tasks) on this thread and the pool's: the caller takes tasks from the same counter, so it
// never waits for a helper that has not started.
void ParallelFor(ffi::ThreadPool& pool, int64_t tasks, std::function<void(int64_t)> task) {
  auto work = std::make_shared<Work>();
  work->task = std::move(task);
  work->tasks = tasks;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), tasks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->tasks) std::this_thread::yield();
}

template <typename Dims>
bool SameDims(const Dims& a, const Dims& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

template <typename T>
void Decode(ffi::ThreadPool& pool, const T* q, const T* k, const T* v, const int32_t* tables, const int32_t* lengths,
            T* out, int64_t num_seqs, const Shape& s, float scale) {
  const int64_t g_heads = s.num_q_heads / s.num_kv_heads;
  ParallelFor(pool, num_seqs * s.num_kv_heads, [=](int64_t i) {
    const int64_t n = i / s.num_kv_heads, h = i % s.num_kv_heads;
    thread_local std::vector<float> scratch;
    scratch.resize(g_heads * (2 * s.head_dim + s.block_size + kLanes) + 2 * s.block_size * s.head_dim);
    DecodeOne(q + n * s.num_q_heads * s.head_dim, k, v, tables + n * s.pages, lengths[n],
              out + n * s.num_q_heads * s.head_dim, s, h, scale, scratch.data());
  });
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                       ffi::Result<ffi::AnyBuffer> out, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || !SameDims(v.dimensions(), kd) || td[0] != qd[0] ||
      lengths.dimensions().size() != 1 || lengths.dimensions()[0] != qd[0] || kd[3] != qd[2] || kd[0] == 0 ||
      qd[1] % kd[0] != 0) {
    return ffi::Error::InvalidArgument("pagedjax_paged_decode: q [N, Hq, D], pages [Hkv, blocks, block_size, D] "
                                       "(Hkv dividing Hq), tables [N, P] and lengths [N] expected");
  }
  const auto type = q.element_type();
  if (k.element_type() != type || v.element_type() != type || out->element_type() != type ||
      (type != ffi::F32 && type != ffi::BF16)) {
    return ffi::Error::InvalidArgument("pagedjax_paged_decode: q, pages and out all float32 or all bfloat16");
  }
  const Shape s{qd[1], kd[0], qd[2], kd[1], kd[2], td[1]};
  if (s.head_dim % kLanes != 0 || s.num_q_heads / s.num_kv_heads > 256) {
    return ffi::Error::InvalidArgument("pagedjax_paged_decode: head_dim a multiple of 16, at most 256 query heads "
                                       "per KV head");
  }
  const int64_t num_seqs = qd[0];
  if (num_seqs == 0 || s.num_q_heads == 0 || s.head_dim == 0) return ffi::Error::Success();
  if (s.num_blocks == 0 || s.pages == 0 || s.block_size == 0) {  // nothing to attend: zeros
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  if (type == ffi::F32) {
    Decode(pool, static_cast<const float*>(q.untyped_data()), static_cast<const float*>(k.untyped_data()),
           static_cast<const float*>(v.untyped_data()), tables.typed_data(), lengths.typed_data(),
           static_cast<float*>(out->untyped_data()), num_seqs, s, scale);
  } else {
    Decode(pool, static_cast<const uint16_t*>(q.untyped_data()),
           static_cast<const uint16_t*>(k.untyped_data()), static_cast<const uint16_t*>(v.untyped_data()),
           tables.typed_data(), lengths.typed_data(), static_cast<uint16_t*>(out->untyped_data()), num_seqs, s,
           scale);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale"));
