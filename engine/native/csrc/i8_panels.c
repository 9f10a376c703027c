#include "ops.h"

/* ---------------------------------------------------------------- int8 activations on packed weights (VNNI, dotprod)
 * vpdpbusd does four times the multiply-adds of a float32 FMA (twice vdpbf16ps's) in the same time. Each
 * activation row is rounded to int8 per group of 32 (p = round(a / s), s = max |a| / 127, ties to even: llama.cpp's
 * Q8_0 with a float32 scale) and each group's dot product with the weights' codes is exact in int32; then
 * out += s d I + s P m in float32, per group in k order (P = sum p). vpdpbusd multiplies unsigned bytes (here the
 * weights' codes u: int4's 0..15 as they are, w = d u + m; Q8_0's q + 128, w = d u - 128 d) by signed ones (the
 * activations, each 4 bytes broadcast to every column; so a group's sum starts at 0).
 * The weights are packed once, when a model loads (tq_i8_pack, i8_pack.c), in panels of I8_PANEL weight rows: per block (int4:
 * a pair of groups, their codes in one byte's low and high nibble as in the rows; Q8_0: one group, codes + 128) the
 * codes as [8 steps][I8_PANEL columns][4 k] bytes, then the float16 scales per column (int4: d of both groups, m of
 * both; Q8_0: d). The same bytes as the rows, read in order by every row count: a decode step streams them once
 * (batch 1 ~2.5-3x the int16 kernel), a prompt chunk meets each panel from cache once per tile of I8_R rows. A
 * row's result does not depend on the other rows, nor on how many there are.
 * Decode steps and short chunks (`digits` 2) keep 15 bits of each activation, as two int8 digits: p = 128 h + l
 * (s = max |a| / 16383, h = floor(p / 128), l in 0..127), I = 128 (u . h) + u . l, twice the products of one digit
 * and still exact; int8 alone changed greedy outputs of the quality bench's chat prompts.
 * On aarch64 with the int8 dot product (ARMv8.2 dotprod) the same panels are multiplied by sdot, whose bytes are both
 * signed, 16 columns of 1-3 rows at a time in NEON's 32 registers of 4 lanes; the integer sums and the float
 * operations after them are the AVX-512 tile's, so are the bits (tests/test_native_aarch64.py, under qemu-user). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_VNNI 1
#elif defined(__ARM_FEATURE_DOTPROD)
#define I8_DOTPROD 1
#endif
#ifdef I8_DOTPROD /* 32 NEON registers of 4 lanes: fewer rows a tile */
#define I8_R 3
#define I8_R2 2
#else
#define I8_R 6  /* rows per tile, one digit */
#define I8_R2 4 /* two digits */
#endif
#define I8_L2_BYTES (512 * 1024) /* of a block of rows' activations (i8_block_rows) */
/* Decode tiles (two digits) ask for the panel bytes this far ahead: on an Ice Lake Xeon one core's stream reached
 * ~0.65x the read probe without it and a batch-1 step ran 1.10x faster with it (2 KB 1.09x, 8 KB slower); long
 * chunks (one digit) are compute-bound, and their tiles ran 0.78x with it. */
#define I8_AHEAD 4096


#if defined(I8_VNNI) || defined(I8_DOTPROD)
/* Activation rows [m, k] as int8 groups (see above): xq = p (one digit) or h, then l (two: xl), xs = s, xp = sum p,
 * xsp = s sum p; NEON gives AVX-512's values (to nearest, ties to even; the narrowing keeps the low bytes). */
