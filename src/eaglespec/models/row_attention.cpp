// Row-invariant attention on CPU (models/row_attention.py): each query row attends over its own list of
// visible cache columns, in column order, with code that depends on nothing but that list, so a row's
// output has the same bits in a one-token step and in any verification forward (the list of a tree node is
// the committed prefix plus its ancestors: the same keys, in the same order, as the one-token step that
// decodes it). Scores in one pass, then max, exp (one polynomial for every lane) and the weighted sum of
// values in a second; every sum runs in a fixed order (8 partial sums over the head dimension, then a fixed
// tree; keys one after another).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline float hsum(v8 c) { return ((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7])); }

inline float tail(const float* a, const float* b, int64_t d, int64_t n) {  // head dims past the last 8
    float s = 0.f;
    for (; d < n; ++d) s += a[d] * b[d];
    return s;
}

inline float dot(const float* a, const float* b, int64_t n) {
    v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        v8 x, y;
        __builtin_memcpy(&x, a + d, 32);
        __builtin_memcpy(&y, b + d, 32);
        acc += x * y;
    }
    return hsum(acc) + tail(a, b, d, n);
}

// scores of NH queries (heads sharing a kv head) against keys k0, k1: dot()'s arithmetic per pair, with
// each key's vector loaded once for the NH queries
template <int NH>
inline void dots_heads2(const float* const* qs, const float* k0, const float* k1, int64_t n, float* out0,
                        float* out1) {
    v8 c0[NH], c1[NH];
    for (int h = 0; h < NH; ++h) c0[h] = v8{}, c1[h] = v8{};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) {
        v8 y0, y1;
        __builtin_memcpy(&y0, k0 + d, 32);
        __builtin_memcpy(&y1, k1 + d, 32);
        for (int h = 0; h < NH; ++h) {
            v8 x;
            __builtin_memcpy(&x, qs[h] + d, 32);
            c0[h] += x * y0;
            c1[h] += x * y1;
        }
    }
    for (int h = 0; h < NH; ++h) {
        out0[h] = hsum(c0[h]) + tail(qs[h], k0, d, n);
        out1[h] = hsum(c1[h]) + tail(qs[h], k1, d, n);
    }
}

// exp of 8 floats (Cephes' expf polynomial, ~1 ulp): one function for every element wherever it lies in a
// row's list (a tail is padded into a full vector), unlike libm's scalar and vector paths
inline v8 vexp(v8 x) {
    const v8 lo = v8{} - 87.3f, hi = v8{} + 88.3f;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    v8 fx = x * 1.44269504088896341f + 0.5f;
    typedef int i8 __attribute__((vector_size(32)));
    i8 n = __builtin_convertvector(fx, i8);
    v8 fl = __builtin_convertvector(n, v8);
    fl = fl > fx ? fl - 1.f : fl;  // floor
    x = x - fl * 0.693359375f - fl * -2.12194440e-4f;
    v8 z = x * x;
    v8 y = ((((1.9875691500E-4f * x + 1.3981999507E-3f) * x + 8.3334519073E-3f) * x + 4.1665795894E-2f) * x +
            1.6666665459E-1f) * x + 5.0000001201E-1f;
    y = y * z + x + 1.f;
    i8 e = (__builtin_convertvector(fl, i8) + 127) << 23;
    v8 scale;
    __builtin_memcpy(&scale, &e, 32);
    return y * scale;
}

// acc[0 .. 8*NV) += p * v, the accumulators in registers (NV = head_dim / 8 known at compile time)
template <int NV>
inline void weighted_sum(const float* sc, const int64_t* cols, int64_t n, const float* V, float* out) {
    v8 acc[NV];
    for (int u = 0; u < NV; ++u) acc[u] = v8{};
    for (int64_t j = 0; j < n; ++j) {
        const float* v = V + cols[j];
        const float p = sc[j];
        for (int u = 0; u < NV; ++u) {
            v8 x;
            __builtin_memcpy(&x, v + 8 * u, 32);
            acc[u] += p * x;
        }
    }
    for (int u = 0; u < NV; ++u) __builtin_memcpy(out + 8 * u, &acc[u], 32);
}

inline void weighted_sum_any(const float* sc, const int64_t* cols, int64_t n, const float* V, float* out, int64_t D) {
    switch (D) {
        case 16: return weighted_sum<2>(sc, cols, n, V, out);
        case 32: return weighted_sum<4>(sc, cols, n, V, out);
        case 64: return weighted_sum<8>(sc, cols, n, V, out);
        case 128: return weighted_sum<16>(sc, cols, n, V, out);
    }
    for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) out[d] += sc[j] * V[cols[j] + d];
}

}  // namespace

