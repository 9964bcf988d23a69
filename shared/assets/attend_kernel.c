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
 * The same library holds `mlxr_decode_row` (at the end): one row's whole decode step through
 * the layers, this attention included (runner/decode_row.py).
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

/* A prefill tile's softmax in place (runner/host_prefill.py `_attend`): rows a..z of `cols`
 * floats, `stride` apart from s, row r seeing its first min(cols, first + r % period) (the
 * causal mask: the others become 0). Two passes over a row where numpy made five (its max,
 * the shift, exp, the sum, the division): 2.4 of a 3,072-token prompt's 29.7 s on a 0.6B
 * model was numpy's softmax. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MLXR_NO_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void mlxr_softmax_rows(float *s, long stride, long cols, long first, long period, long a, long z)
{
    for (long r = a; r < z; r++) {
        float *row = s + (size_t)r * stride;
        long n = first + r % period;
        n = n < cols ? n : cols;
        if (n <= 0) {
            memset(row, 0, sizeof(float) * (size_t)cols);
            continue;
        }
        float inverse = 1.0f / exp_shifted(row, n, largest(row, n));
        long i = 0;
        for (; i + 8 <= n; i += 8)
            *(v8 *)(row + i) *= inverse;
        for (; i < n; i++)
            row[i] *= inverse;
        memset(row + n, 0, sizeof(float) * (size_t)(cols - n));
    }
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

/* ---- One row's decode step through every layer (runner/decode_row.py) ----
 *
 * The numpy body (runner/host_body.py `_row`) made some 40 numpy calls a layer around its seven
 * products: the norms, RoPE, the key and value writes, the softmax's call, SwiGLU, the
 * residual adds. On a 0.6B model (28 layers) that was 5-6 ms of a 20 ms body. Here one call
 * does the whole step: the products through the quantized kernel's `mlxr_quant_rows_parts` or
 * `mlxr_quant_super_parts`, or BLAS's `cblas_sgemv` (function pointers the caller hands in),
 * the attention through `mlxr_attend_position` (split on the quantized kernel's workers by
 * `mlxr_parts` from `pool_floats` floats of context), and everything between in plain loops.
 *
 * The model is a table of int64 slots (M_* then L_STRIDE per layer, each linear LIN_SLOTS);
 * doubles (epsilons, the attention scale) are stored by their bits. */

typedef int (*quant_fn)(const uint8_t *q, int bits, long h, int group, const float *scales,
                        const float *biases, const float *x, int lanes, float *out, long v,
                        int b, long j0, long j1, int parts, float zmul);
typedef int (*super_fn)(const uint8_t *q, int bits, long h, const uint8_t *codes,
                        const float *factors, const float *x, float *out, long v, long j0,
                        long j1, int parts);
typedef void (*sgemv_fn)(int order, int trans, int m, int n, float alpha, const float *a,
                         int lda, const float *x, int incx, float beta, float *y, int incy);
typedef void (*job_fn)(const void *args, long a, long z);
typedef void (*parts_fn)(job_fn fn, const void *args, long n, int parts);

enum { /* the model's header */
    M_LAYERS, M_HIDDEN, M_HEADS, M_KV_HEADS, M_DIM, M_INTER, M_QUANT, M_SGEMV, M_PARTS,
    M_WORKERS, M_POOL_FLOATS, M_PARTNER, M_NORM, M_NORM_EPS, M_SCRATCH, M_SUPER, M_HEADER
};
enum { /* a linear layer */
    LIN_KIND, LIN_W, LIN_SCALES, LIN_BIASES, LIN_BITS, LIN_GROUP, LIN_OUT, LIN_IN, LIN_BIAS,
    LIN_PARTS, LIN_SLOTS
};
/* KIND_SUPER: a 4- or 8-bit weight whose scales and biases come as super-blocks, LIN_SCALES its
 * codes and LIN_BIASES its factors (`mlxr_quant_super_parts`). KIND_OFFSET: one whose biases
 * are -LIN_BIASES times its scales (`mlxr_quant_rows_parts`' zmul), read from the scales. */