static void rows_to_i8(const float *x, int64_t m, int64_t k, const int digits, int8_t *xq, int8_t *xl, float *xs,
                       float *xsp, int32_t *xp, int threads) {
    int64_t groups = k / Q8_GROUP;
    const float top = digits == 2 ? 16383.f : 127.f;
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k > 65536)
    for (int64_t rg = 0; rg < m * groups; rg++) {
#ifdef I8_VNNI
        __m512 v0 = _mm512_loadu_ps(x + rg * Q8_GROUP), v1 = _mm512_loadu_ps(x + rg * Q8_GROUP + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        __m512 inv = _mm512_set1_ps(amax > 0.f ? top / amax : 0.f);
        __m512i p0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), p1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        float s = amax / top;
        xs[rg] = s;
        xp[rg] = _mm512_reduce_add_epi32(_mm512_add_epi32(p0, p1));
        xsp[rg] = s * (float)xp[rg];
        if (digits == 2) {
            const __m512i seven = _mm512_set1_epi32(127);
            _mm_storeu_si128((__m128i *)(xl + rg * Q8_GROUP), _mm512_cvtepi32_epi8(_mm512_and_si512(p0, seven)));
            _mm_storeu_si128((__m128i *)(xl + rg * Q8_GROUP + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(p1, seven)));
            p0 = _mm512_srai_epi32(p0, 7);
            p1 = _mm512_srai_epi32(p1, 7);
        }
        _mm_storeu_si128((__m128i *)(xq + rg * Q8_GROUP), _mm512_cvtepi32_epi8(p0));
        _mm_storeu_si128((__m128i *)(xq + rg * Q8_GROUP + 16), _mm512_cvtepi32_epi8(p1));
#else
        float32x4_t v[8];
        for (int i = 0; i < 8; i++) v[i] = vld1q_f32(x + rg * Q8_GROUP + 4 * i);
        float32x4_t mx = vabsq_f32(v[0]);
        for (int i = 1; i < 8; i++) mx = vmaxq_f32(mx, vabsq_f32(v[i]));
        float amax = vmaxvq_f32(mx);
        float32x4_t inv = vdupq_n_f32(amax > 0.f ? top / amax : 0.f);
        int32x4_t p[8], sum = vdupq_n_s32(0);
        for (int i = 0; i < 8; i++) {
            p[i] = vcvtnq_s32_f32(vmulq_f32(v[i], inv));
            sum = vaddq_s32(sum, p[i]);
        }
        float s = amax / top;
        xs[rg] = s;
        xp[rg] = vaddvq_s32(sum);
        xsp[rg] = s * (float)xp[rg];
        for (int i = 0; i < 8; i += 2) { /* 8 values to 8 bytes (their low bytes, as the AVX-512 narrowing) */
            int32x4_t a = p[i], b = p[i + 1];
            if (digits == 2) {
                const int32x4_t seven = vdupq_n_s32(127);
                int16x8_t l = vcombine_s16(vmovn_s32(vandq_s32(a, seven)), vmovn_s32(vandq_s32(b, seven)));
                vst1_s8(xl + rg * Q8_GROUP + 4 * i, vmovn_s16(l));
                a = vshrq_n_s32(a, 7);
                b = vshrq_n_s32(b, 7);
            }
            vst1_s8(xq + rg * Q8_GROUP + 4 * i, vmovn_s16(vcombine_s16(vmovn_s32(a), vmovn_s32(b))));
        }
#endif
    }
}

#ifdef I8_VNNI
/* out[r * os + c] = sum over groups of s d I + s P m for R rows (<= I8_R, I8_R2 with two digits) and the I8_PANEL
 * columns of panel `wp`. The integer sums are exact in any order (one row of one digit takes two chains of vpdpbusd,
 * so their latency overlaps); the float operations are the same whatever R is. */
