/* The survivor filter and count of one score block, fused into one pass.
 *
 * docs/simulator.md, "The fused survivor kernel".  For every score S[r, c] at or above its
 * query's lowest threshold edge (a "survivor"), locate it among its query's merged
 * thresholds (float32 edges lo/hi, sorted per query), add it to one histogram
 * [segment, bucket] per counted segmentation, and keep it as a near-tie when a threshold's
 * error band holds it.  The same decisions as MergedThresholds.locate on its per-query
 * tables (raycompat/backfill/thresholds.py), read once per score instead of four times.
 */
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define CHUNK 16

/* bit k set iff x[k] >= t, k < 16 */
static inline uint32_t chunk_mask(const float *x, float t) {
#if defined(__SSE2__)
    const __m128 tv = _mm_set1_ps(t);
    uint32_t m = (uint32_t)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(x), tv));
    m |= (uint32_t)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(x + 4), tv)) << 4;
    m |= (uint32_t)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(x + 8), tv)) << 8;
    m |= (uint32_t)_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(x + 12), tv)) << 12;
    return m;
#else
    uint32_t m = 0;
    for (int k = 0; k < CHUNK; k++) m |= (uint32_t)(x[k] >= t) << k;
    return m;
#endif
}

/* number of edges e[0:n] (sorted) with e[i] < v (strict = 1) or e[i] <= v (strict = 0) */
static inline int64_t count_below(const float *e, int64_t n, float v, int strict) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = (lo + hi) >> 1;
        int below = strict ? (e[mid] < v) : (e[mid] <= v);
        if (below) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* Returns the number of survivors; *n_band the near-ties (all of them, even past band_cap:
 * the caller then reruns with a larger buffer and acc = NULL).  seg[s] points at the
 * segment of each block column in counted segmentation s; acc (int64) is the worker's
 * histogram accumulator, NULL to record the near-ties only. */
int64_t survivor_count(
    const float *S, int64_t R, int64_t B, int64_t ld, int64_t q0,
    const float *lo_min, const int64_t *off, const float *lo, const float *hi,
    int64_t n_seg, const int64_t *const *seg, const int64_t *base, int64_t width,
    int64_t *acc,
    int64_t band_cap, int64_t *band_col, float *band_val, int64_t *band_hi, int64_t *band_lo,
    int64_t *n_band)
{
    int64_t survivors = 0, nb = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t q = q0 + r;
        const float t = lo_min[q];
        const float *row = S + r * ld;
        const int64_t first = off[q], cnt = off[q + 1] - off[q];
        const float *qhi = hi + first, *qlo = lo + first;
        const int64_t bucket0 = first + q;
        if (cnt == 0) continue; /* no thresholds: nothing survives */
        for (int64_t c = 0; c < B; c += CHUNK) {
            uint32_t mask;
            if (c + CHUNK <= B) {
                mask = chunk_mask(row + c, t);
            } else {
                mask = 0;
                for (int64_t k = 0; c + k < B; k++) mask |= (uint32_t)(row[c + k] >= t) << k;
            }
            while (mask) {
                const int64_t j = c + __builtin_ctz(mask);
                mask &= mask - 1;
                const float v = row[j];
                survivors++;
                const int64_t b = count_below(qhi, cnt, v, 1);
                if (acc) {
                    for (int64_t s = 0; s < n_seg; s++)
                        acc[seg[s][j] * width + base[s] + bucket0 + b]++;
                }
                if (b < cnt && qlo[b] <= v) {  /* the next threshold's band holds v */
                    if (nb < band_cap) {
                        band_col[nb] = j;
                        band_val[nb] = v;
                        band_hi[nb] = first + b;
                        band_lo[nb] = first + count_below(qlo, cnt, v, 0);
                    }
                    nb++;
                }
            }
        }
    }
    *n_band = nb;
    return survivors;
}