enum { KIND_QUANT = 1, KIND_FLOAT = 2, KIND_SUPER = 3, KIND_OFFSET = 4 };
enum { /* a layer: its norms and scale, then its seven linears */
    Y_ATTN_NORM, Y_ATTN_EPS, Y_MLP_NORM, Y_MLP_EPS, Y_Q_NORM, Y_Q_EPS, Y_K_NORM, Y_K_EPS,
    Y_SCALE, Y_LINEARS
};
enum { LQ, LK, LV, LO, LGATE, LUP, LDOWN, LINEARS };
#define L_STRIDE (Y_LINEARS + LINEARS * LIN_SLOTS)
enum { /* a layer's context for this step */
    C_TABLE, C_PIECES, C_POSITIONS, C_KEY_SLOT, C_VALUE_SLOT, C_KEY_HEADS, C_VALUE_HEADS,
    C_SLOTS
};

INLINE double slot_double(const int64_t *slots, int i)
{
    double d;
    memcpy(&d, slots + i, sizeof(d));
    return d;
}

#define PTR(type, v) ((type)(intptr_t)(v))

/* y = x * (1 / sqrt(mean(x^2) + eps)) * w, over n floats (x and y may be the same) */
INLINE void rms_norm_into(float *y, const float *x, const float *w, long n, double eps)
{
    float ss = dot(x, x, n);
    float inverse = (float)(1.0 / __builtin_sqrt((double)ss / n + eps));
    for (long i = 0; i < n; i++)
        y[i] = x[i] * inverse * w[i];
}

/* the same per head, in float as numpy's two-axis norm computes it */
INLINE void head_norms(float *x, const float *w, long heads, long dim, double eps)
{
    for (long h = 0; h < heads; h++) {
        float *xh = x + h * dim;
        float ms = dot(xh, xh, dim) / (float)dim + (float)eps;
        float inverse = 1.0f / __builtin_sqrtf(ms);
        for (long i = 0; i < dim; i++)
            xh[i] = xh[i] * inverse * w[i];
    }
}

/* out[j] = x[j] * diag[j] + x[partner[j]] * off[j] per head, then times `scale` */
INLINE void rotate(float *x, long heads, long dim, const float *diag, const float *off,
                   const int32_t *partner, float scale, float *tmp)
{
    for (long h = 0; h < heads; h++) {
        float *xh = x + h * dim;
        memcpy(tmp, xh, sizeof(float) * dim);
        for (long j = 0; j < dim; j++)
            xh[j] = (tmp[j] * diag[j] + tmp[partner[j]] * off[j]) * scale;
    }
}

/* out = silu(g) * u, n floats: g * sigmoid(g), with exp of -|g| only */
INLINE void silu_times_into(float *out, const float *g, const float *u, long n)
{
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        v8 x = *(const v8 *)(g + i);
        i8 negative = x < (v8){0};
        v8 e = exp8((v8)((i8)x | (i8)(v8){-0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f,
                                           -0.0f})); /* -|x| */
        v8 top = (v8)(((i8)e & negative) | ((i8)(v8){1, 1, 1, 1, 1, 1, 1, 1} & ~negative));
        *(v8 *)(out + i) = x * (top / (1.0f + e)) * *(const v8 *)(u + i);
    }
    for (; i < n; i++)
        out[i] = g[i] / (1.0f + __builtin_expf(-g[i])) * u[i];
}

/* x in the quantized kernel's 4-bit order for one row where one of the n linears from l
 * reads 4 bits, else x itself (runner/quant_kernel.py `one_row_order`): a length that is a
 * multiple of 128, each block of 128 transposed from (16, 8) to (8, 16); else each block of
 * 32 as its 16 even positions, then its 16 odd ones */
