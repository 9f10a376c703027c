#include "ops.h"

/* ---------------------------------------------------------------- many rows: float32 panels
 * With many rows a matmul is compute-bound, and there the int16 kernel (int16_kernels.c) is no faster than float32: its
 * two vpmaddwd, convert and FMA per row and group of 32 take the same two vector pipes as four float32 FMAs.
 * So from PANEL_MIN_ROWS rows on, each panel of PANEL weight rows is dequantized once (w = d q + m, as
 * tq_int4_dequant) into float32 [k][PANEL] in this thread's scratch, and multiplied by PANEL_R x PANEL
 * register tiles of FMAs (an activation broadcast against two vectors of the panel). An output's sum runs
 * over k in the same order in every tile: a row computes the same in any batch of PANEL_MIN_ROWS rows or
 * more, as it does in any batch of fewer. The crossovers were measured on a 2-core AMD EPYC (AVX2): int4
 * from 16 rows; Q8_0, whose int16 kernel has no nibbles to unpack, from 32. */
#define PANEL 16
#define PANEL_R 6

#ifdef __AVX2__
/* In: r[c] = 32 bytes of weight row c. Out: r[i] = byte i of the 16 rows in its low 128 bits, byte 16 + i in
 * its high 128 bits (four rounds of interleaving rows c and c + 8 transpose 16 x 16 bytes, in each half). */
static inline void transpose_bytes(__m256i r[PANEL]) {
    for (int round = 0; round < 4; round++) {
        __m256i t[PANEL];
        for (int c = 0; c < PANEL / 2; c++) {
            t[2 * c] = _mm256_unpacklo_epi8(r[c], r[c + PANEL / 2]);
            t[2 * c + 1] = _mm256_unpackhi_epi8(r[c], r[c + PANEL / 2]);
        }
        for (int c = 0; c < PANEL; c++) r[c] = t[c];
    }
}

/* 16 codes (one per panel row, unsigned int4 or signed int8) of one k as floats d q + m into panel row o. */
static inline __attribute__((always_inline)) void panel_codes(const int kind, __m128i b, const float *d,
                                                              const float *m, float *o) {
    for (int h = 0; h < 2; h++) {
        __m128i part = h ? _mm_srli_si128(b, 8) : b;
        __m256 q = _mm256_cvtepi32_ps(kind == KIND_Q4 ? _mm256_cvtepu8_epi32(part) : _mm256_cvtepi8_epi32(part));
        _mm256_storeu_ps(o + 8 * h, kind == KIND_Q4 ? _mm256_fmadd_ps(q, _mm256_loadu_ps(d + 8 * h),
                                                                      _mm256_loadu_ps(m + 8 * h))
                                                    : _mm256_mul_ps(q, _mm256_loadu_ps(d + 8 * h)));
    }
}

/* The 32-byte runs at group g of weight rows [j, j + PANEL) (an int4 group pair, or a Q8_0 group; zeros past n),
 * transposed as bytes, and their groups' scales d and (int4) offsets m as floats, one per row. */
static inline __attribute__((always_inline)) void load_runs(const int kind, const void *w, const uint16_t *scales,
                                                            int64_t n, int64_t k, int64_t j, int64_t g,
                                                            __m256i r[PANEL], float d[2][PANEL], float m[2][PANEL]) {
    int64_t groups = k / Q8_GROUP, row_bytes = kind == KIND_Q4 ? k / 2 : k;
    int64_t scale_stride = kind == KIND_Q4 ? 2 * groups : groups;
    int step = kind == KIND_Q4 ? 2 : 1; /* groups per 32-byte run */
    for (int c = 0; c < PANEL; c++) {
        int live = j + c < n;
        const uint8_t *run = (const uint8_t *)w + (j + c) * row_bytes + g * Q8_GROUP / step;
        r[c] = live ? _mm256_loadu_si256((const __m256i *)run) : _mm256_setzero_si256();
        const uint16_t *sc = scales + (j + c) * scale_stride;
        for (int s = 0; s < step; s++) {
            d[s][c] = live ? half_to_float(sc[g + s]) : 0.f;
            m[s][c] = live && kind == KIND_Q4 ? half_to_float(sc[groups + g + s]) : 0.f;
        }
    }
    transpose_bytes(r);
}

/* Weight rows [j, j + PANEL) (zeros past n) as panel[i * PANEL + c] = w[j + c, i]: each 32-byte run of the
 * 16 rows (an int4 group pair, or a Q8_0 group) transposed as bytes, then widened to floats 16 at a time. */
