// cores_test.cpp: pagoda's torch-free kernel cores against double-precision references.
//
// Built by tests/kernels/test_kernel_cores.py with -DPAGODA_CORE_ONLY and only torch's include
// folder (no ATen, no libtorch): once for each x86 variant's flags, and with Debian's aarch64
// cross-compiler for NEON, run under qemu-aarch64. Checks vec.h (loads, exp, sums), fused.h's
// rows (RMSNorm, SiLU-and-mul, bfloat16 widening/rounding, the greedy argmax), gemv.h's products
// and attention.h's paged decode over float32, bfloat16, float16 and int8 caches with windows
// and soft-capping. Prints one line per failed check and a summary; exits 1 on any failure.
#include "core.h"
#include "vec.h"
#include "attention.h"
#include "fused.h"
#include "gemv.h"

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
  std::printf("%s (%s, %d lanes): %d checks, %d failed\n", g_failures ? "FAILED" : "ok", PAGODA_VARIANT,
              pagoda::vec::kVecWidth, g_checks, g_failures);
  return g_failures ? 1 : 0;
}
