/* One decode position's attention over a row's float32 keys and values, on a CPU: for each key
 * head, the scores of its group of query heads against every position, their softmax, and the
 * weighted sum of the values. Each key and value row is read once for the whole group.
 *
 * numpy made this two BLAS calls a key head and piece, plus the softmax's passes over the
 * scores (runner/kv/host_attention.py `attend_position`). That was call overhead at a few
 * hundred positions, and at a few thousand it read the keys and values at about a third of
 * the speed this does: a 0.6B model's decode step took 179 ms at 3,000 positions against 32 ms
 * at 30 (docs/PERFORMANCE.md, "Attention for one position in C").
 *
 * The context comes in pieces (a row's shared prefix blocks, then its own run), each laid out
 * (kv_heads, n, dim) with rows of dim contiguous floats and its own head stride. The scores are
 * the caller's scratch, (kv_heads, group, positions). A call takes key heads h0..h1, so the
 * caller may split the heads across threads.
 *
 * exp is a polynomial (degree 7 after reduction by powers of two), for arguments at or below
 * zero as the softmax gives it: within 8e-8 of exp relative, above 1e-30 (checked over
 * [-87, 0] in steps of 1e-5).
 *
 * Built on demand by runner/kv/attend_kernel.py, as the row kernel is (shared/native.py): on
 * x86-64 GCC clones the entry point for AVX-512, AVX2 with FMA and the baseline, and picks
 * one when the library loads. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));

#define MAX_GROUP 64 /* query heads a key head serves */
/* every helper inlined: one that is not is compiled for the baseline only, outside the clones
 * (the first build ran at a sixth of the speed so) */
#define INLINE static inline __attribute__((always_inline))

INLINE float dot(const float *restrict a, const float *restrict b, long n)
{
    v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    long d = 0;
    for (; d + 32 <= n; d += 32) {
        s0 += *(const v8 *)(a + d) * *(const v8 *)(b + d);
        s1 += *(const v8 *)(a + d + 8) * *(const v8 *)(b + d + 8);
        s2 += *(const v8 *)(a + d + 16) * *(const v8 *)(b + d + 16);
        s3 += *(const v8 *)(a + d + 24) * *(const v8 *)(b + d + 24);
    }
    for (; d + 8 <= n; d += 8)
        s0 += *(const v8 *)(a + d) * *(const v8 *)(b + d);
    s0 += s1 + s2 + s3;
    float s = ((s0[0] + s0[4]) + (s0[1] + s0[5])) + ((s0[2] + s0[6]) + (s0[3] + s0[7]));
    for (; d < n; d++)
        s += a[d] * b[d];
    return s;
}

/* exp(x) for x <= 0, 8 at a time; 0 below about -87 */
INLINE v8 exp8(v8 x)
{
    const v8 lowest = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    i8 under = x < lowest;
    x = (v8)(((i8)x & ~under) | ((i8)lowest & under));
    v8 t = x * 1.44269504088896341f; /* log2(e) */
    i8 n = -__builtin_convertvector(0.5f - t, i8); /* round(t), t <= 0 */
    v8 nf = __builtin_convertvector(n, v8);
    v8 r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f; /* ln 2, in two parts */
    v8 p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v8 scale = (v8)((n + 127) << 23);
    return (v8)((i8)(p * scale) & ~under);
}

INLINE float largest(const float *s, long n)
{
    float top = s[0];
    long i = 0;
    if (n >= 8) {
        v8 m = *(const v8 *)s;
        for (i = 8; i + 8 <= n; i += 8) {
            v8 x = *(const v8 *)(s + i);
            i8 more = x > m;
            m = (v8)(((i8)x & more) | ((i8)m & ~more));
        }
        top = m[0];
        for (int j = 1; j < 8; j++)
            top = m[j] > top ? m[j] : top;
    }
    for (; i < n; i++)
        top = s[i] > top ? s[i] : top;
    return top;
}

/* s[i] = exp(s[i] - top); returns their sum */
INLINE float exp_shifted(float *s, long n, float top)
{
    v8 total = {0};
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 e = exp8(*(v8 *)(s + i) - top);
        *(v8 *)(s + i) = e;
        total += e;
    }
    if (i < n) {
        v8 tail = {0};
        for (long j = i; j < n; j++)
            tail[j - i] = s[j] - top;
        v8 e = exp8(tail);
        for (long j = i; j < n; j++) {
            s[j] = e[j - i];
            total[j - i] += e[j - i];
        }
    }
    return ((total[0] + total[4]) + (total[1] + total[5])) +
           ((total[2] + total[6]) + (total[3] + total[7]));
}

