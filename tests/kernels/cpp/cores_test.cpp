// cores_test.cpp: pagoda's torch-free kernel cores against double-precision references.
//
// Built by tests/kernels/test_kernel_cores.py with -DPAGODA_CORE_ONLY and only torch's include
// folder (no ATen, no libtorch): once for each x86 variant's flags, and with Debian's aarch64
// cross-compiler for NEON, run under qemu-aarch64. Checks vec.h (loads, exp, sums), fused.h's
// rows (RMSNorm, SiLU-and-mul, bfloat16 widening/rounding, the greedy argmax), gemv.h's products,
// attention.h's paged decode over float32, bfloat16, float16 and int8 caches with windows and
// soft-capping, moe.h's routed experts (float32 and bfloat16 panels, experts of another rank, one
// thread and several), panel.h's packers and products (where the variant has them), amx.h's
// packer (its tile product where the CPU has AMX-BF16 and Linux grants the tiles) and
// woq_core.h's weight-only quantized products (int8 per channel, int4 per group with and without
// zero terms, int8 per group, on each AVX2 path; `linear` refuses where the variant has no kernel).
// Prints one line per failed check, a summary, and a digest of the MoE, panel, int4 and grouped
// int8 outputs' bits (the
// AVX2 and AVX-512 kernels promise the same bits; the Python test compares the digests); exits 1
// on any failure.
#include "core.h"
#include "vec.h"
#include "attention.h"
#include "fused.h"
#include "gemv.h"
#include "amx.h"
#include "moe.h"
#include "panel.h"
#include "woq_core.h"

#include <cstdio>
#include <string>

namespace {

int g_checks = 0, g_failures = 0;

void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    if (g_failures <= 20) std::printf("FAIL %s\n", what.c_str());
  }
}

bool close(double got, double want, double rel, double abs_tol) {
  return std::fabs(got - want) <= abs_tol + rel * std::fabs(want);
}

struct Rng {  // a small deterministic generator (the same numbers on every target)
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 6364136223846793005ULL + 1442695040888963407ULL) {}
  uint32_t next() {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<uint32_t>(s >> 33);
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * (next() / 2147483648.0f); }
  // k / 16 for k in [-16, 16]: exact in bfloat16, and sums of their products exact in float32.
  float grid() { return static_cast<float>(static_cast<int>(next() % 33) - 16) / 16.f; }
};

void test_vec() {
  using pagoda::vec::VecF;
  constexpr int L = pagoda::vec::kVecWidth;
  float xs[L], ys[L];
  for (float start = -87.f; start + 0.37f * L < 88.f; start += 0.37f * L) {  // float32's range of exp
    for (int i = 0; i < L; ++i) xs[i] = start + 0.37f * i;
    pagoda::vec::exp(VecF::load(xs)).store(ys);
    for (int i = 0; i < L; ++i) {
      expect(close(ys[i], std::exp(static_cast<double>(xs[i])), 3e-7, 0), "vec exp(" + std::to_string(xs[i]) + ")");
      expect(close(pagoda::vec::exp1(xs[i]), std::exp(static_cast<double>(xs[i])), 3e-7, 0), "exp1");
    }
  }
  Rng rng(1);
  c10::BFloat16 b[L];
  c10::Half h[L];
  float f[L];
  for (int i = 0; i < L; ++i) {
    f[i] = rng.uniform(-3.f, 3.f);
    b[i] = c10::BFloat16(f[i]);
    h[i] = c10::Half(f[i]);
  }
  VecF::load(b).store(ys);
  for (int i = 0; i < L; ++i) expect(ys[i] == static_cast<float>(b[i]), "bfloat16 load is exact");
  VecF::load(h).store(ys);
  for (int i = 0; i < L; ++i) expect(ys[i] == static_cast<float>(h[i]), "float16 load is exact");
  double sum = 0, mx = -1e30;
  for (int i = 0; i < L; ++i) {
    sum += f[i];
    mx = std::max<double>(mx, f[i]);
  }
  expect(close(VecF::load(f).reduce_add(), sum, 1e-6, 1e-6), "reduce_add");
  expect(VecF::load(f).reduce_max() == static_cast<float>(mx), "reduce_max");
}

