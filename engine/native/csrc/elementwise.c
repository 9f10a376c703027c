/* The per-layer operations between the matmuls: RMSNorm (with the residual add), RoPE with the K/V store into
 * the paged pool, the SiLU gate, and the greedy sampler's argmax. */
#include "ops.h"

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, rows of n floats (x and out may alias); with a residual, x[i] +=
 * residual[i] first (in place: the residual stream's add and the next norm in one pass). On AVX-512 a row's squares
 * are summed in four chains of 16 lanes (the compiler's reduction kept one, and summed its lanes through memory:
 * 3.3% of a 2,000-token prefill). */
void tq_rms_norm(float *x, const float *residual, const float *w, int64_t m, int64_t n, float eps, float *out,
                 int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m > 8)
    for (int64_t i = 0; i < m; i++) {
        float *row = x + i * n, *o = out + i * n;
        const float *add = residual ? residual + i * n : NULL;
#ifdef __AVX512F__
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t j = 0; j < n; j += 16) {
            __mmask16 live = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(live, row + j);
            if (add) {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, add + j));
                _mm512_mask_storeu_ps(row + j, live, v);
            }
            acc[(j >> 4) & 3] = _mm512_fmadd_ps(v, v, acc[(j >> 4) & 3]);
        }
        float ss = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
        __m512 r = _mm512_set1_ps(1.f / sqrtf(ss / (float)n + eps));
        for (int64_t j = 0; j < n; j += 16) {
            __mmask16 live = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
            _mm512_mask_storeu_ps(o + j, live, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, row + j), r),
                                                             _mm512_maskz_loadu_ps(live, w + j)));
        }
#else
        if (add) {
            #pragma omp simd
            for (int64_t j = 0; j < n; j++) row[j] += add[j];
        }
        float ss = 0.f;
        #pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; j++) ss += row[j] * row[j];
        float r = 1.f / sqrtf(ss / (float)n + eps);
        #pragma omp simd
        for (int64_t j = 0; j < n; j++) o[j] = row[j] * r * w[j];
#endif
    }
}

/* Half-split RoPE on the q and k heads of each row of qkv ([m, width]: heads + kv_heads heads of d, then
 * kv_heads of v), in place; then k and v of row i are stored at slot (blocks[i], offsets[i]) of the pool's
 * key and value views (a block is `block_size` tokens of kv_heads * d floats; blocks are block_stride apart).
 * cos/sin: [positions, d] tables, sin with the sign of rotate_half folded in ([-sin, sin]). */
void tq_rope_store(float *qkv, int64_t m, int64_t width, const int64_t *positions, const float *cos_t,
                   const float *sin_t, int heads, int kv_heads, int d, void *keys, void *values,
                   int64_t block_stride, const int64_t *blocks, const int64_t *offsets, int kv_half, int threads) {
    int half = d / 2, rot = heads + kv_heads;
    int64_t kv = (int64_t)kv_heads * d;
    #pragma omp parallel for num_threads(threads) schedule(static) if (m > 8)
    for (int64_t i = 0; i < m; i++) {
        float *row = qkv + i * width;
        const float *c = cos_t + positions[i] * d, *s = sin_t + positions[i] * d;
        for (int h = 0; h < rot; h++) {
            float *x = row + (int64_t)h * d;
            #pragma omp simd
            for (int j = 0; j < half; j++) {
                float a = x[j], b = x[j + half];
                x[j] = a * c[j] + b * s[j];
                x[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
        int64_t slot = blocks[i] * block_stride + offsets[i] * kv;
        const float *k = row + (int64_t)heads * d, *v = row + (int64_t)rot * d;
        if (kv_half) {
            _Float16 *kd = (_Float16 *)keys + slot, *vd = (_Float16 *)values + slot;
            for (int64_t j = 0; j < kv; j++) {
                kd[j] = (_Float16)k[j];
                vd[j] = (_Float16)v[j];
            }
        } else {
            memcpy((float *)keys + slot, k, kv * sizeof(float));
            memcpy((float *)values + slot, v, kv * sizeof(float));
        }
    }
}

/* out[i] = the index of the largest of row i's n floats: the first of equal ones, or the first NaN (as
 * torch.argmax). The greedy sampler's pick from the logits, which torch scans on one thread. */
void tq_argmax(const float *x, int64_t m, int64_t n, int64_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * n > 65536)
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * n;
        float best = -INFINITY;
        int nan = 0;
        int64_t j = 0;
#ifdef __AVX2__
        __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        for (; j + 8 <= n; j += 8) {
            __m256 v = _mm256_loadu_ps(row + j);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mx = _mm256_max_ps(mx, v);
        }
        nan = _mm256_movemask_ps(unordered) != 0;
        best = hmax8(mx);
#endif
        for (; j < n; j++) {
            if (row[j] != row[j]) nan = 1;
            else if (row[j] > best) best = row[j];
        }
        j = 0;
#ifdef __AVX2__
        if (!nan) {
            __m256 b = _mm256_set1_ps(best);
            for (; j + 8 <= n; j += 8) {
                int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), b, _CMP_EQ_OQ));
                if (hit) {
                    j += __builtin_ctz(hit);
                    break;
                }
            }
        }