static inline __attribute__((always_inline)) void i8_tile(const int kind, const int D, const int R, const int8_t *xq,
                                                          const int8_t *xl, const float *xs, const float *xsp,
                                                          const int32_t *xp, int64_t k, const uint8_t *wp, float *out,
                                                          int64_t os) {
    (void)xp;
    int64_t groups = k / Q8_GROUP, bb = i8_block_bytes(kind);
    const __m512i low = _mm512_set1_epi8(0x0F), high_nibbles = _mm512_set1_epi8((char)0xF0);
    __m512 lo[I8_R], hi[I8_R];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int high = kind == KIND_Q4 && (g & 1); /* int4: the pair's second group, in the high nibbles */
        const uint8_t *blk = wp + (kind == KIND_Q4 ? g / 2 : g) * bb;
        __m512i ilo[I8_R], ihi[I8_R], jlo[I8_R], jhi[I8_R]; /* j: the second digit's sums, or a one-row tile's odd steps */
        for (int r = 0; r < R; r++) ilo[r] = ihi[r] = jlo[r] = jhi[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            if (D == 2 && !high) {
                _mm_prefetch((const char *)blk + s * I8_PANEL * 4 + I8_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)blk + s * I8_PANEL * 4 + 64 + I8_AHEAD, _MM_HINT_T0);
            }
            __m512i w0 = _mm512_loadu_si512(blk + s * I8_PANEL * 4), w1 = _mm512_loadu_si512(blk + s * I8_PANEL * 4 + 64);
            if (kind == KIND_Q4) { /* the high nibbles stay where they are: 16 u, one operation instead of two */
                w0 = _mm512_and_si512(w0, high ? high_nibbles : low);
                w1 = _mm512_and_si512(w1, high ? high_nibbles : low);
            }
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + r * k + g * Q8_GROUP + 4 * s, 4);
                __m512i a = _mm512_set1_epi32(four);
                if (D == 1 && R == 1 && (s & 1)) {
                    jlo[r] = _mm512_dpbusd_epi32(jlo[r], w0, a);
                    jhi[r] = _mm512_dpbusd_epi32(jhi[r], w1, a);
                } else {
                    ilo[r] = _mm512_dpbusd_epi32(ilo[r], w0, a);
                    ihi[r] = _mm512_dpbusd_epi32(ihi[r], w1, a);
                }
                if (D == 2) {
                    memcpy(&four, xl + r * k + g * Q8_GROUP + 4 * s, 4);
                    a = _mm512_set1_epi32(four);
                    jlo[r] = _mm512_dpbusd_epi32(jlo[r], w0, a);
                    jhi[r] = _mm512_dpbusd_epi32(jhi[r], w1, a);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            if (D == 2) {
                ilo[r] = _mm512_add_epi32(_mm512_slli_epi32(ilo[r], 7), jlo[r]);
                ihi[r] = _mm512_add_epi32(_mm512_slli_epi32(ihi[r], 7), jhi[r]);
            } else if (R == 1) {
                ilo[r] = _mm512_add_epi32(ilo[r], jlo[r]);
                ihi[r] = _mm512_add_epi32(ihi[r], jhi[r]);
            }
        }
        const uint16_t *sc = (const uint16_t *)(blk + I8_CODES) + (high ? I8_PANEL : 0);
        __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16)));
        __m512 m0, m1;
        if (kind == KIND_Q4) {
            m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 2 * I8_PANEL)));
            m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 2 * I8_PANEL + 16)));
        } else {
            m0 = _mm512_mul_ps(d0, _mm512_set1_ps(-128.f));
            m1 = _mm512_mul_ps(d1, _mm512_set1_ps(-128.f));
        }
        for (int r = 0; r < R; r++) { /* a high group's sums are 16 I (exact), so its s is s / 16: the same bits */
            __m512 s = _mm512_set1_ps(high ? xs[r * groups + g] * 0.0625f : xs[r * groups + g]);
            __m512 sp = _mm512_set1_ps(xsp[r * groups + g]);
            lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo[r]), _mm512_mul_ps(d0, s), _mm512_fmadd_ps(m0, sp, lo[r]));
            hi[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi[r]), _mm512_mul_ps(d1, s), _mm512_fmadd_ps(m1, sp, hi[r]));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out + r * os, lo[r]);
        _mm512_storeu_ps(out + r * os + 16, hi[r]);
    }
}