void test_fused() {
  Rng rng(2);
  for (int64_t H : {1, 7, 64, 100, 333}) {
    std::vector<float> x(H), w(H), y(H), g(H), u(H), o(H);
    for (int64_t i = 0; i < H; ++i) {
      x[i] = rng.uniform(-2.f, 2.f);
      w[i] = rng.uniform(0.5f, 1.5f);
      g[i] = rng.uniform(-6.f, 6.f);
      u[i] = rng.uniform(-2.f, 2.f);
    }
    pagoda::fused::norm_row(x.data(), w.data(), y.data(), H, 1e-6f);
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(x[i]) * x[i];
    const double r = 1.0 / std::sqrt(ss / H + 1e-6);
    for (int64_t i = 0; i < H; ++i) expect(close(y[i], x[i] * r * w[i], 2e-6, 1e-6), "norm_row H=" + std::to_string(H));
    pagoda::fused::silu_mul_row(g.data(), u.data(), o.data(), H);
    for (int64_t i = 0; i < H; ++i) {
      const double want = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
      expect(close(o[i], want, 2e-6, 1e-6), "silu_mul_row H=" + std::to_string(H));
    }
    std::vector<c10::BFloat16> b(H);
    pagoda::fused::narrow_row(x.data(), b.data(), H);
    std::vector<float> back(H);
    pagoda::fused::widen_row(b.data(), back.data(), H);
    for (int64_t i = 0; i < H; ++i) {
      expect(b[i].x == c10::BFloat16(x[i]).x, "narrow_row rounds as c10 (nearest, ties to even)");
      expect(back[i] == static_cast<float>(c10::BFloat16(x[i])), "widen_row is exact");
    }
  }
  for (int64_t V : {1, 5, 17, 64, 1000, 4099}) {
    std::vector<float> logits(V);
    for (int64_t i = 0; i < V; ++i) logits[i] = rng.uniform(-5.f, 5.f);
    const int64_t at = (V * 7) / 10;
    logits[at] = 9.f;
    if (V > 3) logits[V - 1] = 9.f;  // a tie: the first index wins
    if (V > 2) logits[1] = NAN;      // NaN never wins
    const int64_t want = (V > 3 && at == V - 1) ? V - 1 : (V > 2 && at == 1 ? 0 : at);
    if (!(V > 2 && at == 1)) expect(pagoda::fused::greedy_row(logits.data(), V) == want, "greedy_row V=" + std::to_string(V));
    std::vector<c10::BFloat16> lb(V);
    for (int64_t i = 0; i < V; ++i) lb[i] = c10::BFloat16(logits[i]);
    if (!(V > 2 && at == 1)) expect(pagoda::fused::greedy_row(lb.data(), V) == want, "greedy_row bf16 V=" + std::to_string(V));
  }
  std::vector<float> inf_row = {1.f, INFINITY, 3.f, INFINITY};
  expect(pagoda::fused::greedy_row(inf_row.data(), 4) == 1, "+inf counts as the largest finite value, first wins");
}

template <typename W>
void test_gemv_of(const char* name) {
  Rng rng(3);
  for (int64_t M : {1, 2, 3, 4})
    for (int64_t K : {1, 15, 64, 257})
      for (int64_t N : {1, 9, 33}) {
        std::vector<float> x(M * K);
        std::vector<W> w(N * K);
        for (auto& v : x) v = rng.grid();
        for (auto& v : w) v = W(rng.grid());
        std::vector<float> y(M * N, NAN);
        pagoda::gemv_k::run(x.data(), w.data(), y.data(), M, K, N, 0, N);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            double want = 0;
            for (int64_t k = 0; k < K; ++k) want += static_cast<double>(x[m * K + k]) * static_cast<float>(w[n * K + k]);
            expect(y[m * N + n] == static_cast<float>(want),
                   std::string("gemv ") + name + " M=" + std::to_string(M) + " K=" + std::to_string(K));
          }
      }
}

// A paged cache of `blocks` blocks of `bs` slots, Hkv heads of D elements, filled at random, and
// each sequence's block table a shuffled run of blocks.
template <class E, bool scaled>
void test_attention_of(const char* name, int64_t D, int64_t window, float softcap) {
  using T = typename E::T;
  Rng rng(4 + D + window);
  const int64_t B = 3, Hkv = 2, G = 2, H = Hkv * G, bs = 8, W = 12, blocks = B * W;
  const int32_t seq_lens[B] = {1, 37, 90};
  std::vector<int32_t> tables(B * W);
  for (int64_t i = 0; i < B * W; ++i) tables[i] = static_cast<int32_t>((i * 7 + 3) % blocks);
  std::vector<T> k(blocks * bs * Hkv * D), v(k.size());
  std::vector<float> kf(k.size()), vf(v.size());
  std::vector<uint16_t> ks, vs;
  std::vector<float> ksf, vsf;
  if (scaled) {
    ks.resize(blocks * bs * Hkv);
    vs.resize(ks.size());
    ksf.resize(ks.size());
    vsf.resize(ks.size());
    for (size_t i = 0; i < ks.size(); ++i) {
      ks[i] = c10::BFloat16(rng.uniform(0.005f, 0.02f)).x;
      vs[i] = c10::BFloat16(rng.uniform(0.005f, 0.02f)).x;
      ksf[i] = pagoda::attn::bf16_to_float(ks[i]);
      vsf[i] = pagoda::attn::bf16_to_float(vs[i]);
    }
  }
  for (size_t i = 0; i < k.size(); ++i) {
    if constexpr (std::is_same_v<E, pagoda::attn::I8>) {
      k[i] = static_cast<int8_t>(static_cast<int>(rng.next() % 255) - 127);
      v[i] = static_cast<int8_t>(static_cast<int>(rng.next() % 255) - 127);
    } else if constexpr (std::is_same_v<E, pagoda::attn::BF16>) {
      k[i] = c10::BFloat16(rng.uniform(-1.f, 1.f)).x;
      v[i] = c10::BFloat16(rng.uniform(-1.f, 1.f)).x;
    } else {
      k[i] = T(rng.uniform(-1.f, 1.f));
      v[i] = T(rng.uniform(-1.f, 1.f));
    }
    kf[i] = E::get(k[i]) * (scaled ? ksf[i / D] : 1.f);
    vf[i] = E::get(v[i]) * (scaled ? vsf[i / D] : 1.f);
  }
  std::vector<float> q(B * H * D), out(B * H * D, NAN);
  for (auto& x : q) x = rng.uniform(-2.f, 2.f);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  pagoda::attn::Cache c{k.data(), v.data(), scaled ? ks.data() : nullptr, scaled ? vs.data() : nullptr,
                        bs * Hkv * D, Hkv * D, D, bs * Hkv, Hkv, 1};
  pagoda::attn::run<E, scaled>(out.data(), q.data(), c, tables.data(), seq_lens, B, H, D, Hkv, bs, W, scale, window,
                               softcap);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / G;
      std::vector<double> s;
      double m = -1e300;
      for (int64_t p = lo; p < seq_lens[b]; ++p) {
        const int64_t slot = (tables[b * W + p / bs] * bs + p % bs) * Hkv + kvh;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[(b * H + h) * D + d]) * kf[slot * D + d];
        dot *= scale;
        if (softcap > 0) dot = softcap * std::tanh(dot / softcap);
        s.push_back(dot);
        m = std::max(m, dot);
      }
      double den = 0;
      for (auto& x : s) den += (x = std::exp(x - m));
      for (int64_t d = 0; d < D; ++d) {
        double want = 0;
        for (int64_t p = lo; p < seq_lens[b]; ++p) {
          const int64_t slot = (tables[b * W + p / bs] * bs + p % bs) * Hkv + kvh;
          want += s[p - lo] * vf[slot * D + d];
        }
        want /= den;
        expect(close(out[(b * H + h) * D + d], want, 1e-4, 2e-5),
               std::string("attention ") + name + " D=" + std::to_string(D) + " window=" + std::to_string(window) +
                   " softcap=" + std::to_string(softcap) + " seq=" + std::to_string(b));
      }
    }
  }
}