// q [B, H, T, D] fp32; k_cache, v_cache [slots, Hkv, L, D] fp32 (contiguous); slots [B] int64; first: the first
// cache column read; mask [B, T, S] bool (query t sees column first + s) or an empty tensor (every query sees
// columns first .. first + S - 1, S = span - first). Returns [B, H, T, D].
// Work items are (row b, kv head g, query t): t's visible columns listed once for the group's heads, each key
// loaded once for them; a query's scores and sums are the same arithmetic whatever else the step holds.
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                            int64_t first, int64_t span, torch::Tensor mask, double scale) {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32, "fp32 only");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
    q = q.contiguous();
    slots = slots.contiguous();
    const bool masked = mask.numel() > 0;
    if (masked) mask = mask.to(torch::kBool).contiguous();
    const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
    const int64_t HKV = k_cache.size(1), L = k_cache.size(2), S = span - first;
    TORCH_CHECK(H % HKV == 0, "heads must be a multiple of kv heads");
    TORCH_CHECK(first >= 0 && span <= L && S >= 0, "columns out of the cache");
    const int64_t rep = H / HKV;
    auto out = torch::empty_like(q);
    const float* qp = q.data_ptr<float>();
    const float* kp = k_cache.data_ptr<float>();
    const float* vp = v_cache.data_ptr<float>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    const bool* mp = masked ? mask.data_ptr<bool>() : nullptr;
    float* op = out.data_ptr<float>();
    const float fscale = static_cast<float>(scale);
    // work item: (row b, kv head g, query t), the group's rep heads together (they share t's visible list)
    at::parallel_for(0, B * HKV * T, 1, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> cols(S > 0 ? S : 1);
        const int64_t SP = S + 8;  // a head's scores, + 8: the last exp vector's scratch lanes
        std::vector<float> scores(rep * SP), acc(D);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t t = item % T, bg = item / T, g = bg % HKV, b = bg / HKV;
            const float* K = kp + (sp[b] * HKV + g) * L * D;
            const float* V = vp + (sp[b] * HKV + g) * L * D;
            int64_t n = 0;
            if (masked) {
                const bool* row = mp + (b * T + t) * S;
                for (int64_t s = 0; s < S; ++s)
                    if (row[s]) cols[n++] = (first + s) * D;
            } else {
                for (int64_t s = 0; s < S; ++s) cols[n++] = (first + s) * D;
            }
            // scores: the group's heads in chunks of up to 4, two keys at a time (a key loaded once per chunk)
            for (int64_t h0 = 0; h0 < rep; h0 += 4) {
                const int nh = static_cast<int>(std::min<int64_t>(4, rep - h0));
                const float* qs[4];
                float s0[4], s1[4];
                for (int h = 0; h < nh; ++h) qs[h] = qp + ((b * H + g * rep + h0 + h) * T + t) * D;
                int64_t j = 0;
                for (; j + 2 <= n; j += 2) {
                    const float *k0 = K + cols[j], *k1 = K + cols[j + 1];
                    switch (nh) {
                        case 1: dots_heads2<1>(qs, k0, k1, D, s0, s1); break;
                        case 2: dots_heads2<2>(qs, k0, k1, D, s0, s1); break;
                        case 3: dots_heads2<3>(qs, k0, k1, D, s0, s1); break;
                        default: dots_heads2<4>(qs, k0, k1, D, s0, s1);
                    }
                    for (int h = 0; h < nh; ++h) {
                        scores[(h0 + h) * SP + j] = s0[h];
                        scores[(h0 + h) * SP + j + 1] = s1[h];
                    }
                }
                for (; j < n; ++j)
                    for (int h = 0; h < nh; ++h) scores[(h0 + h) * SP + j] = dot(qs[h], K + cols[j], D);
            }
            for (int64_t i = 0; i < rep; ++i) {
                float* sc = scores.data() + i * SP;
                int64_t j = 0;
                float m = -std::numeric_limits<float>::infinity();
                for (j = 0; j < n; ++j) {
                    sc[j] *= fscale;
                    m = sc[j] > m ? sc[j] : m;
                }
                for (j = 0; j < n; j += 8) {  // exp in vectors of 8 (lanes past n: scratch, never read)
                    v8 x;
                    __builtin_memcpy(&x, sc + j, 32);
                    x = vexp(x - m);
                    __builtin_memcpy(sc + j, &x, 32);
                }
                float l = 0.f;
                for (j = 0; j < n; ++j) l += sc[j];
                weighted_sum_any(sc, cols.data(), n, V, acc.data(), D);
                float* o = op + ((b * H + g * rep + i) * T + t) * D;
                const float inv = n > 0 ? 1.f / l : 0.f;
                for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
            }
        }
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("row_attention", &row_attention); }