#elif defined(I8_DOTPROD)
/* i8_tile on NEON with the dot product (sdot: signed bytes by signed bytes, four columns of four k a register), 16
 * of the panel's columns at a time. The same integer sums and then the same float operations as the AVX-512 tile, so
 * the same bits: int4's high nibbles are shifted down (u, where AVX-512 keeps 16 u with s / 16: the same products),
 * and Q8_0's codes are flipped back to q and the 128 P of their offset added to the exact sum. */
static inline __attribute__((always_inline)) void i8_tile(const int kind, const int D, const int R, const int8_t *xq,
                                                          const int8_t *xl, const float *xs, const float *xsp,
                                                          const int32_t *xp, int64_t k, const uint8_t *wp, float *out,
                                                          int64_t os) {
    int64_t groups = k / Q8_GROUP, bb = i8_block_bytes(kind);
    for (int half = 0; half < 2; half++) {
        float32x4_t acc[I8_R][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = vdupq_n_f32(0.f);
        for (int64_t g = 0; g < groups; g++) {
            const int high = kind == KIND_Q4 && (g & 1); /* int4: the pair's second group, in the high nibbles */
            const uint8_t *blk = wp + (kind == KIND_Q4 ? g / 2 : g) * bb;
            int32x4_t ia[I8_R][4], ja[I8_R][4]; /* ja: the second digit's sums */
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 4; c++) ia[r][c] = ja[r][c] = vdupq_n_s32(0);
            for (int four = 0; four < 2; four++) { /* steps 0-3, then 4-7: one register of each row's digits */
                int8x16_t xa[I8_R], xb[I8_R];
                for (int r = 0; r < R; r++) {
                    xa[r] = vld1q_s8(xq + r * k + g * Q8_GROUP + 16 * four);
                    if (D == 2) xb[r] = vld1q_s8(xl + r * k + g * Q8_GROUP + 16 * four);
                }
#define I8_STEP(LANE)                                                                                                 \
    {                                                                                                                 \
        int8x16_t w[4];                                                                                               \
        for (int c = 0; c < 4; c++) {                                                                                 \
            uint8x16_t b = vld1q_u8(blk + (4 * four + LANE) * I8_PANEL * 4 + half * 64 + 16 * c);                     \
            if (kind == KIND_Q4)                                                                                      \
                b = high ? vshrq_n_u8(b, 4) : vandq_u8(b, vdupq_n_u8(0x0F));                                          \
            else                                                                                                      \
                b = veorq_u8(b, vdupq_n_u8(0x80));                                                                    \
            w[c] = vreinterpretq_s8_u8(b);                                                                            \
        }                                                                                                             \
        for (int r = 0; r < R; r++)                                                                                   \
            for (int c = 0; c < 4; c++) {                                                                             \
                ia[r][c] = vdotq_laneq_s32(ia[r][c], w[c], xa[r], LANE);                                              \
                if (D == 2) ja[r][c] = vdotq_laneq_s32(ja[r][c], w[c], xb[r], LANE);                                  \
            }                                                                                                         \
    }
                I8_STEP(0) I8_STEP(1) I8_STEP(2) I8_STEP(3)
#undef I8_STEP
            }
            const uint16_t *sc = (const uint16_t *)(blk + I8_CODES) + (high ? I8_PANEL : 0) + 16 * half;
            float32x4_t d[4], mo[4];
            for (int c = 0; c < 4; c++) {
                d[c] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sc + 4 * c)));
                mo[c] = kind == KIND_Q4 ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sc + 2 * I8_PANEL + 4 * c)))
                                        : vmulq_f32(d[c], vdupq_n_f32(-128.f));
            }
            for (int r = 0; r < R; r++) {
                float32x4_t s = vdupq_n_f32(xs[r * groups + g]), sp = vdupq_n_f32(xsp[r * groups + g]);
                for (int c = 0; c < 4; c++) {
                    int32x4_t sum = ia[r][c];
                    if (D == 2) sum = vaddq_s32(vshlq_n_s32(sum, 7), ja[r][c]);
                    if (kind == KIND_Q8) sum = vaddq_s32(sum, vdupq_n_s32(128 * xp[r * groups + g]));
                    acc[r][c] = vfmaq_f32(vfmaq_f32(acc[r][c], mo[c], sp), vcvtq_f32_s32(sum), vmulq_f32(d[c], s));
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) vst1q_f32(out + r * os + 16 * half + 4 * c, acc[r][c]);
    }
}
#endif