// FNV-1a over the bits of a kernel's outputs: one digest per kernel, compared across variants.
struct Digest {
  uint64_t h = 1469598103934665603ULL;
  void add(const float* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t b;
      std::memcpy(&b, p + i, 4);
      for (int s = 0; s < 32; s += 8) h = (h ^ ((b >> s) & 0xff)) * 1099511628211ULL;
    }
  }
};
Digest g_moe_bits, g_panel_bits, g_woq4_bits, g_woq8g_bits;

// The dense weights of E experts in FusedMoE's stacking, w13 [E, 2I, H] (gate rows, then up rows)
// and w2 [E, H, I], packed as moe.h reads them: w13 [E, 2, ceil(I/16), H, 16], w2 [E, ceil(H/16),
// I, 16], zero padded.
template <typename W>
void pack_experts(const std::vector<float>& w13, const std::vector<float>& w2, int64_t E, int64_t H, int64_t I,
                  std::vector<W>& p13, std::vector<W>& p2) {
  constexpr int64_t NP = pagoda::moe::NP;
  const int64_t pi = (I + NP - 1) / NP, ph = (H + NP - 1) / NP;
  p13.assign(E * 2 * pi * H * NP, W(0.f));
  p2.assign(E * ph * I * NP, W(0.f));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t i = 0; i < I; ++i)
        for (int64_t h = 0; h < H; ++h)
          p13[(((e * 2 + g) * pi + i / NP) * H + h) * NP + i % NP] = W(w13[(e * 2 * I + g * I + i) * H + h]);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < I; ++i) p2[((e * ph + h / NP) * I + i) * NP + h % NP] = W(w2[(e * H + h) * I + i]);
}

// moe.h's experts for T tokens of k slots over the E experts first .. first + E - 1 of E + 2 (the
// other ids are another rank's and add nothing); `crowd`: every token's first slot goes to the
// first local expert (more rows than one tile holds). Against a double-precision reference of each
// token's routing-weighted sum of silu(gate) * up through the down product; and the same bits on
// one thread and on three.
template <typename W>
void test_moe_of(const char* name, int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, bool crowd) {
  Rng rng(5 + T * 31 + H * 7 + I);
  const int64_t first = 1, total = E + 2;
  std::vector<float> x(T * H), wts(T * k), w13(E * 2 * I * H), w2(E * H * I);
  std::vector<int64_t> ids(T * k);
  for (auto& v : x) v = rng.grid();
  for (auto& v : w13) v = rng.grid();
  for (auto& v : w2) v = rng.grid();
  for (auto& v : wts) v = rng.uniform(0.f, 1.f);
  for (int64_t p = 0; p < T * k; ++p) ids[p] = crowd && p % k == 0 ? first : static_cast<int64_t>(rng.next() % total);
  if (T > 1)
    for (int64_t s = 0; s < k; ++s) ids[(T - 1) * k + s] = s % 2 ? 0 : total - 1;  // the last token: all remote
  std::vector<W> p13, p2;
  pack_experts(w13, w2, E, H, I, p13, p2);
  const pagoda::moe::Groups g = pagoda::moe::group_pairs(ids.data(), T, k, first, E);
  const int64_t P = g.offsets[E];
  std::vector<float> outs[2];
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<float> xs(P * H), act(P * I), y(P * H);
    outs[pass].assign(T * H, NAN);
    pagoda::moe::experts(x.data(), wts.data(), T, k, g, p13.data(), p2.data(), E, H, I, xs.data(), act.data(),
                         y.data(), outs[pass].data(), pass == 0 ? 1 : 3);
  }
  const std::string what = std::string("moe ") + name + " T=" + std::to_string(T) + " k=" + std::to_string(k) +
                           " E=" + std::to_string(E) + " H=" + std::to_string(H) + " I=" + std::to_string(I);
  expect(std::memcmp(outs[0].data(), outs[1].data(), T * H * sizeof(float)) == 0, what + ": 1 thread = 3 threads");
  const std::vector<float>& out = outs[0];
  g_moe_bits.add(out.data(), T * H);
  std::vector<double> act(I);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> want(H, 0.0), scale(H, 0.0);
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = ids[t * k + s] - first;
      if (e < 0 || e >= E) continue;
      for (int64_t i = 0; i < I; ++i) {
        double gate = 0, up = 0;
        for (int64_t h = 0; h < H; ++h) {
          gate += static_cast<double>(w13[(e * 2 * I + i) * H + h]) * x[t * H + h];
          up += static_cast<double>(w13[(e * 2 * I + I + i) * H + h]) * x[t * H + h];
        }
        act[i] = gate / (1.0 + std::exp(-gate)) * up;
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < I; ++i) {
          const double term = wts[t * k + s] * static_cast<double>(w2[(e * H + h) * I + i]) * act[i];
          want[h] += term;
          scale[h] += std::fabs(term);
        }
    }
    for (int64_t h = 0; h < H; ++h)
      expect(std::fabs(out[t * H + h] - want[h]) <= 1e-5 * scale[h] + 1e-6, what + " token=" + std::to_string(t));
  }
}

