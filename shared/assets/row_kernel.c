/* A few rows times a float32 weight as a model stores it, on a CPU: out (b, v) = x (b, h) @
 * w (v, h)^T, reading w once for up to 16 rows. The decode head and the decode body's
 * products for a batch of rows.
 *
 * BLAS has no product for this shape that reads the weight only once: sgemv reads it once
 * per row, and OpenBLAS's sgemm packs the whole 116 MB head of a 152k-token vocabulary on
 * every call (8-13 ms for 1-16 rows on the 2-core Zen 4 EPYC, against 4-7 ms here; see
 * docs/PERFORMANCE.md, "The decode step in C").
 *
 * The rows come transposed and padded: xt is (h, lanes), lanes 4, 8 or 16, with zeros past
 * row b. Each weight element is broadcast against a vector of the rows (no horizontal sums),
 * eight weight rows at a time, and the weight two tiles ahead is prefetched: without it one
 * core read the weight at about half the speed.
 *
 * Built on demand by runner/row_kernel.py with the system C compiler. On x86-64 GCC makes a
 * clone of the entry point for AVX-512, AVX2 with FMA, and the baseline, and picks one for
 * the CPU it runs on when the library loads, so the same file is safe on every x86-64 CPU;
 * elsewhere (or where the compiler has no clones, MLXR_NO_CLONES) it is plain C. GCC's vector
 * extensions become whatever vectors the target has. */
#include <stddef.h>

typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define TILE 8 /* weight rows a pass over the rows' vectors */
#define AHEAD 2 /* tiles prefetched ahead */

#define KERNEL(NAME, VEC, LANES)                                                             \
    static inline __attribute__((always_inline)) void NAME(                                  \
        const float *w, long h, const float *xt, float *out, long v, int b, long j0,          \
        long j1)                                                                              \
    {                                                                                         \
        long j = j0;                                                                          \
        for (; j + TILE <= j1; j += TILE) {                                                   \
            const float *r = w + (size_t)j * h;                                               \
            const float *next = r + (size_t)AHEAD * TILE * h;                                 \
            VEC a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0},         \
                a7 = {0};                                                                     \
            for (long k = 0; k < h; k++) {                                                    \
                /* a tile is TILE * h floats: one 64-byte line every other k covers it */     \
                if (!(k & 1) && j + (AHEAD + 1) * TILE <= j1)                                 \
                    __builtin_prefetch(next + (k >> 1) * 16);                                 \
                VEC x = *(const VEC *)(xt + (size_t)k * LANES);                               \
                a0 += r[k] * x;                                                               \
                a1 += r[h + k] * x;                                                           \
                a2 += r[2 * h + k] * x;                                                       \
                a3 += r[3 * h + k] * x;                                                       \
                a4 += r[4 * h + k] * x;                                                       \
                a5 += r[5 * h + k] * x;                                                       \
                a6 += r[6 * h + k] * x;                                                       \
                a7 += r[7 * h + k] * x;                                                       \
            }                                                                                 \
            VEC acc[TILE] = {a0, a1, a2, a3, a4, a5, a6, a7};                                 \
            for (int c = 0; c < b; c++) {                                                     \
                float *o = out + (size_t)c * v + j;                                           \
                for (int t = 0; t < TILE; t++)                                                \
                    o[t] = acc[t][c];                                                         \
            }                                                                                 \
        }                                                                                     \
        for (; j < j1; j++) {                                                                 \
            const float *r = w + (size_t)j * h;                                               \
            VEC a = {0};                                                                      \
            for (long k = 0; k < h; k++)                                                      \
                a += r[k] * *(const VEC *)(xt + (size_t)k * LANES);                           \
            for (int c = 0; c < b; c++)                                                       \
                out[(size_t)c * v + j] = a[c];                                                \
        }                                                                                     \
    }

KERNEL(rows4, v4, 4)
KERNEL(rows8, v8, 8)
KERNEL(rows16, v16, 16)
/* 16 rows where a vector register holds fewer than 16 floats (AVX2, NEON): GCC's code for
 * rows16's 64-byte vectors ran at 1.5 GB/s there, where rows8 runs at 12-14 (2-core Zen 3).
 * Here each weight row's 16 sums are two 8-float halves, four weight rows a step (8
 * accumulators, 2 for the rows' values: they fit in AVX2's 16 registers). */
static inline __attribute__((always_inline)) void rows16_halves(
    const float *w, long h, const float *xt, float *out, long v, int b, long j0, long j1)
{
    long j = j0;
    for (; j + 4 <= j1; j += 4) {
        const float *r = w + (size_t)j * h;
        const float *next = r + (size_t)AHEAD * TILE * h;
        v8 a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
        for (long k = 0; k < h; k++) {
            /* 4 rows of h floats: one 64-byte line every fourth k covers them */
            if (!(k & 3) && j + 4 + AHEAD * TILE <= j1)
                __builtin_prefetch(next + k);
            v8 lo = *(const v8 *)(xt + (size_t)k * 16), hi = *(const v8 *)(xt + (size_t)k * 16 + 8);
            float w0 = r[k], w1 = r[h + k], w2 = r[2 * h + k], w3 = r[3 * h + k];
            a0 += w0 * lo;
            b0 += w0 * hi;
            a1 += w1 * lo;
            b1 += w1 * hi;
            a2 += w2 * lo;
            b2 += w2 * hi;
            a3 += w3 * lo;
            b3 += w3 * hi;
        }
        v8 low[4] = {a0, a1, a2, a3}, high[4] = {b0, b1, b2, b3};
        for (int c = 0; c < b; c++) {
            float *o = out + (size_t)c * v + j;
            for (int t = 0; t < 4; t++)
                o[t] = c < 8 ? low[t][c] : high[t][c - 8];
        }
    }
    for (; j < j1; j++) {
        const float *r = w + (size_t)j * h;
        v8 lo = {0}, hi = {0};
        for (long k = 0; k < h; k++) {
            lo += r[k] * *(const v8 *)(xt + (size_t)k * 16);
            hi += r[k] * *(const v8 *)(xt + (size_t)k * 16 + 8);
        }
        for (int c = 0; c < b; c++)
            out[(size_t)c * v + j] = c < 8 ? lo[c] : hi[c - 8];
    }
}

static int wide_vectors(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 1 : 0;
    }
    return known;
#else
    return 0;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MLXR_NO_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
int mlxr_row_kernel(const float *w, long h, const float *xt, int lanes, float *out, long v,
                   int b, long j0, long j1)
{
    if (b < 1 || b > lanes || j0 < 0 || j1 > v || j0 > j1)
        return -1;
    switch (lanes) {
    case 4:
        rows4(w, h, xt, out, v, b, j0, j1);
        return 0;
    case 8:
        rows8(w, h, xt, out, v, b, j0, j1);
        return 0;
    case 16:
        if (wide_vectors()) {
            rows16(w, h, xt, out, v, b, j0, j1);
        } else {
            rows16_halves(w, h, xt, out, v, b, j0, j1);
        }
        return 0;
    }
    return -1;
}