INLINE const float *order_for(const int64_t *l, int n, const float *x, long len, float *into)
{
    int four = 0;
    for (int i = 0; i < n; i++)
        four |= l[i * LIN_SLOTS + LIN_KIND] != KIND_FLOAT && l[i * LIN_SLOTS + LIN_BITS] == 4;
    if (!four)
        return x;
    if (len % 128 == 0) {
        for (long b = 0; b < len; b += 128)
            for (long k = 0; k < 8; k++)
                for (long i = 0; i < 16; i++)
                    into[b + 16 * k + i] = x[b + 8 * i + k];
        return into;
    }
    for (long b = 0; b < len; b += 32)
        for (long k = 0; k < 16; k++) {
            into[b + k] = x[b + 2 * k];
            into[b + 16 + k] = x[b + 2 * k + 1];
        }
    return into;
}

/* out = W x (+ bias); `ordered` is x in the 4-bit order where a 4-bit linear needs it (made
 * once for the products sharing x). Returns 0, or -1 where the kernel refused. */
INLINE int linear(const int64_t *model, const int64_t *l, const float *x, const float *ordered,
                  float *out)
{
    long rows = l[LIN_OUT], depth = l[LIN_IN];
    if (l[LIN_KIND] == KIND_QUANT || l[LIN_KIND] == KIND_OFFSET) {
        int bits = (int)l[LIN_BITS], offset = l[LIN_KIND] == KIND_OFFSET;
        const float *scales = PTR(const float *, l[LIN_SCALES]);
        if (PTR(quant_fn, model[M_QUANT])(PTR(const uint8_t *, l[LIN_W]), bits, depth,
                                          (int)l[LIN_GROUP], scales,
                                          offset ? scales : PTR(const float *, l[LIN_BIASES]),
                                          bits == 4 ? ordered : x, 1, out, rows, 1, 0, rows,
                                          (int)l[LIN_PARTS],
                                          offset ? -(float)l[LIN_BIASES] : 1.0f) != 0)
            return -1;
    } else if (l[LIN_KIND] == KIND_SUPER) {
        int bits = (int)l[LIN_BITS];
        if (PTR(super_fn, model[M_SUPER])(PTR(const uint8_t *, l[LIN_W]), bits, depth,
                                          PTR(const uint8_t *, l[LIN_SCALES]),
                                          PTR(const float *, l[LIN_BIASES]),
                                          bits == 4 ? ordered : x, out, rows, 0, rows,
                                          (int)l[LIN_PARTS]) != 0)
            return -1;
    } else {
        PTR(sgemv_fn, model[M_SGEMV])(101, 111, (int)rows, (int)depth, 1.0f,
                                      PTR(const float *, l[LIN_W]), (int)depth, x, 1, 0.0f, out,
                                      1);
    }
    const float *bias = PTR(const float *, l[LIN_BIAS]);
    if (bias)
        for (long i = 0; i < rows; i++)
            out[i] += bias[i];
    return 0;
}