void test_moe() {
  for (bool bf16 : {false, true}) {
    auto run = [&](int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, bool crowd) {
      if (bf16) test_moe_of<c10::BFloat16>("bfloat16", T, k, E, H, I, crowd);
      else test_moe_of<float>("float32", T, k, E, H, I, crowd);
    };
    run(1, 1, 1, 16, 16, false);   // one token, whole panels
    run(6, 2, 3, 20, 24, false);   // partial last panels of both products
    run(9, 2, 4, 48, 19, false);   // three down panels: a pair, then one alone
    run(40, 2, 3, 37, 33, true);   // an expert of 40 rows: two tiles of 20, single panels each
    run(17, 3, 2, 33, 7, true);    // 17 rows (one tile past the two-panel limit), I < one panel
  }
}

// x [M, K] (row stride ldx) @ w [N, K]^T in double: the exact sums of grid values.
std::vector<double> exact_product(const std::vector<float>& x, int64_t ldx, const std::vector<float>& w, int64_t M,
                                  int64_t N, int64_t K) {
  std::vector<double> want(M * N, 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) want[m * N + n] += static_cast<double>(x[m * ldx + k]) * w[n * K + k];
  return want;
}

// A product's output y [M, ldy], filled with `sentinel` before the call: where the variant has
// the kernel (`has`), computed, the first N columns equal to the exact sums and the rest untouched;
// without it, refused with nothing written.
void check_exact_product(const std::vector<float>& y, bool done, bool has, int64_t M, int64_t N, int64_t ldy,
                         const std::vector<double>& want, float sentinel, const std::string& what) {
  expect(done == has, what + (has ? ": computed" : ": reports no kernel"));
  bool right = true, kept = true;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < ldy; ++n) {
      const float v = y[m * ldy + n];
      if (n < N && has) right &= v == static_cast<float>(want[m * N + n]);
      else kept &= v == sentinel;
    }
  expect(right, what + ": exact sums");
  expect(kept, what + ": nothing written past N (or anywhere, without the kernel)");
}

// amx.h: the packer on every variant (the documented layout and its zero padding); the tile
// product against exact sums (grid values), float32 and bfloat16 rows with row strides, where the
// CPU has AMX-BF16 and Linux grants the tiles; elsewhere `matmul` says so and writes nothing.
void test_amx() {
  using namespace pagoda::amx;
  Rng rng(9);
  const std::string variant = PAGODA_VARIANT;
  expect(kCompiled == (variant == "avx512"), "amx: the kernel in the avx512 variant only");
  const bool runs = tiles_granted();
  expect(!runs || kCompiled, "amx: tiles granted only where the kernel is compiled");
  for (int64_t N : {1, 16, 31, 32, 33, 70})
    for (int64_t K : {1, 31, 32, 33, 70}) {
      const int64_t KS = up(K, KB) / KB;
      std::vector<float> w(N * K);
      std::vector<uint16_t> wb(N * K), packed(packed_size(N, K), 0xFFFF);
      for (int64_t i = 0; i < N * K; ++i) {
        w[i] = rng.grid();
        wb[i] = c10::BFloat16(w[i]).x;
      }
      pack_into(wb.data(), N, K, packed.data());
      const std::string shape = " N=" + std::to_string(N) + " K=" + std::to_string(K);
      bool laid = true;
      for (int64_t n = 0; n < up(N, NB); ++n)
        for (int64_t k = 0; k < KS * KB; ++k) {
          // block n / 32, K step k / 32, tile (n % 32) / 16, tile row (k % 32) / 2, pair slot
          const int64_t at = ((((n / NB) * KS + k / KB) * 2 + (n % NB) / 16) * 16 + (k % KB) / 2) * 32 +
                             (n % 16) * 2 + k % 2;
          laid &= packed[at] == ((n < N && k < K) ? wb[n * K + k] : 0);
        }
      expect(laid, "amx pack_into" + shape);
      for (int64_t M : {1, 5, 16, 17, 33}) {
        const int64_t ldx = K + 3, ldy = N + 5;
        std::vector<float> x(M * ldx);
        std::vector<uint16_t> xb(M * ldx);
        for (int64_t i = 0; i < M * ldx; ++i) {
          x[i] = rng.grid();
          xb[i] = c10::BFloat16(x[i]).x;
        }
        const std::vector<double> want = exact_product(x, ldx, w, M, N, K);
        const float sentinel = -1234.5f;
        for (const bool bf16 : {false, true}) {
          std::vector<float> y(M * ldy, sentinel);
          const void* xs = bf16 ? static_cast<const void*>(xb.data()) : static_cast<const void*>(x.data());
          const bool done = matmul(y.data(), ldy, xs, bf16, ldx, M, K, packed.data(), N);
          check_exact_product(y, done, runs, M, N, ldy, want, sentinel,
                              "amx matmul" + shape + " M=" + std::to_string(M) + (bf16 ? " bf16 rows" : ""));
        }
      }
    }
}

