#include "ops.h"

/* ---------------------------------------------------------------- this CPU's peaks
 * Loops of independent accumulators on the widest vectors the build has, for engine/native/peaks.py to time:
 * each returns the operations it did (0 where the instruction is absent), and keeps its sums alive. */
#define PROBE_ACC 12
static volatile float probe_sink;

double tq_probe_fma(int64_t iters, int threads) {
    int width = 1;
    #pragma omp parallel num_threads(threads)
    {
        float total = 0.f;
#if defined(__AVX512F__)
        __m512 acc[PROBE_ACC], a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_set1_ps((float)i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        for (int i = 0; i < PROBE_ACC; i++) total += _mm512_reduce_add_ps(acc[i]);
        width = 16;
#elif defined(__AVX2__)
        __m256 acc[PROBE_ACC], a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm256_set1_ps((float)i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        for (int i = 0; i < PROBE_ACC; i++) total += hsum8(acc[i]);
        width = 8;
#elif defined(__ARM_NEON)
        float32x4_t acc[PROBE_ACC], a = vdupq_n_f32(0.999f), b = vdupq_n_f32(1e-3f);
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = vdupq_n_f32((float)i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = vfmaq_f32(b, acc[i], a);
        for (int i = 0; i < PROBE_ACC; i++) total += vaddvq_f32(acc[i]);
        width = 4;
#else
        float acc[PROBE_ACC];
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = (float)i;
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = acc[i] * 0.999f + 1e-3f;
        for (int i = 0; i < PROBE_ACC; i++) total += acc[i];
#endif
        probe_sink = total;
    }
    return 2.0 * width * PROBE_ACC * (double)iters * threads;
}

double tq_probe_bf16(int64_t iters, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    #pragma omp parallel num_threads(threads)
    {
        __m512 acc[PROBE_ACC];
        __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
        __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_set1_ps((float)i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        float total = 0.f;
        for (int i = 0; i < PROBE_ACC; i++) total += _mm512_reduce_add_ps(acc[i]);
        probe_sink = total;
    }
    return 2.0 * 32 * PROBE_ACC * (double)iters * threads;
#else
    (void)iters;
    (void)threads;
    return 0.0;
#endif
}

/* int8 dot products: vpdpbusd (64 multiply-adds an instruction), or NEON's sdot (16). */
double tq_probe_vnni(int64_t iters, int threads) {
#if defined(__ARM_FEATURE_DOTPROD)
    #pragma omp parallel num_threads(threads)
    {
        int32x4_t acc[PROBE_ACC];
        int8x16_t a = vdupq_n_s8(3), b = vdupq_n_s8(-2);
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = vdupq_n_s32(i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = vdotq_s32(acc[i], a, b);
        int64_t total = 0;
        for (int i = 0; i < PROBE_ACC; i++) total += vaddvq_s32(acc[i]);
        probe_sink = (float)total;
    }
    return 2.0 * 16 * PROBE_ACC * (double)iters * threads;
#elif defined(__AVX512VNNI__)
    #pragma omp parallel num_threads(threads)
    {
        __m512i acc[PROBE_ACC], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_set1_epi32(i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        int64_t total = 0;
        for (int i = 0; i < PROBE_ACC; i++) total += _mm512_reduce_add_epi32(acc[i]);
        probe_sink = (float)total;
    }
    return 2.0 * 64 * PROBE_ACC * (double)iters * threads;
#else
    (void)iters;
    (void)threads;
    return 0.0;
#endif
}

/* The sum of x [n] (n a multiple of 64), read once on `threads` threads: a read-bandwidth probe. Independent sums,
 * as many as the loads in flight need: one float chain is bound by the add's latency (~3 GB/s), not by memory. */
float tq_probe_read(const float *x, int64_t n, int threads) {
    float total = 0.f;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(__AVX512F__)
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 64) {
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(x + i));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(x + i + 16));
            s2 = _mm512_add_ps(s2, _mm512_loadu_ps(x + i + 32));
            s3 = _mm512_add_ps(s3, _mm512_loadu_ps(x + i + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#elif defined(__AVX2__)
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 64)
            for (int j = 0; j < 64; j += 32) {
                s0 = _mm256_add_ps(s0, _mm256_loadu_ps(x + i + j));
                s1 = _mm256_add_ps(s1, _mm256_loadu_ps(x + i + j + 8));
                s2 = _mm256_add_ps(s2, _mm256_loadu_ps(x + i + j + 16));
                s3 = _mm256_add_ps(s3, _mm256_loadu_ps(x + i + j + 24));
            }
        total += hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#elif defined(__ARM_NEON)
        float32x4_t s0 = vdupq_n_f32(0.f), s1 = s0, s2 = s0, s3 = s0;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 64)
            for (int j = 0; j < 64; j += 16) {
                s0 = vaddq_f32(s0, vld1q_f32(x + i + j));
                s1 = vaddq_f32(s1, vld1q_f32(x + i + j + 4));
                s2 = vaddq_f32(s2, vld1q_f32(x + i + j + 8));
                s3 = vaddq_f32(s3, vld1q_f32(x + i + j + 12));
            }
        total += vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
#else
        float s[8] = {0.f};
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 8)
            for (int j = 0; j < 8; j++) s[j] += x[i + j];
        for (int j = 0; j < 8; j++) total += s[j];
#endif
    }
    return total;
}