static inline __attribute__((always_inline)) void dequant_panel(const int kind, const void *w,
                                                                const uint16_t *scales, int64_t n, int64_t k,
                                                                int64_t j, float *panel) {
    int64_t groups = k / Q8_GROUP;
    for (int64_t g = 0; g < groups; g += kind == KIND_Q4 ? 2 : 1) {
        __m256i r[PANEL];
        float d[2][PANEL], m[2][PANEL];
        load_runs(kind, w, scales, n, k, j, g, r, d, m);
        for (int i = 0; i < 16; i++) {
            __m128i lo = _mm256_castsi256_si128(r[i]), hi = _mm256_extracti128_si256(r[i], 1);
            float *o = panel + (g * Q8_GROUP + i) * PANEL;
            if (kind == KIND_Q4) {
                const __m128i low = _mm_set1_epi8(0x0F);
                panel_codes(kind, _mm_and_si128(lo, low), d[0], m[0], o);
                panel_codes(kind, _mm_and_si128(hi, low), d[0], m[0], o + 16 * PANEL);
                panel_codes(kind, _mm_and_si128(_mm_srli_epi16(lo, 4), low), d[1], m[1], o + 32 * PANEL);
                panel_codes(kind, _mm_and_si128(_mm_srli_epi16(hi, 4), low), d[1], m[1], o + 48 * PANEL);
            } else {
                panel_codes(kind, lo, d[0], m[0], o);
                panel_codes(kind, hi, d[0], m[0], o + 16 * PANEL);
            }
        }
    }
}

/* out[r * os + c] = sum_i x[r * k + i] panel[i * PANEL + c] for R rows and the first `cols` columns. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t k, const float *panel,
                                                             const int R, int cols, float *out, int64_t os) {
    __m256 lo[PANEL_R], hi[PANEL_R];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 b0 = _mm256_loadu_ps(panel + i * PANEL), b1 = _mm256_loadu_ps(panel + i * PANEL + 8);
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * k + i);
            lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
            hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (cols == PANEL) {
            _mm256_storeu_ps(out + r * os, lo[r]);
            _mm256_storeu_ps(out + r * os + 8, hi[r]);
        } else {
            float t[PANEL];
            _mm256_storeu_ps(t, lo[r]);
            _mm256_storeu_ps(t + 8, hi[r]);
            memcpy(out + r * os, t, (size_t)cols * sizeof(float));
        }
    }
}

/* Rows a block of share_panels holds (their activations stay in L2). */
static inline int64_t panel_rows(int64_t k) {
    int64_t rblock = (65536 / k) / PANEL_R * PANEL_R;
    return rblock < PANEL_R ? PANEL_R : rblock;
}

/* This thread's panels, taken with share_next from `shares` (one set per block of panel_rows); `kind` a
 * constant, as in share_tiles. panel: this thread's PANEL k floats. */
static inline __attribute__((always_inline)) void share_panels(const int kind, const void *w,
                                                               const uint16_t *scales, int64_t n, int64_t k,
                                                               const float *x, int64_t m, float *out,
                                                               float *panel, Share *shares, int threads) {
    int64_t rblock = panel_rows(k), panels = (n + PANEL - 1) / PANEL, chunk = share_chunk(panels, threads);
    int tid = thread_num();
    for (int64_t r0 = 0; r0 < m; r0 += rblock) {
        int64_t r1 = r0 + rblock < m ? r0 + rblock : m;
        Share *sh = shares + r0 / rblock * threads;
        for (int64_t b, e; share_next(sh, threads, tid, chunk, &b, &e);)
        for (int64_t j = b * PANEL; j < e * PANEL && j < n; j += PANEL) {
            int cols = n - j < PANEL ? (int)(n - j) : PANEL;
            dequant_panel(kind, w, scales, n, k, j, panel);
            int64_t r = r0;
            for (; r + PANEL_R <= r1; r += PANEL_R) panel_tile(x + r * k, k, panel, PANEL_R, cols, out + r * n + j, n);
            const float *xr = x + r * k;
            float *o = out + r * n + j;
            switch (r1 - r) {
            case 1: panel_tile(xr, k, panel, 1, cols, o, n); break;
            case 2: panel_tile(xr, k, panel, 2, cols, o, n); break;
            case 3: panel_tile(xr, k, panel, 3, cols, o, n); break;
            case 4: panel_tile(xr, k, panel, 4, cols, o, n); break;
            case 5: panel_tile(xr, k, panel, 5, cols, o, n); break;
            default: break;
            }
        }
    }
}