// panel.h: the packers on every variant (the layout and its zero padding); the float32 and
// bfloat16 products where the variant has them, against exact sums (grid values), with row
// strides and columns past N left as they were; a variant without them says so and writes nothing.
void test_panel() {
  using namespace pagoda::panel;
  Rng rng(6);
  const std::string variant = PAGODA_VARIANT;
  expect(kHasF32 == (variant == "avx2" || variant == "avx512"), "panel: the float32 kernel on AVX2 and AVX-512 only");
  expect(kHasBF16 == (variant == "avx512"), "panel: the bfloat16 kernel on AVX-512 (BF16) only");
  for (int64_t N : {1, 15, 16, 17, 33, 48, 50, 97})
    for (int64_t K : {1, 7, 64, 65}) {
      const int64_t P = (N + 15) / 16, K2 = (K + 1) / 2;
      std::vector<float> w(N * K);
      std::vector<uint16_t> wb(N * K);
      for (int64_t i = 0; i < N * K; ++i) {
        w[i] = rng.grid();
        wb[i] = c10::BFloat16(w[i]).x;
      }
      std::vector<float> packed(P * K * 16, 0.f);
      std::vector<uint16_t> packed_b(P * K2 * 32, 0);
      pack_into(w.data(), N, K, packed.data());
      pack_bf16_into(wb.data(), N, K, packed_b.data());
      const std::string shape = " N=" + std::to_string(N) + " K=" + std::to_string(K);
      bool laid = true, laid_b = true;
      for (int64_t n = 0; n < P * 16; ++n)
        for (int64_t kk = 0; kk < K2 * 2; ++kk) {
          const bool real = n < N && kk < K;
          if (kk < K) laid &= packed[((n / 16) * K + kk) * 16 + n % 16] == (real ? w[n * K + kk] : 0.f);
          laid_b &= packed_b[(((n / 16) * K2 + kk / 2) * 16 + n % 16) * 2 + kk % 2] == (real ? wb[n * K + kk] : 0);
        }
      expect(laid, "panel pack_into" + shape);
      expect(laid_b, "panel pack_bf16_into" + shape);
      for (int64_t M : {1, 2, 5, 6, 7, 8, 9, 13, 17}) {
        const int64_t ldx = K + 3, ldy = N + 5;
        std::vector<float> x(M * ldx);
        std::vector<c10::BFloat16> xb(M * ldx);
        for (int64_t i = 0; i < M * ldx; ++i) {
          x[i] = rng.grid();
          xb[i] = c10::BFloat16(x[i]);
        }
        const std::vector<double> want = exact_product(x, ldx, w, M, N, K);
        const float sentinel = -1234.5f;
        const auto check = [&](const std::vector<float>& y, bool done, bool has, const std::string& what) {
          check_exact_product(y, done, has, M, N, ldy, want, sentinel, what);
        };
        const std::string what = shape + " M=" + std::to_string(M);
        std::vector<float> y(M * ldy, sentinel);
        check(y, matmul(y.data(), ldy, x.data(), ldx, M, K, packed.data(), N), kHasF32, "panel matmul" + what);
        if (kHasF32) g_panel_bits.add(y.data(), M * ldy);
        std::vector<float> yb(M * ldy, sentinel), ybb(M * ldy, sentinel);
        const auto* pb = reinterpret_cast<const c10::BFloat16*>(packed_b.data());
        check(yb, matmul_bf16(yb.data(), ldy, x.data(), false, ldx, M, K, pb, N), kHasBF16,
              "panel matmul_bf16 float32 rows" + what);
        check(ybb, matmul_bf16(ybb.data(), ldy, xb.data(), true, ldx, M, K, pb, N), kHasBF16,
              "panel matmul_bf16 bfloat16 rows" + what);
      }
    }
  if (!kHasBF16) return;
  // Rows that bfloat16 does not hold exactly: rounded to nearest even, as c10 rounds.
  const int64_t M = 3, K = 77, N = 21, P = (N + 15) / 16, K2 = (K + 1) / 2;
  std::vector<float> x(M * K);
  std::vector<uint16_t> wb(N * K), packed_b(P * K2 * 32, 0);
  for (auto& v : x) v = rng.uniform(-2.f, 2.f);
  for (auto& v : wb) v = c10::BFloat16(rng.uniform(-1.f, 1.f)).x;
  pack_bf16_into(wb.data(), N, K, packed_b.data());
  std::vector<float> y(M * N);
  matmul_bf16(y.data(), N, x.data(), false, K, M, K, reinterpret_cast<const c10::BFloat16*>(packed_b.data()), N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0, scale = 0;
      for (int64_t kk = 0; kk < K; ++kk) {
        const double term = static_cast<double>(static_cast<float>(c10::BFloat16(x[m * K + kk]))) *
                            pagoda::attn::bf16_to_float(wb[n * K + kk]);
        want += term;
        scale += std::fabs(term);
      }
      expect(std::fabs(y[m * N + n] - want) <= 1e-6 * scale, "panel matmul_bf16 rounds float32 rows to bfloat16");
    }
}