/* A tile of `rows` rows (1 up to the digits' tile height). */
static inline __attribute__((always_inline)) void i8_tile_rows(const int kind, const int D, int rows,
                                                               const int8_t *xq, const int8_t *xl, const float *xs,
                                                               const float *xsp, const int32_t *xp, int64_t k,
                                                               const uint8_t *wp, float *out, int64_t os) {
    switch (rows) {
#define I8_TILE(R) case R: i8_tile(kind, D, R, xq, xl, xs, xsp, xp, k, wp, out, os); return;
#ifdef I8_DOTPROD
    I8_TILE(1)
    default:
        if (D == 2) {
            i8_tile(kind, D, I8_R2, xq, xl, xs, xsp, xp, k, wp, out, os);
            return;
        }
        switch (rows) { I8_TILE(2) default: i8_tile(kind, 1, I8_R, xq, xl, xs, xsp, xp, k, wp, out, os); }
#else
    I8_TILE(1) I8_TILE(2) I8_TILE(3)
    default:
        if (D == 2) {
            i8_tile(kind, D, I8_R2, xq, xl, xs, xsp, xp, k, wp, out, os);
            return;
        }
        switch (rows) { I8_TILE(4) I8_TILE(5) default: i8_tile(kind, 1, I8_R, xq, xl, xs, xsp, xp, k, wp, out, os); }
#endif
#undef I8_TILE
    }
}

/* Rows a block of share_i8_panels holds: their int8 digits and scales stay in L2 (a prompt chunk of 2,000 rows that
 * met every panel whole read its activations from L3 for each: 0.73x the GOP/s of 256 rows). A multiple of both
 * tile heights, so every row's tiles are the same whatever the block. */
static inline int64_t i8_block_rows(int64_t k) {
    int64_t rows = (I8_L2_BYTES / (2 * k + k / Q8_GROUP * 8)) / (I8_R * I8_R2) * (I8_R * I8_R2);
    return rows < I8_R * I8_R2 ? I8_R * I8_R2 : rows;
}

/* This thread's panels (taken with share_next from `shares`, one set per block of i8_block_rows), each against the
 * block's rows. `kind` and D constants (see share_tiles). */
static inline __attribute__((always_inline)) void share_i8_panels(const int kind, const int D, const uint8_t *wp,
                                                                  int64_t n, int64_t k, const int8_t *xq,
                                                                  const int8_t *xl, const float *xs, const float *xsp,
                                                                  const int32_t *xp, int64_t m, float *out,
                                                                  float *spill, Share *shares, int threads) {
    int64_t panels = (n + I8_PANEL - 1) / I8_PANEL, groups = k / Q8_GROUP, rblock = i8_block_rows(k);
    int64_t panel_bytes = i8_blocks(kind, k) * i8_block_bytes(kind), chunk = share_chunk(panels, threads);
    const int height = D == 2 ? I8_R2 : I8_R;
    int tid = thread_num();
    for (int64_t r0 = 0; r0 < m; r0 += rblock) {
        int64_t r1 = r0 + rblock < m ? r0 + rblock : m;
        Share *sh = shares + r0 / rblock * threads;
        for (int64_t b, e; share_next(sh, threads, tid, chunk, &b, &e);)
        for (int64_t p = b; p < e; p++) {
            int64_t j = p * I8_PANEL;
            int cols = n - j < I8_PANEL ? (int)(n - j) : I8_PANEL;
            for (int64_t r = r0; r < r1; r += height) {
                int rows = r1 - r < height ? (int)(r1 - r) : height;
                float *o = tile_out(out, n, r, j, cols, I8_PANEL, spill);
                i8_tile_rows(kind, D, rows, xq + r * k, xl + r * k, xs + r * groups, xsp + r * groups,
                             xp + r * groups, k, wp + p * panel_bytes, o, cols == I8_PANEL ? n : I8_PANEL);
                unspill(out, n, r, j, rows, cols, I8_PANEL, spill);
            }
        }
    }
}