static void share_panels_q4(const void *w, const uint16_t *s, int64_t n, int64_t k, const float *x, int64_t m,
                            float *out, float *panel, Share *shares, int threads) {
    share_panels(KIND_Q4, w, s, n, k, x, m, out, panel, shares, threads);
}
static void share_panels_q8(const void *w, const uint16_t *s, int64_t n, int64_t k, const float *x, int64_t m,
                            float *out, float *panel, Share *shares, int threads) {
    share_panels(KIND_Q8, w, s, n, k, x, m, out, panel, shares, threads);
}

int panel_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                        int64_t m, float *out, int threads) {
    int64_t per_thread = PANEL * k; /* floats; a multiple of 16, so each thread's panel starts a cache line */
    float *scratch = (float *)aligned_alloc(64, (size_t)(threads * per_thread) * sizeof(float));
    Share *shares = shares_new((m + panel_rows(k) - 1) / panel_rows(k), threads, (n + PANEL - 1) / PANEL);
    if (!scratch || !shares) {
        free(scratch);
        free(shares);
        return -1;
    }
    #pragma omp parallel num_threads(threads)
    {
        int tid = thread_num();
        if (kind == KIND_Q4)
            share_panels_q4(w, scales, n, k, x, m, out, scratch + tid * per_thread, shares, threads);
        else
            share_panels_q8(w, scales, n, k, x, m, out, scratch + tid * per_thread, shares, threads);
    }
    free(shares);
    free(scratch);
    return 0;
}
#endif

/* ---------------------------------------------------------------- many rows: bfloat16 panels
 * Where the CPU has AVX-512 BF16, vdpbf16ps does 32 multiply-adds where a float32 FMA does 16 (measured on a
 * 2-core AMD EPYC: torch's bf16 GEMM 2.3x its float32 one). The activations are rounded to bfloat16 once per
 * matmul, each panel of BF_PANEL weight rows is widened to the floats of the float32 panels above and rounded
 * straight to bfloat16 pairs bp[(i * BF_PANEL + c) * 2 + e] = w[j + c, 2 i + e], and BF_R x BF_PANEL tiles
 * (fewer rows at a chunk's end) accumulate in float32. Both
 * roundings are to nearest even (2^-9 relative); the sums run over k in one order in every tile, so a row's
 * result does not depend on the other rows. Only long prompt chunks take it (engine/quant.py): there the
 * perplexity moved x1.0005, where every matmul of 16 rows or more on it (decode batches, short prompts)
 * changed 2 of the quality bench's 20 greedy answers. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF_PANEL 32
#define BF_R 12


/* 16 codes (one per panel column, unsigned int4 or signed int8) as floats d q + m: the float32 panels' values. */
static inline __attribute__((always_inline)) __m512 codes16(const int kind, __m128i b, __m512 d, __m512 m) {
    __m512 q = _mm512_cvtepi32_ps(kind == KIND_Q4 ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
    return kind == KIND_Q4 ? _mm512_fmadd_ps(q, d, m) : _mm512_mul_ps(q, d);
}

/* Weight rows [j, j + BF_PANEL) (zeros past n) as the bfloat16 pair panel bp[(i * BF_PANEL + c) * 2 + e] =
 * w[j + c, 2 i + e]: each 16-row half's 32-byte runs transposed as bytes (as dequant_panel), two neighbouring k
 * widened to the same floats as the float32 panels hold and rounded to bfloat16 pairs, with no float32 panel
 * written and read back between. */
static inline __attribute__((always_inline)) void dequant_bf16_panel(const int kind, const void *w,
                                                                     const uint16_t *scales, int64_t n, int64_t k,
                                                                     int64_t j, uint16_t *bp) {
    const __m128i low = _mm_set1_epi8(0x0F);
    int64_t groups = k / Q8_GROUP;
    for (int h = 0; h < 2; h++) {
        for (int64_t g = 0; g < groups; g += kind == KIND_Q4 ? 2 : 1) {
            __m256i r[PANEL];
            float d[2][PANEL], m[2][PANEL];
            load_runs(kind, w, scales, n, k, j + h * PANEL, g, r, d, m);
            __m512 d0 = _mm512_loadu_ps(d[0]), m0 = _mm512_loadu_ps(m[0]);
            __m512 d1 = _mm512_loadu_ps(d[1]), m1 = _mm512_loadu_ps(m[1]);
            for (int i = 0; i < 16; i += 2) { /* elements i, i + 1 of the run: one pair of k */
                __m128i lo[2] = {_mm256_castsi256_si128(r[i]), _mm256_castsi256_si128(r[i + 1])};
                __m128i hi[2] = {_mm256_extracti128_si256(r[i], 1), _mm256_extracti128_si256(r[i + 1], 1)};
                __m512 f[4][2]; /* [which k of the run][even, odd] */
                int parts = kind == KIND_Q4 ? 4 : 2;
                for (int e = 0; e < 2; e++) {
                    if (kind == KIND_Q4) {
                        f[0][e] = codes16(kind, _mm_and_si128(lo[e], low), d0, m0);
                        f[1][e] = codes16(kind, _mm_and_si128(hi[e], low), d0, m0);
                        f[2][e] = codes16(kind, _mm_and_si128(_mm_srli_epi16(lo[e], 4), low), d1, m1);
                        f[3][e] = codes16(kind, _mm_and_si128(_mm_srli_epi16(hi[e], 4), low), d1, m1);
                    } else {
                        f[0][e] = codes16(kind, lo[e], d0, m0);
                        f[1][e] = codes16(kind, hi[e], d0, m0);
                    }
                }
                for (int p = 0; p < parts; p++) {
                    int64_t at = g * Q8_GROUP + 16 * p + i; /* the even k */
                    _mm512_storeu_si512(bp + ((at / 2) * BF_PANEL + 16 * h) * 2, bf16_pairs(f[p][0], f[p][1]));
                }
            }
        }
    }
}

/* out[r * os + c] = sum_i x16[r, i] w[c, i] for R <= BF_R rows (x16 bfloat16 [R, k]) and 32 columns. A row's
 * sums are the same operations whatever R is. */
static inline __attribute__((always_inline)) void bf16_tile(const int R, const uint16_t *x16, int64_t k,
                                                            const uint16_t *bp, float *out, int64_t os) {
    __m512 lo[BF_R], hi[BF_R];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k / 2; i++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + i * 2 * BF_PANEL);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + i * 2 * BF_PANEL + BF_PANEL);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x16 + r * k + 2 * i, 4);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            lo[r] = _mm512_dpbf16_ps(lo[r], a, b0);
            hi[r] = _mm512_dpbf16_ps(hi[r], a, b1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out + r * os, lo[r]);
        _mm512_storeu_ps(out + r * os + 16, hi[r]);
    }
}

