// An int8 x int8 -> int32 matrix product on the CPU, for XLA through its FFI (pagedjax.device.int8_matmul):
//   acc[m, n] = sum_k x[m, k] * w[n, k]      (x, w int8 with their k contiguous; acc int32, exact)
// Built on first use by `pagedjax.device.int8_matmul` with the machine's own instruction set (-march=native).
//
// AVX-512 VNNI / AVX-VNNI multiply unsigned by signed bytes (vpdpbusd: four u8 x s8 products summed into each
// int32 lane, no saturation). x is made unsigned by adding 128 (x + 128 in [0, 255]) and the excess removed per
// output channel: sum_k (x + 128) w = acc + 128 * sum_k w, the channel's sum taken by the same instruction
// against bytes of 1 once per channel, however many rows. Each product is at most 255 * 128 in size, so the int32
// sums are exact for k up to 65,536 (the wrapper refuses more). Without VNNI, a portable loop (the compiler
// vectorizes it with the instructions it has).
//
// The output channels are split in chunks over XLA's intra-op thread pool: the calling thread and the tasks it
// schedules take chunks from one counter, so the call never waits for a task that has not started (a pool
// whose threads are all busy, or a pool of one, only means the caller computes every chunk itself).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows computed together against one channel's bytes (each row an accumulator per channel).
constexpr int64_t kRows = 4;
// Channels computed together (their weights loaded once per k step for all kRows rows).
constexpr int64_t kChannels = 4;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kVector = 64;
using Vec = __m512i;
inline Vec Load(const int8_t* p, int64_t n) {
  return n >= kVector ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((__mmask64)((1ULL << n) - 1), p);
}
inline Vec Dot(Vec acc, Vec u, Vec s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline Vec Zero() { return _mm512_setzero_si512(); }
inline Vec Bias(Vec v) { return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); }  // x + 128 as u8
inline Vec Ones() { return _mm512_set1_epi8(1); }
inline int32_t Sum(Vec v) { return _mm512_reduce_add_epi32(v); }
constexpr bool kVnni = true;
#elif defined(__AVXVNNI__)
constexpr int64_t kVector = 32;
using Vec = __m256i;
inline Vec Load(const int8_t* p, int64_t n) {
  if (n >= kVector) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) int8_t tail[32] = {0};
  std::memcpy(tail, p, n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
}
inline Vec Dot(Vec acc, Vec u, Vec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline Vec Zero() { return _mm256_setzero_si256(); }
inline Vec Bias(Vec v) { return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)); }
inline Vec Ones() { return _mm256_set1_epi8(1); }
inline int32_t Sum(Vec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// acc[r, c] for rows [r0, r0 + rows) and channels [c0, c0 + channels), rows <= kRows, channels <= kChannels.
template <int64_t R, int64_t C>
void Tile(const int8_t* x, const int8_t* w, int32_t* acc, int64_t k, int64_t n, int64_t r0, int64_t c0) {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
  Vec sums[R][C];
  Vec wsum[C];
  for (int64_t c = 0; c < C; ++c) {
    wsum[c] = Zero();
    for (int64_t r = 0; r < R; ++r) sums[r][c] = Zero();
  }
  const Vec ones = Ones();
  for (int64_t i = 0; i < k; i += kVector) {
    const int64_t left = k - i;
    Vec wv[C];
    for (int64_t c = 0; c < C; ++c) {
      wv[c] = Load(w + (c0 + c) * k + i, left);
      wsum[c] = Dot(wsum[c], ones, wv[c]);
    }
    for (int64_t r = 0; r < R; ++r) {
      // A tail's missing bytes load as 0 and bias to 128, against weights of 0: no contribution.
      const Vec xv = Bias(Load(x + (r0 + r) * k + i, left));
      for (int64_t c = 0; c < C; ++c) sums[r][c] = Dot(sums[r][c], xv, wv[c]);
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    const int32_t excess = 128 * Sum(wsum[c]);
    for (int64_t r = 0; r < R; ++r) acc[(r0 + r) * n + c0 + c] = Sum(sums[r][c]) - excess;
  }
#else
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const int8_t* xr = x + (r0 + r) * k;
      const int8_t* wc = w + (c0 + c) * k;
      int32_t s = 0;
      for (int64_t i = 0; i < k; ++i) s += int32_t(xr[i]) * int32_t(wc[i]);
      acc[(r0 + r) * n + c0 + c] = s;
    }
  }
#endif
}

template <int64_t R>
void RowBlock(const int8_t* x, const int8_t* w, int32_t* acc, int64_t k, int64_t n, int64_t r0, int64_t c_begin,
              int64_t c_end) {
  int64_t c = c_begin;
  for (; c + kChannels <= c_end; c += kChannels) Tile<R, kChannels>(x, w, acc, k, n, r0, c);
  for (; c < c_end; ++c) Tile<R, 1>(x, w, acc, k, n, r0, c);
}

// Every row against channels [c_begin, c_end).
void Channels(const int8_t* x, const int8_t* w, int32_t* acc, int64_t m, int64_t k, int64_t n, int64_t c_begin,
              int64_t c_end) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) RowBlock<kRows>(x, w, acc, k, n, r, c_begin, c_end);
  switch (m - r) {
    case 3: RowBlock<3>(x, w, acc, k, n, r, c_begin, c_end); break;
    case 2: RowBlock<2>(x, w, acc, k, n, r, c_begin, c_end); break;
    case 1: RowBlock<1>(x, w, acc, k, n, r, c_begin, c_end); break;
    default: break;
  }
}

struct Work {
  const int8_t* x;
  const int8_t* w;
  int32_t* acc;
  int64_t m, k, n, chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Takes chunks until none is left; returns after finishing the last one it took.
  void Run() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      Channels(x, w, acc, m, k, n, i * chunk, std::min(n, (i + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                      ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("pagedjax_int8_matmul: x [m, k] and w [n, k] expected");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  if (k > 65536) return ffi::Error::InvalidArgument("pagedjax_int8_matmul: k over 65536 overflows int32 sums");
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(out->typed_data(), out->typed_data() + m * n, 0);
    return ffi::Error::Success();
  }
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->acc = out->typed_data();
  work->m = m;
  work->k = k;
  work->n = n;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread (uneven progress evens out), of whole kChannels tiles, none tiny.
  const int64_t target = std::max<int64_t>(kChannels * 4, (n + threads * 4 - 1) / (threads * 4));
  work->chunk = (target + kChannels - 1) / kChannels * kChannels;
  work->chunks = (n + work->chunk - 1) / work->chunk;
  // Enough work to share (every row times every weight): waking a pool thread cost more than it saved below
  // about 2M (`python scripts/bench_int8_matmul.py`: one row of 1024 x 1024 took 56 us alone, 80 us split).
  const int64_t helpers = m * n * k >= (1LL << 21) ? std::min(threads, work->chunks) - 1 : 0;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Run(); });
  work->Run();
  // Chunks the helpers took are in progress on running threads: they end.
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// Which arithmetic this build has, for the wrapper's log and the tests: 1 with VNNI dot products, 0 portable.
extern "C" int pagedjax_int8_matmul_vnni() { return kVnni ? 1 : 0; }
