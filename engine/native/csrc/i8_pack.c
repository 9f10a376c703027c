/* The int8 kernels' weights packed once, when a model loads, in the panel layout i8_panels.c describes. Plain C: any
 * build can pack (only VNNI or the ARM dot product multiplies them). */
#include "ops.h"

/* Bytes tq_i8_pack writes for an [n, k] weight of `kind`. */
int64_t tq_i8_packed_bytes(int kind, int64_t n, int64_t k) {
    return (n + I8_PANEL - 1) / I8_PANEL * i8_blocks(kind, k) * i8_block_bytes(kind);
}

/* The weight rows (int4 codes [n, k / 2] with (d, m) [n, 2, k / 32], or Q8_0 [n, k] with d [n, k / 32]) in the layout
 * of i8_panels.c; rows past n are zero codes with zero scales. Plain C: any build can pack (only VNNI multiplies). */
void tq_i8_pack(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, uint8_t *out, int threads) {
    int64_t groups = k / Q8_GROUP, blocks = i8_blocks(kind, k), bb = i8_block_bytes(kind);
    int64_t row_bytes = kind == KIND_Q4 ? k / 2 : k, scale_stride = kind == KIND_Q4 ? 2 * groups : groups;
    int64_t panels = (n + I8_PANEL - 1) / I8_PANEL;
    const uint32_t flip = kind == KIND_Q4 ? 0u : 0x80808080u;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pb = 0; pb < panels * blocks; pb++) {
        int64_t p = pb / blocks, b = pb % blocks;
        uint8_t *blk = out + pb * bb;
        uint16_t *sc = (uint16_t *)(blk + I8_CODES);
        for (int c = 0; c < I8_PANEL; c++) {
            int64_t j = p * I8_PANEL + c;
            int live = j < n;
            const uint8_t *run = (const uint8_t *)w + j * row_bytes + b * 32;
            for (int s = 0; s < 8; s++) {
                uint32_t four = 0;
                if (live) {
                    memcpy(&four, run + 4 * s, 4);
                    four ^= flip;
                }
                memcpy(blk + (s * I8_PANEL + c) * 4, &four, 4);
            }
            const uint16_t *row = scales + (live ? j : 0) * scale_stride;
            if (kind == KIND_Q4) {
                for (int q = 0; q < 2; q++) {
                    sc[q * I8_PANEL + c] = live ? row[2 * b + q] : 0;
                    sc[(2 + q) * I8_PANEL + c] = live ? row[groups + 2 * b + q] : 0;
                }
            } else {
                sc[c] = live ? row[b] : 0;
            }
        }
    }
}