/* the sums of a, b, c and d in lanes 0, 4, 2 and 6 */
INLINE v8 sums4(v8 a, v8 b, v8 c, v8 d)
{
    const i8 lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    const i8 even = {0, 1, 8, 9, 4, 5, 12, 13}, odd = {2, 3, 10, 11, 6, 7, 14, 15};
    const i8 swap = {1, 0, 3, 2, 5, 4, 7, 6};
    v8 x = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
    v8 y = __builtin_shuffle(c, d, lo) + __builtin_shuffle(c, d, hi);
    v8 z = __builtin_shuffle(x, y, even) + __builtin_shuffle(x, y, odd);
    return z + __builtin_shuffle(z, swap);
}

/* s[p] = q . k[p], for n rows of k (dim floats each, a multiple of 8); the n rows from
 * `ahead` are prefetched meanwhile, where it is not 0 */
INLINE void scores_of(const float *restrict q, const float *restrict k, long n, long dim,
                      float *restrict s, const float *ahead)
{
    long p = 0;
    for (; p + 4 <= n; p += 4) {
        const float *k0 = k + (size_t)p * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
        v8 a = {0}, b = {0}, c = {0}, d = {0};
        for (long i = 0; i < dim; i += 8) {
            if (ahead) { /* the four rows are 4 * dim floats: two lines an iteration */
                __builtin_prefetch(ahead + (size_t)p * dim + 4 * i);
                __builtin_prefetch(ahead + (size_t)p * dim + 4 * i + 16);
            }
            v8 x = *(const v8 *)(q + i);
            a += x * *(const v8 *)(k0 + i);
            b += x * *(const v8 *)(k1 + i);
            c += x * *(const v8 *)(k2 + i);
            d += x * *(const v8 *)(k3 + i);
        }
        v8 t = sums4(a, b, c, d);
        s[p] = t[0];
        s[p + 1] = t[4];
        s[p + 2] = t[2];
        s[p + 3] = t[6];
    }
    for (; p < n; p++)
        s[p] = dot(q, k + (size_t)p * dim, dim);
}

#define SPAN 32 /* floats of a value row one pass keeps in registers */

/* out += sum over p of w[p] * v[p], for n rows of v (dim floats, a multiple of 8); the n
 * rows from `ahead` are prefetched meanwhile, where it is not 0 */
INLINE void weighted_sum(float *restrict out, const float *restrict v, long n, long dim,
                         const float *restrict w, const float *ahead)
{
    long i = 0;
    for (; i + SPAN <= dim; i += SPAN) {
        v8 a = {0}, b = {0}, c = {0}, d = {0};
        for (long p = 0; p < n; p++) {
            const float *r = v + (size_t)p * dim + i;
            if (ahead && i == 0) /* a row is dim floats */
                for (long j = 0; j < dim; j += 16)
                    __builtin_prefetch(ahead + (size_t)p * dim + j);
            float x = w[p];
            a += x * *(const v8 *)r;
            b += x * *(const v8 *)(r + 8);
            c += x * *(const v8 *)(r + 16);
            d += x * *(const v8 *)(r + 24);
        }
        *(v8 *)(out + i) += a;
        *(v8 *)(out + i + 8) += b;
        *(v8 *)(out + i + 16) += c;
        *(v8 *)(out + i + 24) += d;
    }
    for (; i < dim; i += 8) {
        v8 a = {0};
        for (long p = 0; p < n; p++)
            a += w[p] * *(const v8 *)(v + (size_t)p * dim + i);
        *(v8 *)(out + i) += a;
    }
}

#define TILE 64 /* positions a pass over a tile of values covers */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MLXR_NO_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
int mlxr_attend_position(const float *q, long group, long dim, long pieces,
                         const int64_t *table, float *scores, long positions, float *out,
                         long h0, long h1)