// ---- woq_core.h ----------------------------------------------------------------------------

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
constexpr bool kWoqInt = true, kWoqFp8 = true;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr bool kWoqInt = true, kWoqFp8 = false;
#else
constexpr bool kWoqInt = false, kWoqFp8 = false;
#endif

// int8 codes [N, K] as pagoda/kernels/woq.py's pack_int8 lays them, [N/16, K/4, 16, 4], and its
// column sums, 128 * sum_k q[n, k].
void woq_pack_int8(const std::vector<int8_t>& q, int64_t N, int64_t K, std::vector<uint8_t>& packed,
                   std::vector<int32_t>& sums) {
  packed.assign(N * K, 0);
  sums.assign(N, 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      packed[(((n / 16) * (K / 4) + k / 4) * 16 + n % 16) * 4 + k % 4] = static_cast<uint8_t>(q[n * K + k]);
      sums[n] += 128 * q[n * K + k];
    }
}

// int4 codes 0..15 [N, K] as pack_int4: [N/16, K/8, 16, 4] bytes, byte j of an octet holding
// column j in its low nibble and column j + 4 in its high one.
std::vector<uint8_t> woq_pack_int4(const std::vector<uint8_t>& q, int64_t N, int64_t K) {
  std::vector<uint8_t> packed(N * K / 2);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < K / 8; ++o)
      for (int64_t j = 0; j < 4; ++j)
        packed[(((n / 16) * (K / 8) + o) * 16 + n % 16) * 4 + j] =
            static_cast<uint8_t>(q[n * K + 8 * o + j] | (q[n * K + 8 * o + 4 + j] << 4));
  return packed;
}

// int8 codes [N, K] in groups as pack_int8g lays them: q + 128 in pack_int8's [N/16, K/4, 16, 4]
// order, and float16 scales [N, G] as [N/16, G, 16].
void woq_pack_int8g(const std::vector<int8_t>& q, const std::vector<uint16_t>& scales, int64_t N, int64_t K,
                    int64_t G, std::vector<uint8_t>& packed, std::vector<uint16_t>& gs) {
  packed.assign(N * K, 0);
  gs.assign(N * G, 0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k)
      packed[(((n / 16) * (K / 4) + k / 4) * 16 + n % 16) * 4 + k % 4] = static_cast<uint8_t>(q[n * K + k] + 128);
    for (int64_t g = 0; g < G; ++g) gs[((n / 16) * G + g) * 16 + n % 16] = scales[n * G + g];
  }
}

// x [M, K] with an outlier that sets row 0's scale, and zeros.
std::vector<float> woq_rows(Rng& rng, int64_t M, int64_t K) {
  std::vector<float> x(M * K);
  for (float& v : x) v = rng.uniform(-2.f, 2.f);
  x[K / 3] = 40.f;
  x[M * K - 1] = 0.f;
  return x;
}

// y against float64 x @ w_hat^T + bias within the fixed-point activations' bound
// (tests/kernels/test_kernel_variants.py's _woq_bound): 2^-16 of the row's largest |x| times the
// weights' absolute sum, plus 2^-20 of the absolute products, plus 1e-6.
void woq_expect_near(const std::vector<float>& y, const std::vector<float>& x, const std::vector<double>& w_hat,
                     const float* bias, int64_t M, int64_t K, int64_t N, const std::string& what) {
  for (int64_t m = 0; m < M; ++m) {
    double amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<double>(x[m * K + k])));
    for (int64_t n = 0; n < N; ++n) {
      double want = bias ? bias[n] : 0.0, wabs = 0, prod = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double w = w_hat[n * K + k], xv = x[m * K + k];
        want += xv * w;
        wabs += std::fabs(w);
        prod += std::fabs(xv * w);
      }
      const double bound = std::ldexp(amax * wabs, -16) * 1.01 + std::ldexp(prod, -20) + 1e-6;
      expect(std::fabs(y[m * N + n] - want) <= bound, what + " row " + std::to_string(m) + " col " +
                                                          std::to_string(n) + ": " + std::to_string(y[m * N + n]) +
                                                          " vs " + std::to_string(want));
    }
  }
}

// The AVX2 variant's paths (plain, and AVX-VNNI where the CPU has it); one elsewhere.
std::vector<bool> woq_paths() {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (pagoda::woq::cpu_has_avx_vnni()) return {false, true};
  return {false};
#else
  return {false};
#endif
}

void woq_set_path(bool vnni) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  pagoda::woq::g_vnni = vnni;
#else
  (void)vnni;
#endif
}

