// Products of int8 activations on the CPU, for XLA through its FFI (pagedjax.device.int8_matmul):
//   PagedjaxInt8Matmul  acc[m, n] = sum_k x[m, k] * w[n, k]      (x, w int8 with their k contiguous; int32, exact)
//   PagedjaxInt4Matmul  y[m, n] = sum_groups scale[n, g] * (sum_{k in g} x[m, k] * w[n, k])   (float32)
//                       w int4 in nibble planes (pagedjax.model.layers.quant.pack_int4): byte j of group g holds
//                       input g * group + j in its low nibble and g * group + group / 2 + j in its high one; x is
//                       copied in that order once per call (the low plane's inputs, then the high plane's), so both
//                       planes read it contiguously; each group's integer sum is exact, the groups' scaled sum
//                       float32.
// Built on first use by `pagedjax.device.int8_matmul` with the machine's own instruction set (-march=native).
//
// AVX-512 VNNI / AVX-VNNI multiply unsigned by signed bytes (vpdpbusd: four u8 x s8 products summed into each
// int32 lane, no saturation). int8 weights: x is made unsigned by adding 128 (x + 128 in [0, 255]) and the excess
// removed per output channel: sum_k (x + 128) w = acc + 128 * sum_k w, the channel's sum taken by the same
// instruction against bytes of 1 once per channel, however many rows. int4 weights: the weights are made unsigned
// (w + 8 in [0, 15]) and the excess 8 * sum x removed per row, taken once per row for every channel. Each product is at most 255 * 128 in size, so the int32
// sums are exact for k up to 65,536 (the wrapper refuses more). With AVX2 but no VNNI, int8 weights through
// vpmaddubsw (below; x in [-127, 127], as `quantize_rows` makes it), int4 likewise (w + 8 against x); without
// AVX2, a portable loop (the compiler vectorizes it with the instructions it has).
//
// The output channels are split in chunks over XLA's intra-op thread pool: the calling thread and the tasks it
// schedules take chunks from one counter, so the call never waits for a task that has not started (a pool
// whose threads are all busy, or a pool of one, only means the caller computes every chunk itself).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows computed together against one channel's bytes (each row an accumulator per channel).
constexpr int64_t kRows = 4;
// Channels computed together (their weights loaded once per k step for all kRows rows).
constexpr int64_t kChannels = 4;
// int4 groups of group_size / 2 packed bytes must tile 64-byte vectors (a divisor or a multiple of 64), on every
// build alike, so that which groups a model may use does not depend on the machine.
constexpr int64_t kVnniVector = 64;

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
#elif defined(__AVXVNNI__) || defined(__AVX2__)
constexpr int64_t kVector = 32;
using Vec = __m256i;
inline Vec Load(const int8_t* p, int64_t n) {
  if (n >= kVector) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) int8_t tail[32] = {0};
  std::memcpy(tail, p, n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
}
inline Vec Zero() { return _mm256_setzero_si256(); }
inline int32_t Sum(Vec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#if defined(__AVXVNNI__)
inline Vec Dot(Vec acc, Vec u, Vec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline Vec Bias(Vec v) { return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)); }
inline Vec Ones() { return _mm256_set1_epi8(1); }
#else
// No VNNI: |w| times x with w's sign (vpsignb) through vpmaddubsw (adjacent products summed into int16: at most
// 2 x 128 x 127 for x in [-127, 127], so no saturation; x = -128 against a negative weight is not exact here) and
// vpmaddwd against 16-bit ones: acc + the products of w and x, four adjacent ones summed into each int32 lane.
inline Vec SignedDot(Vec acc, Vec w, Vec x) {
  const Vec pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A nibble plane's weights w in [-8, 7], stored in two's complement, as unsigned bytes w + 8 = nibble ^ 8 (one
// ternary-logic instruction: (b & 0x0F) ^ 0x08). Against signed x, sum (w + 8) x = sum w x + 8 sum x: the excess
// depends on the row alone, so it is taken once per row (`Int4Excess`), not per channel.
inline Vec Offset(Vec b) { return _mm512_ternarylogic_epi32(b, _mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x08), 0x6A); }
inline Vec LowPlane(Vec b) { return Offset(b); }
inline Vec HighPlane(Vec b) { return Offset(_mm512_srli_epi16(b, 4)); }
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
#elif defined(__AVX2__)
  Vec sums[R][C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) sums[r][c] = Zero();
  for (int64_t i = 0; i < k; i += kVector) {
    const int64_t left = k - i;
    Vec wv[C];
    for (int64_t c = 0; c < C; ++c) wv[c] = Load(w + (c0 + c) * k + i, left);
    for (int64_t r = 0; r < R; ++r) {
      const Vec xv = Load(x + (r0 + r) * k + i, left);  // a tail's missing bytes are 0 on both sides
      for (int64_t c = 0; c < C; ++c) sums[r][c] = SignedDot(sums[r][c], wv[c], xv);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) acc[(r0 + r) * n + c0 + c] = Sum(sums[r][c]);
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

// Channel chunks shared by the calling thread and the pool tasks it schedules (see the top of the file).
struct Work {
  std::function<void(int64_t, int64_t)> channels;  // computes channels [begin, end) for every row
  int64_t n, chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Takes chunks until none is left; returns after finishing the last one it took.
  void Run() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      channels(i * chunk, std::min(n, (i + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// channels(begin, end) over [0, n) in chunks, on this thread and, for `macs` multiply-adds of 128K and more, on
// the pool's. Alone, one row of 1024 x 1024 took 56 us on one thread and 80 us split (`python
// scripts/bench_int8_matmul.py`: the pool's threads asleep between calls), but in a decode step, whose other ops
// keep them awake, splitting from 128K on made batch-1 decode of the 156M shape 1.07x (w8a8) and 1.2x (w4a8)
// faster than splitting from 2M (`python scripts/bench_quant.py --batches 1`). `channels` is only called before this
// returns.
void Parallel(ffi::ThreadPool& pool, int64_t n, int64_t macs, std::function<void(int64_t, int64_t)> channels) {
  auto work = std::make_shared<Work>();
  work->channels = std::move(channels);
  work->n = n;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread (uneven progress evens out), of whole kChannels tiles, none tiny.
  const int64_t target = std::max<int64_t>(kChannels * 4, (n + threads * 4 - 1) / (threads * 4));
  work->chunk = (target + kChannels - 1) / kChannels * kChannels;
  work->chunks = (n + work->chunk - 1) / work->chunk;
  const int64_t helpers = macs >= (1LL << 17) ? std::min(threads, work->chunks) - 1 : 0;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Run(); });
  work->Run();
  // Chunks the helpers took are in progress on running threads: they end.
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
}

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
  const int8_t* xp = x.typed_data();
  const int8_t* wp = w.typed_data();
  int32_t* acc = out->typed_data();
  Parallel(pool, n, m * n * k, [=](int64_t begin, int64_t end) { Channels(xp, wp, acc, m, k, n, begin, end); });
  return ffi::Error::Success();
}

// One row block against one channel of int4 weights: y[r, c] for rows [r0, r0 + R). half = k / 2 packed bytes,
// gh = group_size / 2 packed bytes per group (a divisor or a multiple of the vector width: the wrapper checks).
// excess: per row, -8 x the sum of x over each int32 lane's bytes of both planes (`Int4Excess`; SIMD builds).
template <int64_t R>
void Int4Tile(const int8_t* x, const uint8_t* w, const float* scale, const int32_t* excess, float* y, int64_t k,
              int64_t n, int64_t gh, int64_t r0, int64_t c) {
  const int64_t half = k / 2, groups = half / gh;
  const uint8_t* wc = w + c * half;
  const float* sc = scale + c * groups;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t lanes_per_row = (half + kVector - 1) / kVector * 16;
  __m512 sums[R];
  for (int64_t r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
  // Lane l of a vector of packed bytes starting at a group boundary holds bytes 4l .. 4l + 3: group 4l / gh of it.
  alignas(64) int32_t lane_group[16];
  for (int64_t l = 0; l < 16; ++l) lane_group[l] = gh >= kVector ? 0 : int32_t(4 * l / gh);
  const __m512i lanes = _mm512_load_si512(lane_group);
  for (int64_t i = 0; i < half; i += kVector) {
    const int64_t left = half - i;
    const Vec b = Load(reinterpret_cast<const int8_t*>(wc + i), left);
    const Vec lo = LowPlane(b), hi = HighPlane(b);  // a tail's missing bytes: w + 8 = 8, against x = 0
    const int64_t g0 = i / gh;
    const int64_t in_vector = std::min<int64_t>(std::max<int64_t>(kVector / gh, 1), groups - g0);
    const __m512 sv = _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps((__mmask16)((1u << in_vector) - 1), sc + g0));
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* xr = x + (r0 + r) * k;
      const Vec start = _mm512_loadu_si512(excess + (r0 + r) * lanes_per_row + i / 4);
      const Vec t = Dot(Dot(start, lo, Load(xr + i, left)), hi, Load(xr + half + i, left));
      sums[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sv, sums[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) y[(r0 + r) * n + c] = _mm512_reduce_add_ps(sums[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  // As above in 32-byte vectors, w + 8 against x through vpmaddubsw (pairs at most 2 x 15 x 128: no saturation).
  const int64_t lanes_per_row = (half + kVector - 1) / kVector * 8;
  __m256 sums[R];
  for (int64_t r = 0; r < R; ++r) sums[r] = _mm256_setzero_ps();
  alignas(32) int32_t lane_group[8];
  for (int64_t l = 0; l < 8; ++l) lane_group[l] = gh >= kVector ? 0 : int32_t(4 * l / gh);
  const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_group));
  const Vec low_bits = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(0x08), ones16 = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < half; i += kVector) {
    const int64_t left = half - i;
    const Vec b = Load(reinterpret_cast<const int8_t*>(wc + i), left);
    const Vec lo = _mm256_xor_si256(_mm256_and_si256(b, low_bits), eight);
    const Vec hi = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low_bits), eight);
    const int64_t g0 = i / gh;
    const int64_t in_vector = std::min<int64_t>(std::max<int64_t>(kVector / gh, 1), groups - g0);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(in_vector)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 sv = _mm256_permutevar8x32_ps(_mm256_maskload_ps(sc + g0, mask), lanes);
    for (int64_t r = 0; r < R; ++r) {
      const int8_t* xr = x + (r0 + r) * k;
      Vec t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(excess + (r0 + r) * lanes_per_row + i / 4));
      t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, Load(xr + i, left)), ones16));
      t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, Load(xr + half + i, left)), ones16));
      sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sv, sums[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(sums[r]), _mm256_extractf128_ps(sums[r], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    y[(r0 + r) * n + c] = _mm_cvtss_f32(v);
  }
#else
  (void)excess;
  for (int64_t r = 0; r < R; ++r) {
    const int8_t* xr = x + (r0 + r) * k;
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t s = 0;
      for (int64_t j = g * gh; j < (g + 1) * gh; ++j) {
        const int32_t lo = ((wc[j] & 0x0F) ^ 8) - 8, hi = ((wc[j] >> 4) ^ 8) - 8;
        s += int32_t(xr[j]) * lo + int32_t(xr[half + j]) * hi;
      }
      sum += sc[g] * float(s);
    }
    y[(r0 + r) * n + c] = sum;
  }