#endif
        for (; j < n; j++)
            if (nan ? row[j] != row[j] : row[j] == best) break;
        out[i] = j;
    }
}

/* The MLP's gate: out[i, j] = silu(gu[i, j]) * gu[i, f + j] for rows of gu = [gate | up] (2 f floats). The
 * sigmoid from e^-|g| <= 1 (no overflow either way); on AVX-512 the same operations 16 lanes at a time, so the same
 * bits in half the time (0.51x a 512-row chunk's). */
void tq_silu_mul(const float *gu, int64_t m, int64_t f, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m > 8)
    for (int64_t i = 0; i < m; i++) {
        const float *g = gu + i * 2 * f, *u = g + f;
        float *o = out + i * f;
        int64_t j = 0;
#ifdef __AVX512F__
        const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.0f);
        for (; j + 16 <= f; j += 16) {
            __m512 x = _mm512_loadu_ps(g + j);
            __m512 e = exp_neg16(_mm512_or_ps(x, sign));
            __m512 pos = _mm512_div_ps(one, _mm512_add_ps(one, e));
            __mmask16 negative = _mm512_cmplt_epi32_mask(_mm512_castps_si512(x), _mm512_setzero_si512());
            __m512 sig = _mm512_mask_mul_ps(pos, negative, e, pos);
            _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(u + j)));
        }
#endif
#ifdef __AVX2__
        const __m256 one8 = _mm256_set1_ps(1.f), sign8 = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= f; j += 8) {
            __m256 x = _mm256_loadu_ps(g + j);
            __m256 e = exp_neg(_mm256_or_ps(x, sign8));
            __m256 pos = _mm256_div_ps(one8, _mm256_add_ps(one8, e));
            __m256 sig = _mm256_blendv_ps(pos, _mm256_mul_ps(e, pos), x);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < f; j++) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
}

/* Rows `ids` of a Q8_0 weight (codes [n, k], float16 scales [n, k / 32]) as float32, out [m, k]: each code times
 * its group's scale (torch's q * scale, the same bits). -1, writing nothing, where an id is not a row. */
int tq_q8_rows(const int8_t *q, const uint16_t *scales, int64_t n, int64_t k, const int64_t *ids, int64_t m,
               float *out) {
    for (int64_t i = 0; i < m; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int64_t i = 0; i < m; i++) {
        const int8_t *row = q + ids[i] * k;
        const uint16_t *sc = scales + ids[i] * (k / Q8_GROUP);
        float *o = out + i * k;
        for (int64_t g = 0; g < k / Q8_GROUP; g++) {
            float d = half_to_float(sc[g]);
            #pragma omp simd
            for (int j = 0; j < Q8_GROUP; j++) o[g * Q8_GROUP + j] = (float)row[g * Q8_GROUP + j] * d;
        }
    }
    return 0;
}