#define I8_SHARE(name, kind, D) \
    static void name(const uint8_t *wp, int64_t n, int64_t k, const int8_t *xq, const int8_t *xl, const float *xs, \
                     const float *xsp, const int32_t *xp, int64_t m, float *out, float *spill, Share *shares, \
                     int threads) { \
        share_i8_panels(kind, D, wp, n, k, xq, xl, xs, xsp, xp, m, out, spill, shares, threads); \
    }
I8_SHARE(share_i8_q4, KIND_Q4, 1)
I8_SHARE(share_i8_q8, KIND_Q8, 1)
I8_SHARE(share_i8x2_q4, KIND_Q4, 2)
I8_SHARE(share_i8x2_q8, KIND_Q8, 2)
#undef I8_SHARE
#endif

/* Which int8 dot product i8_matmul is compiled with: 1 AVX-512 VNNI, 2 NEON's (ARMv8.2 dotprod); 0 none. */
int tq_has_i8(void) {
#if defined(I8_VNNI)
    return 1;
#elif defined(I8_DOTPROD)
    return 2;
#else
    return 0;
#endif
}

/* out [m, n] = x [m, k] @ W.T for a weight tq_i8_pack packed (`kind` KIND_Q4 or KIND_Q8), x rounded per group of 32
 * to `digits` int8 digits (1: 8 bits, 2: 15): -1 without memory, -2 where the build has no int8 dot product. */
int tq_i8_matmul(int kind, const uint8_t *wp, int64_t n, int64_t k, const float *x, int64_t m, float *out, int digits,
                 int threads) {
#if defined(I8_VNNI) || defined(I8_DOTPROD)
    int64_t groups = k / Q8_GROUP, bytes = (m * k + 63) / 64 * 64;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)(2 * bytes));
    float *xs = (float *)malloc((size_t)(3 * m * groups) * sizeof(float)); /* xs, xsp, and xp (int32) */
    float *spill = (float *)aligned_alloc(64, (size_t)threads * I8_R * I8_PANEL * sizeof(float));
    Share *shares = shares_new((m + i8_block_rows(k) - 1) / i8_block_rows(k), threads, (n + I8_PANEL - 1) / I8_PANEL);
    if (!xq || !xs || !spill || !shares) {
        free(xq);
        free(xs);
        free(spill);
        free(shares);
        return -1;
    }
    int8_t *xl = xq + bytes;
    float *xsp = xs + m * groups;
    int32_t *xp = (int32_t *)(xs + 2 * m * groups);
    rows_to_i8(x, m, k, digits, xq, xl, xs, xsp, xp, threads);
    #pragma omp parallel num_threads(threads)
    {
        float *mine = spill + thread_num() * I8_R * I8_PANEL;
        if (digits == 2)
            (kind == KIND_Q4 ? share_i8x2_q4 : share_i8x2_q8)(wp, n, k, xq, xl, xs, xsp, xp, m, out, mine, shares,
                                                              threads);
        else
            (kind == KIND_Q4 ? share_i8_q4 : share_i8_q8)(wp, n, k, xq, xl, xs, xsp, xp, m, out, mine, shares,
                                                          threads);
    }
    free(shares);
    free(spill);
    free(xs);
    free(xq);
    return 0;
#else
    (void)kind, (void)wp, (void)n, (void)k, (void)x, (void)m, (void)out, (void)digits, (void)threads;
    return -2;
#endif
}