/* bf16_tile for any 1 <= rows <= BF_R, each height compiled on its own: a prompt of 256 rows is 21 tiles of 12 and
 * one of 4, not 22 of 12 (padding rows cost 6% of the matmul there). */
static void bf16_tile_rows(int rows, const uint16_t *x16, int64_t k, const uint16_t *bp, float *out, int64_t os) {
    switch (rows) {
#define BF_TILE(R) case R: bf16_tile(R, x16, k, bp, out, os); return;
    BF_TILE(1) BF_TILE(2) BF_TILE(3) BF_TILE(4) BF_TILE(5) BF_TILE(6)
    BF_TILE(7) BF_TILE(8) BF_TILE(9) BF_TILE(10) BF_TILE(11)
#undef BF_TILE
    default: bf16_tile(BF_R, x16, k, bp, out, os);
    }
}

/* float32 rows [m, k] to bfloat16 (round to nearest even). */
static void rows_to_bf16(const float *x, int64_t m, int64_t k, uint16_t *x16, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < k; i += 32) {
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * k + i + 16), _mm512_loadu_ps(x + r * k + i));
            _mm512_storeu_si512(x16 + r * k + i, (__m512i)v);
        }
    }
}



static inline __attribute__((always_inline)) void share_bf16_panels(const int kind, const void *w,
                                                                    const uint16_t *scales, int64_t n, int64_t k,
                                                                    const uint16_t *x16, int64_t m, float *out,
                                                                    uint16_t *bp, float *spill, Share *shares,
                                                                    int threads) {
    /* each panel is dequantized once and meets every row (rows in blocks that stayed in L2 dequantized it once a
     * block: 0.83-0.88x at 256 rows, measured on the model's four shapes) */
    int64_t chunk = share_chunk((n + BF_PANEL - 1) / BF_PANEL, threads);
    int tid = thread_num();
    for (int64_t b, e; share_next(shares, threads, tid, chunk, &b, &e);)
    for (int64_t j = b * BF_PANEL; j < e * BF_PANEL && j < n; j += BF_PANEL) {
        int cols = n - j < BF_PANEL ? (int)(n - j) : BF_PANEL;
        dequant_bf16_panel(kind, w, scales, n, k, j, bp);
        for (int64_t r = 0; r < m; r += BF_R) {
            int rows = m - r < BF_R ? (int)(m - r) : BF_R;
            float *o = tile_out(out, n, r, j, cols, BF_PANEL, spill);
            int64_t os = cols == BF_PANEL ? n : BF_PANEL;
            if (rows == BF_R)
                bf16_tile(BF_R, x16 + r * k, k, bp, o, os);
            else
                bf16_tile_rows(rows, x16 + r * k, k, bp, o, os);
            unspill(out, n, r, j, rows, cols, BF_PANEL, spill);
        }
    }
}