#endif
}

// Per row of x, for each int32 lane of each vector of packed bytes: -8 x the sum of x over the lane's 4 bytes of
// both planes (what Int4Tile's products of w + 8 carry in excess). Empty for the portable loop.
std::vector<int32_t> Int4Excess(const int8_t* x, int64_t m, int64_t k) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t half = k / 2, vectors = (half + kVector - 1) / kVector;
  std::vector<int32_t> excess(m * vectors * 16);
  const Vec ones = Ones();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t i = v * kVector, left = half - i;
      const Vec sum = Dot(Dot(Zero(), ones, Load(x + r * k + i, left)), ones, Load(x + r * k + half + i, left));
      _mm512_storeu_si512(excess.data() + (r * vectors + v) * 16, _mm512_sub_epi32(Zero(), _mm512_slli_epi32(sum, 3)));
    }
  }
  return excess;
#elif defined(__AVX2__) && defined(__FMA__)
  const int64_t half = k / 2, vectors = (half + kVector - 1) / kVector;
  std::vector<int32_t> excess(m * vectors * 8);
  const Vec ones = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t i = v * kVector, left = half - i;
      const Vec sum = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ones, Load(x + r * k + i, left)), ones16),
                                       _mm256_madd_epi16(_mm256_maddubs_epi16(ones, Load(x + r * k + half + i, left)),
                                                         ones16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(excess.data() + (r * vectors + v) * 8),
                          _mm256_sub_epi32(Zero(), _mm256_slli_epi32(sum, 3)));
    }
  }
  return excess;
