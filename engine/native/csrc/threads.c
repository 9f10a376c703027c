/* The library's source hash, and how a matmul's threads share its work (ops.h says why). */
#include "ops.h"

#ifndef TQ_SOURCE_HASH
#define TQ_SOURCE_HASH "unknown"
#endif
/* What this library was built from (engine/native/build.py source_hash): the loader refuses a stale build. */
const char *tq_source_hash(void) { return TQ_SOURCE_HASH; }

/* `blocks` sets of `threads` ranges (one set per block of rows), each splitting `items` evenly; NULL without memory */
Share *shares_new(int64_t blocks, int threads, int64_t items) {
    Share *s = (Share *)aligned_alloc(64, (size_t)(blocks * threads) * sizeof(Share));
    if (s)
        for (int64_t i = 0; i < blocks * threads; i++) {
            int64_t t = i % threads;
            s[i].range = items * t / threads | (items * (t + 1) / threads) << 32;
        }
    return s;
}

/* The next chunk [*b, *e) for thread `tid` (up to `chunk` items): from the front of its own range, else from the back
 * of another's; 0 when every range is empty. Each item is taken once, by whichever thread gets there first. */
int share_next(Share *s, int threads, int tid, int64_t chunk, int64_t *b, int64_t *e) {
    for (int i = 0; i < threads; i++) {
        Share *o = s + (tid + i) % threads;
        int64_t old = __atomic_load_n(&o->range, __ATOMIC_RELAXED);
        for (;;) {
            int64_t lo = old & 0xffffffff, hi = (int64_t)((uint64_t)old >> 32);
            if (lo >= hi) break;
            int64_t n = hi - lo < chunk ? hi - lo : chunk;
            int64_t next = i == 0 ? (lo + n) | hi << 32 : lo | (hi - n) << 32;
            if (__atomic_compare_exchange_n(&o->range, &old, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *b = i == 0 ? lo : hi - n;
                *e = *b + n;
                return 1;
            }
        }
    }
    return 0;
}