/* q (kv_heads, group, dim), already scaled; table: pieces' key addresses, value addresses,
 * lengths, key head strides and value head strides (in floats), pieces entries each; out
 * (kv_heads, group, dim). Returns 0, or -1 for arguments it does not take. */
{
    const int64_t *keys = table, *values = table + pieces, *lengths = table + 2 * pieces;
    const int64_t *key_heads = table + 3 * pieces, *value_heads = table + 4 * pieces;
    long total = 0;
    for (long i = 0; i < pieces; i++)
        total += lengths[i];
    if (group < 1 || group > MAX_GROUP || dim < 8 || dim % 8 || pieces < 1 || total != positions ||
        positions < 1 || h0 < 0 || h1 < h0)
        return -1;
    for (long h = h0; h < h1; h++) {
        const float *qh = q + (size_t)h * group * dim;
        float *sh = scores + (size_t)h * group * positions, *oh = out + (size_t)h * group * dim;
        long at = 0;
        for (long i = 0; i < pieces; i++) {
            const float *k = (const float *)(intptr_t)keys[i] + (size_t)h * key_heads[i];
            for (long p = 0; p < lengths[i]; p += TILE) {
                long n = lengths[i] - p < TILE ? lengths[i] - p : TILE;
                /* the next tile, prefetched while the group's first query reads this one */
                const float *next = p + 2 * TILE <= lengths[i] ? k + (size_t)(p + TILE) * dim : 0;
                for (long g = 0; g < group; g++)
                    scores_of(qh + g * dim, k + (size_t)p * dim, n, dim,
                              sh + (size_t)g * positions + at + p, g == 0 ? next : 0);
            }
            at += lengths[i];
        }
        float inverse[MAX_GROUP];
        for (long g = 0; g < group; g++) {
            float *s = sh + (size_t)g * positions;
            inverse[g] = 1.0f / exp_shifted(s, positions, largest(s, positions));
        }
        memset(oh, 0, sizeof(float) * group * dim);
        at = 0;
        for (long i = 0; i < pieces; i++) {
            const float *v = (const float *)(intptr_t)values[i] + (size_t)h * value_heads[i];
            for (long p = 0; p < lengths[i]; p += TILE) {
                long n = lengths[i] - p < TILE ? lengths[i] - p : TILE;
                const float *next = p + 2 * TILE <= lengths[i] ? v + (size_t)(p + TILE) * dim : 0;
                for (long g = 0; g < group; g++)
                    weighted_sum(oh + g * dim, v + (size_t)p * dim, n, dim,
                                 sh + (size_t)g * positions + at + p, g == 0 ? next : 0);
            }
            at += lengths[i];
        }
        for (long g = 0; g < group; g++)
            for (long d = 0; d < dim; d++)
                oh[g * dim + d] *= inverse[g];
    }
    return 0;
}

/* `mlxr_attend_position` for key heads h0..h1 as a job of the quantized kernel's workers
 * (`mlxr_parts` in quant_kernel.c): args are int64s, q, group, dim, pieces, table, scores,
 * positions, out, then a status that a refusal sets to -1. */
void mlxr_attend_heads(const void *args, long h0, long h1)
{
    int64_t *a = (int64_t *)args;
    if (mlxr_attend_position((const float *)(intptr_t)a[0], a[1], a[2], a[3],
                             (const int64_t *)(intptr_t)a[4], (float *)(intptr_t)a[5], a[6],
                             (float *)(intptr_t)a[7], h0, h1) != 0)
        __atomic_store_n(&a[8], -1, __ATOMIC_RELAXED);
}

/* Many rows' one-position attention as a job over (row, key head) items, item i being row
 * i / kv_heads and head i % kv_heads: a decode step's rows in one call, split across the
 * workers. args are int64s: rows, group, dim, kv_heads, a status that a refusal sets to -1,
 * then per row its q, out, scores, pieces, table and positions (as `mlxr_attend_position`
 * takes them). */
void mlxr_attend_rows(const void *args, long a, long z)
{
    int64_t *head = (int64_t *)args;
    const int64_t group = head[1], dim = head[2], kv_heads = head[3];
    for (long i = a; i < z; i++) {
        const int64_t *row = head + 5 + 6 * (i / kv_heads);
        long h = i % kv_heads;
        if (mlxr_attend_position((const float *)(intptr_t)row[0], group, dim, row[3],
                                 (const int64_t *)(intptr_t)row[4], (float *)(intptr_t)row[2],
                                 row[5], (float *)(intptr_t)row[1], h, h + 1) != 0)
            __atomic_store_n(&head[4], -1, __ATOMIC_RELAXED);
    }
}