#else
  (void)x, (void)m, (void)k;
  return {};
#endif
}

void Int4Channels(const int8_t* x, const uint8_t* w, const float* scale, const int32_t* excess, float* y, int64_t m,
                  int64_t k, int64_t n, int64_t gh, int64_t c_begin, int64_t c_end) {
  for (int64_t c = c_begin; c < c_end; ++c) {
    int64_t r = 0;
    for (; r + kRows <= m; r += kRows) Int4Tile<kRows>(x, w, scale, excess, y, k, n, gh, r, c);
    switch (m - r) {
      case 3: Int4Tile<3>(x, w, scale, excess, y, k, n, gh, r, c); break;
      case 2: Int4Tile<2>(x, w, scale, excess, y, k, n, gh, r, c); break;
      case 1: Int4Tile<1>(x, w, scale, excess, y, k, n, gh, r, c); break;
      default: break;
    }
  }
}

ffi::Error Int4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::U8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out, int64_t group_size) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2 || xd[1] != 2 * wd[1] || sd[0] != wd[0] ||
      group_size < 2 || group_size % 2 || xd[1] % group_size || sd[1] != xd[1] / group_size) {
    return ffi::Error::InvalidArgument(
        "pagedjax_int4_matmul: x [m, k], w [n, k / 2] and scale [n, k / group_size] expected");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0], gh = group_size / 2;
  if (gh % 4 || (gh < kVnniVector && kVnniVector % gh) || (gh > kVnniVector && gh % kVnniVector)) {
    return ffi::Error::InvalidArgument("pagedjax_int4_matmul: group_size / 2 must divide 64 or be a multiple of it");
  }
  if (k > 65536) return ffi::Error::InvalidArgument("pagedjax_int4_matmul: k over 65536 overflows int32 sums");
  if (m == 0 || n == 0) return ffi::Error::Success();
  // Each row in the planes' order (its groups' first halves, then their second halves), so that both planes read
  // x contiguously: a copy of m x k bytes, once for every channel.
  std::vector<int8_t> planes(m * k);
  for (int64_t r = 0; r < m; ++r) {
    const int8_t* row = x.typed_data() + r * k;
    for (int64_t g = 0; g < k / (2 * gh); ++g) {
      std::memcpy(planes.data() + r * k + g * gh, row + 2 * g * gh, gh);
      std::memcpy(planes.data() + r * k + k / 2 + g * gh, row + 2 * g * gh + gh, gh);
    }
  }
  const int8_t* xp = planes.data();
  const uint8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  float* yp = out->typed_data();
  const std::vector<int32_t> excess = Int4Excess(xp, m, k);
  const int32_t* ep = excess.data();
  Parallel(pool, n, m * n * k, [=](int64_t begin, int64_t end) {
    Int4Channels(xp, wp, sp, ep, yp, m, k, n, gh, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxInt4Matmul, Int4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// Which instructions this build computes with, for the wrapper's log and the tests.
extern "C" const char* pagedjax_int8_matmul_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512-vnni";
#elif defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}