// int8 in groups (kind 3, GGUF Q8_0's numbers): w_hat = q * s, s float16 per group and channel;
// every path of the variant the same bits (the exact integer group sums, one float epilogue).
// The last shape has only extreme codes (-128, 127; channel 0 all 127, channel 1 all -128) and rows
// of one value (+-3, every v at +-32639): groups of 256 whose sums of (q + 128) * v reach 2^30.99
// and of q * v 2^30 (channel 0), the most the kind allows.
void test_woq_int8g(Rng& rng, const std::vector<bool>& paths) {
  constexpr int64_t kShapes[][3] = {{48, 72, 8}, {32, 200, 40}, {80, 1056, 32}, {16, 1024, 256}, {32, 512, 256}};
  for (const auto& shape : kShapes) {
    const int64_t N = shape[0], K = shape[1], group = shape[2], G = K / group;
    const bool extreme = &shape == &kShapes[4];
    std::vector<int8_t> q(N * K);
    for (int64_t i = 0; i < N * K; ++i)
      q[i] = static_cast<int8_t>(!extreme ? static_cast<int>(rng.next() % 256) - 128
                                 : i < K ? 127 : i < 2 * K ? -128 : rng.next() % 2 ? 127 : -128);
    std::vector<uint16_t> scales(N * G);
    for (auto& v : scales) v = c10::Half(rng.uniform(0.0005f, 0.02f)).x;
    std::vector<float> bias(N);
    for (auto& v : bias) v = rng.uniform(-1.f, 1.f);
    std::vector<double> w_hat(N * K);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        w_hat[n * K + k] = q[n * K + k] * static_cast<double>(static_cast<float>(
                                              c10::Half(scales[n * G + k / group], c10::Half::from_bits())));
    std::vector<uint8_t> packed;
    std::vector<uint16_t> gs;
    woq_pack_int8g(q, scales, N, K, G, packed, gs);
    for (int64_t M : {1, 2, 3, 4, 5}) {
      std::vector<float> x = woq_rows(rng, M, K);
      if (extreme)
        for (int64_t i = 0; i < M * K; ++i) x[i] = (i / K) % 2 ? -3.f : 3.f;
      const float* b = M % 2 ? bias.data() : nullptr;
      std::vector<float> first;
      for (bool vnni : paths) {
        woq_set_path(vnni);
        std::vector<float> y(M * N, -7.f);
        const bool ran = pagoda::woq::linear(y.data(), x.data(), M, K, N, packed.data(), 3, nullptr, gs.data(),
                                             nullptr, group, nullptr, b);
        const std::string what = "woq int8 in groups " + std::to_string(M) + "x" + std::to_string(K) + "x" +
                                 std::to_string(N) + " group " + std::to_string(group) + (vnni ? " (AVX-VNNI)" : "");
        expect(ran == kWoqInt, what + ": the kernel where the variant has it, false elsewhere");
        if (!ran) {
          expect(y[0] == -7.f && y[M * N - 1] == -7.f, what + ": nothing written without a kernel");
          continue;
        }
        woq_expect_near(y, x, w_hat, b, M, K, N, what);
        if (first.empty()) {
          first = y;
          g_woq8g_bits.add(y.data(), M * N);
        } else {
          expect(std::memcmp(first.data(), y.data(), M * N * sizeof(float)) == 0,
                 what + ": the same bits as the plain AVX2 path");
        }
      }
    }
  }
}