static void share_bf16_panels_q4(const void *w, const uint16_t *s, int64_t n, int64_t k, const uint16_t *x16,
                                 int64_t m, float *out, uint16_t *bp, float *spill, Share *shares, int threads) {
    share_bf16_panels(KIND_Q4, w, s, n, k, x16, m, out, bp, spill, shares, threads);
}
static void share_bf16_panels_q8(const void *w, const uint16_t *s, int64_t n, int64_t k, const uint16_t *x16,
                                 int64_t m, float *out, uint16_t *bp, float *spill, Share *shares, int threads) {
    share_bf16_panels(KIND_Q8, w, s, n, k, x16, m, out, bp, spill, shares, threads);
}

static int bf16_panel_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                             int64_t m, float *out, int threads) {
    /* per thread: a bfloat16 pair panel, a spill tile (both multiples of 64 bytes) */
    int64_t per_thread = BF_PANEL * k * 2 + BF_R * BF_PANEL * 4;
    uint16_t *x16 = (uint16_t *)aligned_alloc(64, (size_t)(m * k) * sizeof(uint16_t));
    char *scratch = (char *)aligned_alloc(64, (size_t)(threads * per_thread));
    Share *shares = shares_new(1, threads, (n + BF_PANEL - 1) / BF_PANEL);
    if (!x16 || !scratch || !shares) {
        free(x16);
        free(scratch);
        free(shares);
        return -1;
    }
    rows_to_bf16(x, m, k, x16, threads);
    #pragma omp parallel num_threads(threads)
    {
        int tid = thread_num();
        char *mine = scratch + tid * per_thread;
        uint16_t *bp = (uint16_t *)mine;
        float *spill = (float *)(mine + BF_PANEL * k * 2);
        if (kind == KIND_Q4)
            share_bf16_panels_q4(w, scales, n, k, x16, m, out, bp, spill, shares, threads);
        else
            share_bf16_panels_q8(w, scales, n, k, x16, m, out, bp, spill, shares, threads);
    }
    free(shares);
    free(scratch);
    free(x16);
    return 0;
}
#endif

/* 1 where bf16_matmul is compiled (AVX-512 BF16), else 0. */
int tq_has_bf16(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* out [m, n] = x [m, k] @ W.T on bfloat16 panels (kind KIND_Q4 or KIND_Q8): -1 without memory, -2 where the
 * build has no AVX-512 BF16. For long prompt chunks, where it beats dequantize + float32 GEMM. */
int tq_bf16_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                   int64_t m, float *out, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return bf16_panel_matmul(kind, w, scales, n, k, x, m, out, threads);
#else
    (void)kind, (void)w, (void)scales, (void)n, (void)k, (void)x, (void)m, (void)out, (void)threads;
    return -2;
#endif
}

/* ---------------------------------------------------------------- int4 weights to float32
 * Rows [start, stop) of the int4 layout (int16_kernels.c) as float32 (w = d q + m), one pass, for the prefill's
 * dequantize + GEMM path. */
void tq_int4_dequant(const uint8_t *qs, const uint16_t *dm, int64_t k, int64_t start, int64_t stop, float *out,
                     int threads) {
    int64_t groups = k / Q8_GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = start; j < stop; j++) {
        const uint8_t *b = qs + j * (k / 2);
        const uint16_t *d16 = dm + j * 2 * groups, *m16 = d16 + groups;
        float *o = out + (j - start) * k;
        for (int64_t p = 0; p < groups / 2; p++) {
            float da = half_to_float(d16[2 * p]), ma = half_to_float(m16[2 * p]);
            float db = half_to_float(d16[2 * p + 1]), mb = half_to_float(m16[2 * p + 1]);
            for (int i = 0; i < 32; i++) {
                o[p * 64 + i] = (float)(b[p * 32 + i] & 15) * da + ma;
                o[p * 64 + 32 + i] = (float)(b[p * 32 + i] >> 4) * db + mb;
            }
        }
    }
}