/* h += W x (+ bias): the residual stream's products (o and down); t is scratch */
INLINE int add_linear(const int64_t *model, const int64_t *l, const float *x, long len,
                      float *ordered, float *t, float *h, long hidden)
{
    if (linear(model, l, x, order_for(l, 1, x, len, ordered), t))
        return -1;
    for (long j = 0; j < hidden; j++)
        h[j] += t[j];
    return 0;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MLXR_NO_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
int mlxr_decode_row(const int64_t *model, float *h, const float *diag, const float *off,
                    const int64_t *context, float *scores, float *out)
/* h (hidden): the token's embedding, overwritten by the residual stream; diag and off: the
 * position's RoPE tables; context: C_SLOTS a layer; scores: heads x the largest layer's
 * positions; out (hidden): the final norm's output. Returns 0, or -1 where a kernel refused
 * (the keys and values of layers before it are then written). */
{
    const long layers = model[M_LAYERS], hidden = model[M_HIDDEN], heads = model[M_HEADS];
    const long kv_heads = model[M_KV_HEADS], dim = model[M_DIM], inter = model[M_INTER];
    const long group = heads / kv_heads, widest = inter > heads * dim ? inter : heads * dim;
    const int32_t *partner = PTR(const int32_t *, model[M_PARTNER]);
    float *x = PTR(float *, model[M_SCRATCH]);       /* a normed row, widest */
    float *ordered = x + (widest > hidden ? widest : hidden); /* it in the 4-bit order */
    float *q = ordered + (widest > hidden ? widest : hidden); /* heads * dim */
    float *k = q + heads * dim, *v = k + kv_heads * dim;  /* kv_heads * dim each */
    float *attended = v + kv_heads * dim;                 /* heads * dim */
    float *t = attended + heads * dim;                    /* hidden */
    float *g = t + hidden, *u = g + inter, *tmp = u + inter; /* inter, inter, dim */
    for (long i = 0; i < layers; i++) {
        const int64_t *y = model + M_HEADER + i * L_STRIDE, *lin = y + Y_LINEARS;
        const int64_t *c = context + i * C_SLOTS;
        rms_norm_into(x, h, PTR(const float *, y[Y_ATTN_NORM]), hidden,
                      slot_double(y, Y_ATTN_EPS));
        const float *xo = order_for(lin, 3, x, hidden, ordered);
        if (linear(model, lin + LQ * LIN_SLOTS, x, xo, q) ||
            linear(model, lin + LK * LIN_SLOTS, x, xo, k) ||
            linear(model, lin + LV * LIN_SLOTS, x, xo, v))
            return -1;
        if (y[Y_Q_NORM])
            head_norms(q, PTR(const float *, y[Y_Q_NORM]), heads, dim, slot_double(y, Y_Q_EPS));
        if (y[Y_K_NORM])
            head_norms(k, PTR(const float *, y[Y_K_NORM]), kv_heads, dim,
                       slot_double(y, Y_K_EPS));
        rotate(q, heads, dim, diag, off, partner, (float)slot_double(y, Y_SCALE), tmp);
        rotate(k, kv_heads, dim, diag, off, partner, 1.0f, tmp);
        float *key_slot = PTR(float *, c[C_KEY_SLOT]), *value_slot = PTR(float *, c[C_VALUE_SLOT]);
        for (long j = 0; j < kv_heads; j++) {
            memcpy(key_slot + j * c[C_KEY_HEADS], k + j * dim, sizeof(float) * dim);
            memcpy(value_slot + j * c[C_VALUE_HEADS], v + j * dim, sizeof(float) * dim);
        }
        long positions = c[C_POSITIONS];
        if (model[M_PARTS] && 2 * kv_heads * positions * dim >= model[M_POOL_FLOATS]) {
            int64_t args[9] = {(int64_t)(intptr_t)q, group, dim, c[C_PIECES], c[C_TABLE],
                               (int64_t)(intptr_t)scores, positions,
                               (int64_t)(intptr_t)attended, 0};
            PTR(parts_fn, model[M_PARTS])(mlxr_attend_heads, args, kv_heads,
                                          (int)model[M_WORKERS]);
            if (args[8] != 0)
                return -1;
        } else if (mlxr_attend_position(q, group, dim, c[C_PIECES], PTR(const int64_t *,
                                        c[C_TABLE]), scores, positions, attended, 0,
                                        kv_heads) != 0) {
            return -1;
        }
        if (add_linear(model, lin + LO * LIN_SLOTS, attended, heads * dim, ordered, t, h,
                       hidden))
            return -1;
        rms_norm_into(x, h, PTR(const float *, y[Y_MLP_NORM]), hidden,
                      slot_double(y, Y_MLP_EPS));
        xo = order_for(lin + LGATE * LIN_SLOTS, 2, x, hidden, ordered);
        if (linear(model, lin + LGATE * LIN_SLOTS, x, xo, g) ||
            linear(model, lin + LUP * LIN_SLOTS, x, xo, u))
            return -1;
        silu_times_into(g, g, u, inter);
        if (add_linear(model, lin + LDOWN * LIN_SLOTS, g, inter, ordered, t, h, hidden))
            return -1;
    }
    rms_norm_into(out, h, PTR(const float *, model[M_NORM]), hidden,
                  slot_double(model, M_NORM_EPS));
    return 0;
}

/* The table's sizes, for the caller to check its own against: M_HEADER, LIN_SLOTS,
 * Y_LINEARS, L_STRIDE, C_SLOTS. */
void mlxr_decode_layout(int64_t *out)
{
    out[0] = M_HEADER;
    out[1] = LIN_SLOTS;
    out[2] = Y_LINEARS;
    out[3] = L_STRIDE;
    out[4] = C_SLOTS;
}

/* Encoders (runner/embed/host_encoder.py): element-wise steps of a BERT layer over rows
 * [a, z) of `cols` floats, in place, so the caller may split the rows across threads. */

#define CLONES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MLXR_NO_CLONES)
#undef CLONES
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

/* x = GELU(x + bias) in its erf form, 0.5 x (1 + erf(x / sqrt 2)); erf by Abramowitz and
 * Stegun 7.1.26 (within 1.5e-7; 6e-7 in float32), its exp(-s^2) by exp8 */
CLONES void mlxr_gelu_rows(float *x, const float *bias, long cols, long a, long z)
{
    const float p = 0.3275911f, a1 = 0.254829592f, a2 = -0.284496736f, a3 = 1.421413741f,
                a4 = -1.453152027f, a5 = 1.061405429f;
    const i8 sign = (i8)(v8){-0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f};
    for (long r = a; r < z; r++) {
        float *row = x + (size_t)r * cols;
        long i = 0;
        for (; i + 8 <= cols; i += 8) {
            v8 v = *(v8 *)(row + i) + *(const v8 *)(bias + i);
            v8 s = v * 0.70710678118654752f;
            v8 m = (v8)((i8)s & ~sign); /* |s| */
            v8 t = 1.0f / (1.0f + p * m);
            v8 poly = t * (a1 + t * (a2 + t * (a3 + t * (a4 + t * a5))));
            v8 e = 1.0f - poly * exp8(-(m * m)); /* erf(|s|) */
            *(v8 *)(row + i) = 0.5f * v * (1.0f + (v8)((i8)e | ((i8)s & sign)));
        }
        for (; i < cols; i++) {
            float v = row[i] + bias[i];
            row[i] = 0.5f * v * (1.0f + __builtin_erff(v * 0.70710678118654752f));
        }
    }
}

/* g = silu(g) * u (a SwiGLU's gate and up projections, rows of `cols`) */
CLONES void mlxr_silu_times_rows(float *g, const float *u, long cols, long a, long z)
{
    silu_times_into(g + (size_t)a * cols, g + (size_t)a * cols, u + (size_t)a * cols,
                    (z - a) * cols);
}

/* x = LayerNorm(x + y + bias) * w + b, rows of `cols` (y and bias may be NULL) */
CLONES void mlxr_add_layer_norm_rows(float *x, const float *y, const float *bias,
                                     const float *w, const float *b, float eps, long cols,
                                     long a, long z)
{
    for (long r = a; r < z; r++) {
        float *row = x + (size_t)r * cols;
        const float *other = y ? y + (size_t)r * cols : NULL;
        double sum = 0.0, squares = 0.0;
        for (long i = 0; i < cols; i++) {
            float v = row[i] + (other ? other[i] : 0.0f) + (bias ? bias[i] : 0.0f);
            row[i] = v;
            sum += v;
        }
        float mean = (float)(sum / (double)cols);
        for (long i = 0; i < cols; i++) {
            float d = row[i] - mean;
            squares += (double)(d * d);
        }
        float inverse = (float)(1.0 / __builtin_sqrt(squares / (double)cols + (double)eps));
        for (long i = 0; i < cols; i++)
            row[i] = (row[i] - mean) * inverse * w[i] + b[i];
    }
}