void test_woq() {
  Rng rng(7);
  const std::vector<bool> paths = woq_paths();
  // int8 per channel: w_hat = q * scale
  for (auto [N, K] : {std::pair<int64_t, int64_t>{48, 72}, {80, 1024}}) {
    std::vector<int8_t> q(N * K);
    std::vector<float> cs(N), bias(N);
    std::vector<double> w_hat(N * K);
    for (auto& v : q) v = static_cast<int8_t>(static_cast<int>(rng.next() % 256) - 128);
    for (int64_t n = 0; n < N; ++n) {
      cs[n] = rng.uniform(0.f, 0.01f);
      bias[n] = rng.uniform(-1.f, 1.f);
      for (int64_t k = 0; k < K; ++k) w_hat[n * K + k] = static_cast<double>(q[n * K + k]) * cs[n];
    }
    std::vector<uint8_t> packed;
    std::vector<int32_t> sums;
    woq_pack_int8(q, N, K, packed, sums);
    for (int64_t M : {1, 2, 3, 5}) {
      const std::vector<float> x = woq_rows(rng, M, K);
      const float* b = M % 2 ? bias.data() : nullptr;
      for (bool vnni : paths) {
        woq_set_path(vnni);
        std::vector<float> y(M * N, -7.f);
        const bool ran = pagoda::woq::linear(y.data(), x.data(), M, K, N, packed.data(), 0, cs.data(), nullptr,
                                             nullptr, 0, sums.data(), b);
        const std::string what = "woq int8 " + std::to_string(M) + "x" + std::to_string(K) + "x" +
                                 std::to_string(N) + (vnni ? " (AVX-VNNI)" : "");
        expect(ran == kWoqInt, what + ": the kernel where the variant has it, false elsewhere");
        if (ran) woq_expect_near(y, x, w_hat, b, M, K, N, what);
        else expect(y[0] == -7.f && y[M * N - 1] == -7.f, what + ": nothing written without a kernel");
      }
    }
  }
  // int4 per group: w_hat = q * s + t, s and t float16 [G, N] (symmetric: t = -8 * s, left out)
  constexpr int64_t kInt4Shapes[][3] = {{48, 72, 24}, {80, 1024, 128}, {32, 256, 256}};  // N, K, group
  for (const auto& shape : kInt4Shapes)
    for (bool symmetric : {false, true}) {
      const int64_t N = shape[0], K = shape[1], group = shape[2], G = K / group;
      std::vector<uint8_t> q(N * K);
      for (auto& v : q) v = static_cast<uint8_t>(rng.next() % 16);
      std::vector<uint16_t> gs(G * N), gb(G * N);
      std::vector<float> bias(N);
      for (int64_t i = 0; i < G * N; ++i) {
        const c10::Half s(rng.uniform(0.001f, 0.021f));
        gs[i] = s.x;
        gb[i] = c10::Half(symmetric ? -8.f * static_cast<float>(s) : -static_cast<float>(s) * (rng.next() % 16)).x;
      }
      for (auto& v : bias) v = rng.uniform(-1.f, 1.f);
      std::vector<double> w_hat(N * K);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          const int64_t at = (k / group) * N + n;
          const double s = static_cast<float>(c10::Half(gs[at], c10::Half::from_bits()));
          const double t = static_cast<float>(c10::Half(gb[at], c10::Half::from_bits()));
          w_hat[n * K + k] = q[n * K + k] * s + t;
        }
      const std::vector<uint8_t> packed = woq_pack_int4(q, N, K);
      for (int64_t M : {1, 2, 3, 5}) {
        const std::vector<float> x = woq_rows(rng, M, K);
        const float* b = M % 2 ? bias.data() : nullptr;
        std::vector<float> first;
        for (bool vnni : paths) {
          woq_set_path(vnni);
          std::vector<float> y(M * N, -7.f);
          const bool ran = pagoda::woq::linear(y.data(), x.data(), M, K, N, packed.data(), 2, nullptr, gs.data(),
                                               symmetric ? nullptr : gb.data(), group, nullptr, b);
          const std::string what = std::string("woq int4 ") + (symmetric ? "symmetric " : "") +
                                   std::to_string(M) + "x" + std::to_string(K) + "x" + std::to_string(N) + " group " +
                                   std::to_string(group) + (vnni ? " (AVX-VNNI)" : "");
          expect(ran == kWoqInt, what + ": the kernel where the variant has it, false elsewhere");
          if (!ran) {
            expect(y[0] == -7.f && y[M * N - 1] == -7.f, what + ": nothing written without a kernel");
            continue;
          }
          woq_expect_near(y, x, w_hat, b, M, K, N, what);
          if (first.empty()) {
            first = y;
            g_woq4_bits.add(y.data(), M * N);
          } else {
            expect(std::memcmp(first.data(), y.data(), M * N * sizeof(float)) == 0,
                   what + ": the same bits as the plain AVX2 path");
          }
        }
      }
    }
  test_woq_int8g(rng, paths);
  woq_set_path(paths.back());
  // fp8 e4m3 (pack_fp8's [N/16, K/2, 16, 2] bytes): the AVX-512 variant's only, activations
  // rounded to bfloat16, float32 sums; elsewhere the entry refuses
  const int64_t N = 32, K = 96;
  std::vector<uint8_t> codes(N * K), w(N * K);
  std::vector<double> w_hat(N * K);
  std::vector<float> cs(N);
  for (auto& v : cs) v = rng.uniform(0.5f, 2.f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      uint8_t c = static_cast<uint8_t>(rng.next() % 256);
      if ((c & 0x7F) == 0x7F) c = 0x38;  // NaN codes out
      const int e = (c >> 3) & 0xF, f = c & 7;
      const double mag = e ? std::ldexp(1.0 + f / 8.0, e - 7) : std::ldexp(f, -9);
      w_hat[n * K + k] = (c & 0x80 ? -mag : mag) * cs[n];
      w[(((n / 16) * (K / 2) + k / 2) * 16 + n % 16) * 2 + k % 2] = c;
    }
  for (int64_t M : {1, 3, 6}) {
    std::vector<float> x = woq_rows(rng, M, K), y(M * N, -7.f);
    const bool ran = pagoda::woq::linear(y.data(), x.data(), M, K, N, w.data(), 1, cs.data(), nullptr, nullptr, 0,
                                         nullptr, nullptr);
    const std::string what = "woq fp8 " + std::to_string(M) + " rows";
    expect(ran == kWoqFp8, what + ": the kernel on AVX-512 only");
    if (!ran) {
      expect(y[0] == -7.f && y[M * N - 1] == -7.f, what + ": nothing written without a kernel");
      continue;
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double want = 0, prod = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double t = static_cast<float>(c10::BFloat16(x[m * K + k])) * w_hat[n * K + k];
          want += t;
          prod += std::fabs(t);
        }
        expect(close(y[m * N + n], want, 0, 1e-5 * prod + 1e-6), what + ": bfloat16 activations, float32 sums");
      }
  }
}

}  // namespace

int main() {
  test_vec();
  test_fused();
  test_gemv_of<float>("float32");
  test_gemv_of<c10::BFloat16>("bfloat16");
  for (int64_t D : {64, 80, 128, 256})
    for (auto [window, cap] : {std::pair<int64_t, float>{0, 0.f}, {16, 0.f}, {0, 1.5f}}) {
      test_attention_of<pagoda::attn::F32, false>("float32", D, window, cap);
      test_attention_of<pagoda::attn::BF16, false>("bfloat16", D, window, cap);
      test_attention_of<pagoda::attn::F16, false>("float16", D, window, cap);
      test_attention_of<pagoda::attn::I8, true>("int8", D, window, cap);
    }
  test_moe();
  test_panel();
  test_amx();
  test_woq();
  std::printf("%s (%s, %d lanes): %d checks, %d failed\n", g_failures ? "FAILED" : "ok", PAGODA_VARIANT,
              pagoda::vec::kVecWidth, g_checks, g_failures);
  std::printf("digest moe=%016llx panel=%016llx woq4=%016llx woq8g=%016llx\n",
              static_cast<unsigned long long>(g_moe_bits.h), static_cast<unsigned long long>(g_panel_bits.h),
              static_cast<unsigned long long>(g_woq4_bits.h), static_cast<unsigned long long>(g_woq8g_bits.h));
  return g_failures ? 1 : 0;
}
