/* A few rows times an MLX affine-quantized weight (4 or 8 bits), read as stored, on a CPU:
 * out (b, v) = x (b, h) @ dequantize(q, scales, biases) (v, h)^T, reading q once for up to 16
 * rows. The decode steps' and short prefill chunks' products of a quantized model, which
 * would otherwise be widened to float32 (4x the bytes of an 8-bit weight, 8x a 4-bit one)
 * or go to MLX's quantized CPU matmul (no BLAS; 5x float32's time for one row, 44x for 16).
 *
 * MLX's layout (supervisor/store/gguf/quants.py pins it): each weight row is a little-endian
 * stream of `bits`-bit unsigned values, element i in bits [i * bits, (i + 1) * bits); a group
 * of `group` consecutive elements shares a scale and a bias, w = scale * q + bias.
 *
 * Each pass loads W weights as bytes and widens them to float. One row goes along each
 * weight row in turn (QSEQ) and sums each group's q * x before it scales it (the biases are
 * one dot product a row with the groups' sums of x). Two or four rows (QKERNEL, two weight
 * rows at a time) and 8 or 16 rows (QTILE, a tile of eight weight rows) dequantize the
 * weights in registers first (where the CPU has FMA, with one rounding where MLX's
 * dequantize has two: a weight may differ from the widened model's in its last bit). The
 * kernels are compiled for each group size (32, 64, 128), so a group's loads unroll. A 4-bit
 * load gives the even elements (low nibbles) and the odd ones (high nibbles) of 2W weights,
 * so the rows come in a layout where each 32-element block holds its 16 even elements, then
 * its 16 odd ones (runner/quant_kernel.py makes it). One row times a 4-bit weight whose depth
 * is a multiple of 128 (every decode step's products, on real models' shapes) is QROW4's:
 * the weight read as 32-bit words, x in another order. A GGUF Q4_K import's scales and
 * biases can also come as byte codes and a factor per 256 weights (`mlxr_quant_super_parts`,
 * for one row, 4 or 8 bits; `mlxr_quant_factored` finds them).
 *
 * Built on demand by runner/quant_kernel.py with the system C compiler. On x86-64 (GCC or
 * clang) one copy is compiled for AVX-512 (16 floats a vector), one for AVX2 with FMA (8) and
 * one for the baseline (4), and `mlxr_quant_rows` picks by what this CPU reports, so the same
 * file is safe on every x86-64 CPU. Elsewhere it is the 4-float copy, which GCC's vector
 * extensions make NEON on Arm (and MLXR_QUANT_GENERIC makes anywhere). `mlxr_quant_use_width`
 * picks a narrower copy, for the tests. */
#include <stdint.h>
#include <string.h>

#define LOAD(dst, src) memcpy(&(dst), (src), sizeof(dst))
#define MAX_GROUP 128 /* the largest group size taken */
#define AHEAD_ROWS 16 /* weight rows prefetched ahead */
#define SEQ_AHEAD 4096 /* bytes prefetched ahead along a sequential stream */
#define ROW4_BLOCK 128 /* weights a block of QROW4, which takes depths that are multiples */
#define SUPER_GROUPS 8 /* groups of 32 in a super-block: a Q4_K block's 256 weights */
#define SUPER_AHEAD 8 /* rows ahead that a super-block weight's codes are prefetched */

/* The 64-byte lines that start in bytes [from, from + n) of a row, AHEAD_ROWS rows on: without
 * it one core read a weight at about half the speed (row_kernel.c found the same). */
#define PREFETCH_GROUP(row, from, n, rowbytes)                                                \
    for (long line = ((from) + 63) & ~63L; line < (from) + (n); line += 64)                   \
        __builtin_prefetch((row) + AHEAD_ROWS * (rowbytes) + line)

/* The scales' and biases' line that group `at` starts, AHEAD_ROWS rows on: a third of a 4-bit
 * group of 32's bytes, and a stream of their own. */
#define PREFETCH_SCALES(sc, bi, at, groups)                                                   \
    if (!((at) % 16)) {                                                                       \
        __builtin_prefetch((sc) + (at) + AHEAD_ROWS * (groups));                              \
        __builtin_prefetch((bi) + (at) + AHEAD_ROWS * (groups));                              \
    }

/* One (W, B, T) kernel: B input rows (padded with zero rows), T weight rows a step. */
#define QKERNEL(NAME, ATTR, W, B, T, BITS, BYTES, G)                                          \
    static ATTR void NAME(const uint8_t *q, long h, const float *sc, const float *bi,         \
                          const float *x, float *out, long v, int b, long j,                  \
                          long groups, int ahead)                                             \
    {                                                                                         \
        enum { group = G };                                                                   \
        typedef float vf __attribute__((vector_size(4 * W)));                                 \
        typedef int32_t vi __attribute__((vector_size(4 * W)));                               \
        const long rowbytes = h * BITS / 8;                                                   \
        vf acc[T][B];                                                                         \
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                                  \
            _Pragma("GCC unroll 16") for (int c = 0; c < B; c++) acc[t][c] = (vf){0};         \
        for (long g = 0; g < groups; g++) {                                                   \
            vf s[T], z[T];                                                                    \
            const long k0 = g * group, k1 = k0 + group;                                       \
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                              \
            {                                                                                 \
                s[t] = (vf){0} + sc[(j + t) * groups + g];                                    \
                z[t] = (vf){0} + bi[(j + t) * groups + g];                                    \
                if (ahead) {                                                                  \
                    PREFETCH_GROUP(q + (j + t) * rowbytes, k0 * BITS / 8, group * BITS / 8,   \
                                   rowbytes);                                                 \
                    PREFETCH_SCALES(sc, bi, (j + t) * groups + g, groups);                    \
                }                                                                             \
            }                                                                                 \
            if (BITS == 8) {                                                                  \
                for (long k = k0; k < k1; k += W) {                                           \
                    _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                      \
                    {                                                                         \
                        vi u = (vi)BYTES(q + (j + t) * rowbytes + k);                         \
                        vf w = __builtin_convertvector(u, vf) * s[t] + z[t];                  \
                        _Pragma("GCC unroll 16") for (int c = 0; c < B; c++)                  \
                        {                                                                     \
                            vf xv;                                                            \
                            LOAD(xv, x + c * h + k);                                          \
                            acc[t][c] += w * xv;                                              \
                        }                                                                     \
                    }                                                                         \
                }                                                                             \
            } else {                                                                          \
                for (long k = k0; k < k1; k += 32) {                                          \
                    _Pragma("GCC unroll 4") for (int part = 0; part < 16 / W; part++)         \
                    {                                                                         \
                        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                  \
                        {                                                                     \
                            vi u = (vi)BYTES(q + (j + t) * rowbytes + k / 2 + part * W);      \
                            vf lo = __builtin_convertvector(u & 15, vf) * s[t] + z[t];        \
                            vf hi = __builtin_convertvector(u >> 4, vf) * s[t] + z[t];        \
                            _Pragma("GCC unroll 16") for (int c = 0; c < B; c++)              \
                            {                                                                 \
                                vf xe, xo;                                                    \
                                LOAD(xe, x + c * h + k + part * W);                           \
                                LOAD(xo, x + c * h + k + 16 + part * W);                      \
                                acc[t][c] += lo * xe;                                         \
                                acc[t][c] += hi * xo;                                         \
                            }                                                                 \
                        }                                                                     \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        /* constant indices only: a variable one would keep the accumulators in memory */     \
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                                  \
            _Pragma("GCC unroll 16") for (int c = 0; c < B; c++) if (c < b)                   \
            {                                                                                 \
                float sum = 0;                                                                \
                _Pragma("GCC unroll 16") for (int i = 0; i < W; i++) sum += acc[t][c][i];     \
                out[(long)c * v + j + t] = sum;                                               \
            }                                                                                 \
    }

/* One input row, one weight row after another: the weight's bytes, its scales and its biases
 * are each read as one sequential stream (four rows at a time made twelve). x here is (1, h),
 * in the 4-bit block order.
 *
 * A group's sum is factored: sum((s * q + z) * x) = s * sum(q * x) + z * sum(x). Each group's
 * sum of x is made once a call, and the biases are then one short dot product a row; per
 * weight that leaves a conversion and one multiply-add, where dequantizing first took two
 * (4 bits was bound by them: 21 -> 36 GB/s on both cores without them). The rounding
 * differs: against a float64 product the largest error is 4-9e-7 of the largest output, about
 * what OpenBLAS's float32 product of the dequantized weight makes (2-5e-7). */
#define QSEQ(NAME, ATTR, W, BITS, BYTES, G)                                                   \
    static ATTR void NAME(const uint8_t *q, long h, const float *sc, const float *bi,        \
                          const float *x, float *out, long j0, long j1, float zmul)           \
    {                                                                                         \
        SEQ_SUMS(W, BITS, G)                                                                  \
        for (long j = j0; j < j1; j++) {                                                      \
            const float *s = sc + j * groups, *z = bi + j * groups;                           \
            SEQ_ROW(W, BITS, BYTES, G)                                                        \
        }                                                                                     \
    }

/* QSEQ for an 8-bit weight in groups of 32 whose scales and biases come in super-blocks
 * (`mlxr_quant_super_parts`: a GGUF Q5_K import held in 8 bits, or a Q6_K one): each row's
 * are rebuilt on the stack first, the floats QSEQ would have read, 8.5 bits a weight read
 * instead of 10. */
#define QSEQ_SUPER(NAME, ATTR, W, BYTES)                                                      \
    static ATTR void NAME(const uint8_t *q, long h, const uint8_t *codes,                     \
                          const float *factors, const float *x, float *out, long j0, long j1) \
    {                                                                                         \
        enum { G = 32 };                                                                      \
        const float zmul = 1.0f;                                                              \
        SEQ_SUMS(W, 8, G)                                                                     \
        const long supers = groups / SUPER_GROUPS;                                            \
        float s[groups], z[groups];                                                           \
        for (long j = j0; j < j1; j++) {                                                      \
            SUPER_ROW_SCALES(W)                                                               \
            SEQ_ROW(W, 8, BYTES, G)                                                           \
        }                                                                                     \
    }

/* QSEQ's types, and xs[g]: each group's sum of x (a vector at a time: a scalar sum is one
 * dependent add per position) */
#define SEQ_SUMS(W, BITS, G)                                                                  \
    typedef float vf __attribute__((vector_size(4 * W)));                                     \
    typedef int32_t vi __attribute__((vector_size(4 * W)));                                   \
    enum { GB = G * BITS / 8 }; /* a group's bytes */                                         \
    const long rowbytes = h * BITS / 8, groups = h / G;                                       \
    float xs[groups];                                                                         \
    for (long g = 0; g < groups; g++) {                                                       \
        vf part = {0};                                                                        \
        _Pragma("GCC unroll 8") for (int k = 0; k < G; k += W) {                              \
            vf xv;                                                                            \
            LOAD(xv, x + g * G + k);                                                          \
            part += xv;                                                                       \
        }                                                                                     \
        float sum = 0;                                                                        \
        _Pragma("GCC unroll 16") for (int i = 0; i < W; i++) sum += part[i];                  \
        xs[g] = sum;                                                                          \
    }

/* QSEQ's out[j], for weight row j with scales s and biases z */
#define SEQ_ROW(W, BITS, BYTES, G)                                                            \
    const uint8_t *row = q + j * rowbytes;                                                    \
    vf a0 = {0}, a1 = {0};                                                                    \
    long g = 0;                                                                               \
    for (; g + 2 <= groups; g += 2) {                                                         \
        SEQ_GROUP(W, BITS, BYTES, G, g, a0);                                                  \
        SEQ_GROUP(W, BITS, BYTES, G, g + 1, a1);                                              \
    }                                                                                         \
    if (g < groups)                                                                           \
        SEQ_GROUP(W, BITS, BYTES, G, g, a0);                                                  \
    ROW_OUT(W);

/* Row j's scales s and biases z (stack arrays of `groups`) from its super-block codes and
 * factors, prefetching every line of them SUPER_AHEAD rows on (a row of 2,048 weights has
 * two lines of codes, one of 6,144 six) */
#define SUPER_ROW_SCALES(W)                                                                   \
    const uint8_t *c = codes + j * 2 * groups;                                                \
    const float *f = factors + j * 2 * supers;                                                \
    for (long line = 0; line < 2 * groups; line += 64)                                        \
        __builtin_prefetch(c + 2 * groups * SUPER_AHEAD + line);                              \
    for (long line = 0; line < 2 * supers; line += 16)                                        \
        __builtin_prefetch(f + 2 * supers * SUPER_AHEAD + line);                              \
    for (long b = 0; b < supers; b++) {                                                       \
        CODES_##W(s + b * SUPER_GROUPS, c + b * SUPER_GROUPS, f[b]);                          \
        CODES_##W(z + b * SUPER_GROUPS, c + groups + b * SUPER_GROUPS, f[supers + b]);        \
    }

/* out[j] = the accumulators a0 + a1, summed, plus the biases z (one dot product with the
 * groups' sums of x, xs) */
#define ROW_OUT(W)                                                                            \
    do {                                                                                      \
        vf total = a0 + a1;                                                                   \
        float sum = 0;                                                                        \
        long g_ = 0;                                                                          \
        for (; g_ + W <= groups; g_ += W) {                                                   \
            vf zv, xv;                                                                        \
            LOAD(zv, z + g_);                                                                 \
            LOAD(xv, xs + g_);                                                                \
            total += (zv * zmul) * xv;                                                        \
        }                                                                                     \
        for (; g_ < groups; g_++)                                                             \
            sum += (z[g_] * zmul) * xs[g_];                                                   \
        out[j] = sum + HSUM_##W(total);                                                       \
    } while (0)

/* QSEQ's group g into the accumulator A: A += s * sum(q * x) over the group. Each stream's
 * lines are prefetched SEQ_AHEAD bytes on, once a line: by the group that starts in its first
 * GB bytes (a prefetch past the end of an array does not fault). Where a group takes more
 * than one pass of 2W weights, its sum is two chains (dependent multiply-adds wait on each
 * other's latency). */
#define SEQ_GROUP(W, BITS, BYTES, G, g, A)                                                    \
    do {                                                                                      \
        const uint8_t *p = row + (g) * GB;                                                    \
        if (GB >= 64)                                                                         \
            _Pragma("GCC unroll 4") for (int line = 0; line < GB; line += 64)                 \
                __builtin_prefetch(p + line + SEQ_AHEAD);                                     \
        else if (((uintptr_t)p & 63) < GB)                                                    \
            __builtin_prefetch(p + SEQ_AHEAD);                                                \
        if (((uintptr_t)(s + (g)) & 63) < 4) {                                                \
            __builtin_prefetch(s + (g) + SEQ_AHEAD / 4);                                      \
            __builtin_prefetch(z + (g) + SEQ_AHEAD / 4);                                      \
        }                                                                                     \
        const float *xg = x + (g) * G;                                                        \
        vf t0 = {0}, t1 = {0};                                                                \
        _Pragma("GCC unroll 16") for (int k = 0; k < G; k += 2 * W) {                         \
            vf w0, w1, x0, x1;                                                                \
            if (BITS == 8) {                                                                  \
                w0 = __builtin_convertvector((vi)BYTES(p + k), vf);                           \
                w1 = __builtin_convertvector((vi)BYTES(p + k + W), vf);                       \
                LOAD(x0, xg + k);                                                             \
                LOAD(x1, xg + k + W);                                                         \
            } else { /* W bytes: W even positions (low halves), W odd ones (high halves) */  \
                vi u = (vi)BYTES(p + k / 2);                                                  \
                NIBBLES_##W(u, w0, w1);                                                       \
                int at = k / 2 / 16 * 32 + k / 2 % 16;                                        \
                LOAD(x0, xg + at);                                                            \
                LOAD(x1, xg + at + 16);                                                       \
            }                                                                                 \
            if (G == 2 * W) { /* one pass: one chain */                                      \
                t0 = w0 * x0;                                                                 \
                t0 += w1 * x1;                                                                \
            } else {                                                                          \
                t0 += w0 * x0;                                                                \
                t1 += w1 * x1;                                                                \
            }                                                                                 \
        }                                                                                     \
        A += s[g] * (G == 2 * W ? t0 : t0 + t1); /* one multiply-add where the CPU has FMA */ \
    } while (0)

/* One input row times a 4-bit weight whose depth is a multiple of ROW4_BLOCK (128): QSEQ's
 * work, read another way. A block's 64 bytes are 16 32-bit words; word i holds the block's
 * weights 8i .. 8i + 7, weight 8i + k in its nibble k. So W words at a time, the nibbles k
 * of each word, shifted down, are W weights 8 apart: on AVX-512 one vpermps each makes them
 * floats (a lookup by the low 4 bits), and no load widens bytes. QSEQ's widening loads were
 * shuffles too, and a Zen 4 core's 512-bit shuffles bound it: one core on a 3,072 x 1,024
 * weight took 173-227 us that way, 133-163 us this way (docs/PERFORMANCE.md, session 29).
 * x comes in the matching order, each block transposed: x[128 b + 16 k + i] holds position
 * 128 b + 8 i + k (runner/quant_kernel.py `kernel_layout`). Lanes of one group share a scale:
 * G / 8 lanes a group, so a vector's scales are a lookup too where a group is narrower. The
 * biases are QSEQ's: one dot product a row with the groups' sums of x. */
#define QROW4(NAME, ATTR, W, G)                                                               \
    static ATTR void NAME(const uint8_t *q, long h, const float *sc, const float *bi,         \
                          const float *x, float *out, long j0, long j1, float zmul)           \
    {                                                                                         \
        ROW4_SUMS(W, G)                                                                       \
        for (long j = j0; j < j1; j++) {                                                      \
            const float *s = sc + j * groups, *z = bi + j * groups;                           \
            ROW4_ROW(W, G)                                                                    \
        }                                                                                     \
    }

/* QROW4 for a weight whose scales and biases come in super-blocks of SUPER_GROUPS groups of
 * 32 (`mlxr_quant_super_parts`): each row's are rebuilt on the stack first, the floats QROW4
 * would have read. */
#define QROW4_SUPER(NAME, ATTR, W)                                                            \
    static ATTR void NAME(const uint8_t *q, long h, const uint8_t *codes,                     \
                          const float *factors, const float *x, float *out, long j0, long j1) \
    {                                                                                         \
        enum { G = 32 };                                                                      \
        const float zmul = 1.0f;                                                              \
        ROW4_SUMS(W, G)                                                                       \
        const long supers = groups / SUPER_GROUPS;                                            \
        float s[groups], z[groups];                                                           \
        for (long j = j0; j < j1; j++) {                                                      \
            SUPER_ROW_SCALES(W)                                                               \
            ROW4_ROW(W, G)                                                                    \
        }                                                                                     \
    }

/* QROW4's types, and xs[g]: each group's sum of x, from x's transposed blocks */
#define ROW4_SUMS(W, G)                                                                       \
    typedef float vf __attribute__((vector_size(4 * W)));                                     \
    typedef int32_t vi __attribute__((vector_size(4 * W), unused));                           \
    typedef uint32_t vu __attribute__((vector_size(4 * W)));                                  \
    enum { LANES_A_GROUP = G / 8, PARTS = 16 / W };                                           \
    const long rowbytes = h / 2, groups = h / G, blocks = h / ROW4_BLOCK;                     \
    float xs[groups];                                                                         \
    for (long g = 0; g < groups; g++)                                                         \
        xs[g] = 0;                                                                            \
    for (long b = 0; b < blocks; b++) {                                                       \
        float lane[16] = {0};                                                                 \
        for (int k = 0; k < 8; k++)                                                           \
            for (int i = 0; i < 16; i++)                                                      \
                lane[i] += x[b * ROW4_BLOCK + 16 * k + i];                                    \
        for (int i = 0; i < 16; i++)                                                          \
            xs[b * ROW4_BLOCK / G + i / LANES_A_GROUP] += lane[i];                            \
    }

/* QROW4's out[j], for weight row j with scales s and biases z */
#define ROW4_ROW(W, G)                                                                        \
    const uint8_t *row = q + j * rowbytes;                                                    \
    vf a0 = {0}, a1 = {0};                                                                    \
    for (long b = 0; b < blocks; b++) {                                                       \
        const uint8_t *p = row + b * 64;                                                      \
        const long g0 = b * ROW4_BLOCK / G;                                                   \
        __builtin_prefetch(p + SEQ_AHEAD);                                                    \
        if (!(g0 % 16)) {                                                                     \
            __builtin_prefetch(s + g0 + SEQ_AHEAD / 4);                                       \
            __builtin_prefetch(z + g0 + SEQ_AHEAD / 4);                                       \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int part = 0; part < PARTS; part++) {                    \
            vu u;                                                                             \
            LOAD(u, p + part * 4 * W);                                                        \
            const float *xb = x + b * ROW4_BLOCK + part * W;                                  \
            vf t0 = {0}, t1 = {0};                                                            \
            _Pragma("GCC unroll 8") for (int k = 0; k < 8; k += 2) {                          \
                vf x0, x1;                                                                    \
                LOAD(x0, xb + 16 * k);                                                        \
                LOAD(x1, xb + 16 * k + 16);                                                   \
                t0 += NIBBLE_##W(u, k) * x0;                                                  \
                t1 += NIBBLE_##W(u, k + 1) * x1;                                              \
            }                                                                                 \
            vf scale = SCALES_##W(s + g0 + part * W / LANES_A_GROUP, LANES_A_GROUP);          \
            if ((b * PARTS + part) & 1)                                                       \
                a1 += scale * (t0 + t1);                                                      \
            else                                                                              \
                a0 += scale * (t0 + t1);                                                      \
        }                                                                                     \
    }                                                                                         \
    ROW_OUT(W);

/* QROW4 for each group size, and its driver */
#define ROW4(SUFFIX, ATTR, W)                                                                 \
    QROW4(row4_##SUFFIX##_g32, ATTR, W, 32)                                                   \
    QROW4(row4_##SUFFIX##_g64, ATTR, W, 64)                                                   \
    QROW4(row4_##SUFFIX##_g128, ATTR, W, 128)                                                 \
    QROW4_SUPER(super_##SUFFIX, ATTR, W)                                                      \
    static ATTR void row4_##SUFFIX(const uint8_t *q, long h, int group, const float *sc,      \
                                   const float *bi, const float *x, float *out, long j0,      \
                                   long j1, float zmul)                                       \
    {                                                                                         \
        (group == 32 ? row4_##SUFFIX##_g32 : group == 64 ? row4_##SUFFIX##_g64                \
                                                         : row4_##SUFFIX##_g128)(             \
            q, h, sc, bi, x, out, j0, j1, zmul);                                              \
    }

/* A tile of T weight rows for L (8 or 16) input rows, the shape of row_kernel.c: each
 * group of the tile is dequantized into a buffer on the stack (in L1), then each of its
 * weights is broadcast against a vector of the rows' values at that position, so nothing is
 * summed across a vector. x here is transposed, (h, L), in the 4-bit block order. */
#define QTILE(NAME, ATTR, W, L, T, BITS, BYTES, G)                                            \
    static ATTR void NAME(const uint8_t *q, long h, const float *sc, const float *bi,         \
                          const float *xt, float *out, long v, int b, long j,                 \
                          long groups, int ahead)                                             \
    {                                                                                         \
        enum { group = G };                                                                   \
        typedef float vf __attribute__((vector_size(4 * W)));                                 \
        typedef int32_t vi __attribute__((vector_size(4 * W)));                               \
        typedef float vl __attribute__((vector_size(4 * L)));                                 \
        const long rowbytes = h * BITS / 8;                                                   \
        float buf[T][MAX_GROUP] __attribute__((aligned(64)));                                 \
        vl acc[T];                                                                            \
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) acc[t] = (vl){0};                \
        for (long g = 0; g < groups; g++) {                                                   \
            const long k0 = g * group;                                                        \
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                              \
            {                                                                                 \
                const uint8_t *row = q + (j + t) * rowbytes + k0 * BITS / 8;                  \
                if (ahead) {                                                                  \
                    PREFETCH_GROUP(row, 0, group * BITS / 8, rowbytes);                       \
                    PREFETCH_SCALES(sc, bi, (j + t) * groups + g, groups);                    \
                }                                                                             \
                vf s = (vf){0} + sc[(j + t) * groups + g];                                    \
                vf z = (vf){0} + bi[(j + t) * groups + g];                                    \
                if (BITS == 8) {                                                              \
                    for (int k = 0; k < group; k += W) {                                      \
                        vf w = __builtin_convertvector((vi)BYTES(row + k), vf) * s + z;       \
                        memcpy(&buf[t][k], &w, sizeof w);                                     \
                    }                                                                         \
                } else {                                                                      \
                    for (int k = 0; k < group / 2; k += W) { /* W bytes: 2W weights */        \
                        vi u = (vi)BYTES(row + k);                                            \
                        vf lo = __builtin_convertvector(u & 15, vf) * s + z;                  \
                        vf hi = __builtin_convertvector(u >> 4, vf) * s + z;                  \
                        int at = k / 16 * 32 + k % 16;                                        \
                        memcpy(&buf[t][at], &lo, sizeof lo);                                  \
                        memcpy(&buf[t][at + 16], &hi, sizeof hi);                             \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            for (int k = 0; k < group; k++) {                                                 \
                vl xv;                                                                        \
                LOAD(xv, xt + (k0 + k) * L);                                                  \
                _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) acc[t] += buf[t][k] * xv; \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                                  \
            for (int c = 0; c < b; c++)                                                       \
                out[(long)c * v + j + t] = acc[t][c];                                         \
    }

/* Every kernel of one width, bit count and group size G, and the range's driver: one row
 * along each weight row, two rows two weight rows a step (T weight rows a step, for
 * independent accumulators), tiles beyond. */
#define KERNELS(SUFFIX, ATTR, W, BITS, BYTES, G)                                              \
    QSEQ(k1_##SUFFIX, ATTR, W, BITS, BYTES, G)                                                \
    QKERNEL(k2x2_##SUFFIX, ATTR, W, 2, 2, BITS, BYTES, G)                                     \
    QKERNEL(k2x1_##SUFFIX, ATTR, W, 2, 1, BITS, BYTES, G)                                     \
    QKERNEL(k4x2_##SUFFIX, ATTR, W, 4, 2, BITS, BYTES, G)                                     \
    QKERNEL(k4x1_##SUFFIX, ATTR, W, 4, 1, BITS, BYTES, G)                                     \
    QTILE(t8x8_##SUFFIX, ATTR, W, 8, 8, BITS, BYTES, G)                                       \
    QTILE(t8x1_##SUFFIX, ATTR, W, 8, 1, BITS, BYTES, G)                                       \
    QTILE(t16x8_##SUFFIX, ATTR, W, 16, 8, BITS, BYTES, G)                                     \
    QTILE(t16x1_##SUFFIX, ATTR, W, 16, 1, BITS, BYTES, G)                                     \
    static ATTR void range_##SUFFIX(const uint8_t *q, long h, const float *sc,                \
                                    const float *bi, const float *x, int lanes, float *out,   \
                                    long v, int b, long j0, long j1, float zmul)              \
    {                                                                                         \
        long groups = h / G, j = j0;                                                          \
        switch (lanes) {                                                                      \
        case 1:                                                                               \
            k1_##SUFFIX(q, h, sc, bi, x, out, j0, j1, zmul);                                  \
            break;                                                                            \
        CASE(k, 2, 2, SUFFIX)                                                                 \
        CASE(k, 4, 2, SUFFIX)                                                                 \
        CASE(t, 8, 8, SUFFIX)                                                                 \
        CASE(t, 16, 8, SUFFIX)                                                                \
        }                                                                                     \
    }
/* L input rows: the KIND (k: along the weight rows, t: tiles) kernel of T weight rows a step,
 * then one weight row at a time for the rest. */
#define CASE(KIND, L, T, SUFFIX)                                                              \
    case L:                                                                                   \
        for (; j + T <= j1; j += T)                                                           \
            KIND##L##x##T##_##SUFFIX(q, h, sc, bi, x, out, v, b, j, groups,                   \
                                     j + T + AHEAD_ROWS <= j1);                               \
        for (; j < j1; j++)                                                                   \
            KIND##L##x1_##SUFFIX(q, h, sc, bi, x, out, v, b, j, groups, 0);                   \
        break;

/* The kernels of one width and bit count for each group size, and the driver that picks by
 * the group: a constant group size unrolls a group's loads, where read at run time a 4-bit
 * group of 32 spent some 45 instructions on the 8 that multiply. */
#define WIDTH(SUFFIX, ATTR, W, BITS, BYTES)                                                   \
    KERNELS(SUFFIX##_g32, ATTR, W, BITS, BYTES, 32)                                           \
    KERNELS(SUFFIX##_g64, ATTR, W, BITS, BYTES, 64)                                           \
    KERNELS(SUFFIX##_g128, ATTR, W, BITS, BYTES, 128)                                         \
    static ATTR void range_##SUFFIX(const uint8_t *q, long h, int group, const float *sc,     \
                                    const float *bi, const float *x, int lanes, float *out,   \
                                    long v, int b, long j0, long j1, float zmul)              \
    {                                                                                         \
        (group == 32 ? range_##SUFFIX##_g32 : group == 64 ? range_##SUFFIX##_g64              \
                                                          : range_##SUFFIX##_g128)(           \
            q, h, sc, bi, x, lanes, out, v, b, j0, j1, zmul);                                 \
    }

/* A 4-bit load's lanes u as floats: lo, their low halves, and hi, their high ones. */
#define NIBBLES_4(u, lo, hi)                                                                  \
    (lo = __builtin_convertvector((u) & 15, vf), hi = __builtin_convertvector((u) >> 4, vf))
#define NIBBLES_8(u, lo, hi) NIBBLES_4(u, lo, hi)
/* QROW4: nibble k of each 32-bit lane of u as floats; a vector's scales from s, L lanes a
 * group (W = 4: every group is at least 4 lanes) */
#define NIBBLE_4(u, k) __builtin_convertvector((vi)(((u) >> (4 * (k))) & 15), vf)
#define NIBBLE_8(u, k) NIBBLE_4(u, k)
#define SCALES_4(s, L) ((vf){0} + *(s))
/* A vector's lanes summed as a tree: a chain of W dependent adds a weight row was as long as
 * a short row's products (1,024 weights: 8 blocks against 16 adds of 4 cycles each) */
#define HSUM_4(v) (((v)[0] + (v)[2]) + ((v)[1] + (v)[3]))
/* out[0..8) = the 8 codes at c times the factor f */
#define CODES_4(out, c, f)                                                                    \
    for (int i_ = 0; i_ < SUPER_GROUPS; i_++)                                                 \
        (out)[i_] = (f) * (c)[i_];

#if defined(__x86_64__) && defined(__GNUC__) && !defined(MLXR_QUANT_GENERIC)
#define X86 1
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define AVX2 __attribute__((target("avx2,fma")))
#include <immintrin.h>
#define BYTES16(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define BYTES8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
/* AVX-512: a lookup of 0..15 as floats by each lane's low 4 bits (vpermps reads no others),
 * where the AND and the conversion took two instructions */
#define NIBBLES_16(u, lo, hi)                                                                 \
    (lo = (vf)_mm512_permutexvar_ps((__m512i)(u), NIBBLE_VALUES),                             \
     hi = (vf)_mm512_permutexvar_ps((__m512i)((u) >> 4), NIBBLE_VALUES))
#define NIBBLE_16(u, k) ((vf)_mm512_permutexvar_ps((__m512i)((u) >> (4 * (k))), NIBBLE_VALUES))
#define SCALES_16(s, L)                                                                       \
    ((L) >= 16 ? (vf){0} + *(s)                                                               \
     : (L) == 8                                                                               \
         ? (vf)_mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, \
                                                       1, 1),                                 \
                                     _mm512_castps128_ps512(TWO_FLOATS(s)))                   \
         : (vf)_mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, \
                                                       3, 3),                                 \
                                     _mm512_castps128_ps512(_mm_loadu_ps(s))))
#define SCALES_8(s, L)                                                                        \
    ((L) >= 8 ? (vf){0} + *(s)                                                                \
     : (vf)_mm256_permutevar8x32_ps(_mm256_castps128_ps256(TWO_FLOATS(s)),                   \
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)))
#define TWO_FLOATS(s) _mm_castpd_ps(_mm_load_sd((const double *)(s)))
#define HSUM_16(v) _mm512_reduce_add_ps((__m512)(v))
#define HSUM_8(v) hsum8((__m256)(v))
static inline __attribute__((target("avx2,fma"))) float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define CODES_16(out, c, f)                                                                   \
    _mm256_storeu_ps((out), _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(            \
                                              _mm_loadl_epi64((const __m128i *)(c)))),        \
                                          _mm256_set1_ps(f)))
#define CODES_8(out, c, f) CODES_16(out, c, f)
#define NIBBLE_VALUES                                                                         \
    _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
WIDTH(w16b8, AVX512, 16, 8, BYTES16)
WIDTH(w16b4, AVX512, 16, 4, BYTES16)
ROW4(w16, AVX512, 16)
QSEQ_SUPER(super8_w16, AVX512, 16, BYTES16)
WIDTH(w8b8, AVX2, 8, 8, BYTES8)
WIDTH(w8b4, AVX2, 8, 4, BYTES8)
ROW4(w8, AVX2, 8)
QSEQ_SUPER(super8_w8, AVX2, 8, BYTES8)
#else
#define X86 0
#endif
/* Four bytes as four int32 lanes (GCC's own conversion from a byte vector was one lane at a
 * time, even for AVX-512). */
#define BYTES4(p) ((vi){(p)[0], (p)[1], (p)[2], (p)[3]})
WIDTH(w4b8, , 4, 8, BYTES4)
WIDTH(w4b4, , 4, 4, BYTES4)
ROW4(w4, , 4)
QSEQ_SUPER(super8_w4, , 4, BYTES4)

static int width; /* the copy in use: 16, 8 or 4 floats a vector; 0 until chosen */

/* Use the widest copy of at most `want` floats a vector this CPU runs (the tests take each
 * in turn); returns the width now in use. */
int mlxr_quant_use_width(int want)
{
    (void)want;
    width = 4;
#if X86
    __builtin_cpu_init();
    if (want >= 16 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        width = 16;
    else if (want >= 8 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        width = 8;
#endif
    return width;
}

/* The vector width in use, the widest this CPU runs unless a test chose another. */
int mlxr_quant_width(void)
{
    return width ? width : mlxr_quant_use_width(16);
}

/* out[c * v + j] for rows c < b and weight rows j0 <= j < j1. q: (v, h * bits / 8) bytes;
 * scales, biases: (v, h / group) float32, group 32, 64 or 128. x: float32, for lanes 1, 2 or
 * 4 (lanes, h), for 8 or 16 (h, lanes); rows past b zero; for 4 bits the
 * positions in the even/odd block order above. Each bias is read as biases[...] * zmul: 1,
 * or for one row (lanes 1) of a weight whose biases are a multiple of its scales (a GGUF
 * Q8_0, Q4_0 or Q5_0 import's: -128, -8, -16 times the scale), biases = scales and zmul that
 * multiple, so the biases' bytes are not read (runner/quant_kernel.py `QuantizedWeight.offset`;
 * exact: the product is the float32 bias). Returns 0, or -1 for arguments it does not take. */
static int refused(int bits, long h, int group, int lanes, long v, int b, long j0, long j1,
                   float zmul)
{
    return (bits != 4 && bits != 8) || (group != 32 && group != 64 && group != 128) ||
           h < group || h % group || b < 1 || b > lanes || (lanes & (lanes - 1)) ||
           lanes > 16 || j0 < 0 || j1 > v || j0 > j1 || (zmul != 1.0f && lanes != 1);
}

int mlxr_quant_rows(const uint8_t *q, int bits, long h, int group, const float *scales,
                    const float *biases, const float *x, int lanes, float *out, long v, int b,
                    long j0, long j1, float zmul)
{
    if (refused(bits, h, group, lanes, v, b, j0, j1, zmul))
        return -1;
#if X86
    int copy = mlxr_quant_width();
    if (bits == 4 && lanes == 1 && h % ROW4_BLOCK == 0) {
        (copy == 16 ? row4_w16 : copy == 8 ? row4_w8 : row4_w4)(q, h, group, scales, biases, x,
                                                               out, j0, j1, zmul);
        return 0;
    }
    if (copy == 16) {
        (bits == 8 ? range_w16b8 : range_w16b4)(q, h, group, scales, biases, x, lanes, out, v,
                                                b, j0, j1, zmul);
        return 0;
    }
    if (copy == 8) {
        (bits == 8 ? range_w8b8 : range_w8b4)(q, h, group, scales, biases, x, lanes, out, v, b,
                                              j0, j1, zmul);
        return 0;
    }
#else
    if (bits == 4 && lanes == 1 && h % ROW4_BLOCK == 0) {
        row4_w4(q, h, group, scales, biases, x, out, j0, j1, zmul);
        return 0;
    }
#endif
    (bits == 8 ? range_w4b8 : range_w4b4)(q, h, group, scales, biases, x, lanes, out, v, b, j0,
                                          j1, zmul);
    return 0;
}

/* --- the same product split across threads -------------------------------------------
 *
 * A decode step of one row is some 150 products of under a megabyte each. Handing half of one
 * to a Python thread pool costs more than it saves (the 147M model's body: 20.6 ms split that
 * way, 9.3 ms on one thread), so the split is made here: workers that spin for SPIN_NS after
 * each piece, waiting for the next, and then sleep on a condition variable. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_WORKERS 15
#define SPIN_NS 200000L /* a step's products come every few tens of microseconds */
#if defined(__x86_64__) || defined(__i386__)
#define PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define PAUSE() __asm__ volatile("yield")
#else
#define PAUSE() ((void)0)
#endif

/* A job: fn(args, a, z) for the range [a, z) of its rows. The workers also run other
 * libraries' kernels (`mlxr_parts`): one pool, so no second set of threads spins beside
 * these on the same cores. */
typedef void (*job_fn)(const void *args, long a, long z);

typedef struct {
    job_fn fn;
    const void *args;
    long a, z;
} piece_t;

static struct worker {
    pthread_t thread;
    piece_t piece;
    atomic_long posted, done;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int sleeping;
} workers[MAX_WORKERS];
static int started; /* workers running */
static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t caller_mu = PTHREAD_MUTEX_INITIALIZER; /* one caller has the workers */

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void run_piece(const piece_t *p)
{
    p->fn(p->args, p->a, p->z);
}

static void *work(void *arg)
{
    struct worker *w = arg;
    long seen = 0;
    for (;;) {
        long deadline = now_ns() + SPIN_NS;
        for (int spins = 1; atomic_load_explicit(&w->posted, memory_order_acquire) == seen;
             spins++) {
            if (spins % 64 == 0 && now_ns() > deadline) {
                pthread_mutex_lock(&w->mu);
                w->sleeping = 1;
                while (atomic_load_explicit(&w->posted, memory_order_acquire) == seen)
                    pthread_cond_wait(&w->cv, &w->mu);
                w->sleeping = 0;
                pthread_mutex_unlock(&w->mu);
                break;
            }
            PAUSE();
        }
        seen = atomic_load_explicit(&w->posted, memory_order_acquire);
        run_piece(&w->piece);
        atomic_store_explicit(&w->done, seen, memory_order_release);
    }
    return NULL;
}

static void forget_workers(void) /* a forked child has none of its parent's threads */
{
    started = 0;
    pthread_mutex_init(&start_mu, NULL);
    pthread_mutex_init(&caller_mu, NULL);
}

/* Workers for up to `n` pieces beside the caller's; returns how many there are. */
static int start_workers(int n)
{
    static int registered;
    if (n > MAX_WORKERS)
        n = MAX_WORKERS;
    if (started >= n)
        return n;
    pthread_mutex_lock(&start_mu);
    if (!registered)
        registered = !pthread_atfork(NULL, NULL, forget_workers);
    while (started < n) {
        struct worker *w = &workers[started];
        atomic_store(&w->posted, 0);
        atomic_store(&w->done, 0);
        w->sleeping = 0;
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&w->thread, &attr, work, w);
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        started++;
    }
    n = started < n ? started : n;
    pthread_mutex_unlock(&start_mu);
    return n;
}

/* fn over the ranges bounds[i] .. bounds[i + 1], i < parts: all but the last on the
 * workers, the last on the calling thread; returns once every range is done. The caller
 * holds caller_mu and has started parts - 1 workers. */
static void run_parts(job_fn fn, const void *args, const long *bounds, int parts)
{
    long posted[MAX_WORKERS];
    for (int i = 0; i < parts - 1; i++) {
        struct worker *w = &workers[i];
        w->piece = (piece_t){fn, args, bounds[i], bounds[i + 1]};
        posted[i] = atomic_load_explicit(&w->posted, memory_order_relaxed) + 1;
        atomic_store_explicit(&w->posted, posted[i], memory_order_release);
        pthread_mutex_lock(&w->mu);
        if (w->sleeping)
            pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
    fn(args, bounds[parts - 1], bounds[parts]);
    for (int i = 0; i < parts - 1; i++)
        while (atomic_load_explicit(&workers[i].done, memory_order_acquire) != posted[i])
            PAUSE();
}

/* The workers, for up to `parts` ranges with the calling thread: how many ranges to make
 * (1 where another thread has them, or none start). With more than one, the caller holds
 * caller_mu and releases it after `run_parts`. */
static int take_workers(int parts)
{
    if (parts <= 1 || pthread_mutex_trylock(&caller_mu) != 0)
        return 1;
    parts = start_workers(parts - 1) + 1;
    if (parts <= 1)
        pthread_mutex_unlock(&caller_mu);
    return parts;
}

typedef struct {
    const uint8_t *q;
    const float *scales, *biases, *x;
    float *out;
    long h, v;
    int bits, group, lanes, b;
    float zmul;
} rows_args;

static void rows_job(const void *args, long j0, long j1)
{
    const rows_args *p = args;
    mlxr_quant_rows(p->q, p->bits, p->h, p->group, p->scales, p->biases, p->x, p->lanes,
                    p->out, p->v, p->b, j0, j1, p->zmul);
}

/* fn over [j0, j1) in up to `parts` ranges (multiples of 8 weight rows), all but the last on
 * the workers, the last on the calling thread; returns once every range is done. Fewer parts
 * where threads cannot be started. */
static void rows_in_parts(job_fn fn, const void *args, long j0, long j1, int parts)
{
    long tiles = (j1 - j0 + 7) / 8;
    if (parts > tiles)
        parts = (int)tiles;
    if ((parts = take_workers(parts)) <= 1) {
        fn(args, j0, j1);
        return;
    }
    long bounds[MAX_WORKERS + 2];
    for (int i = 0; i < parts; i++)
        bounds[i] = j0 + tiles * i / parts * 8;
    bounds[parts] = j1;
    run_parts(fn, args, bounds, parts);
    pthread_mutex_unlock(&caller_mu);
}

/* `mlxr_quant_rows` over [j0, j1) in up to `parts` ranges (`rows_in_parts`). */
int mlxr_quant_rows_parts(const uint8_t *q, int bits, long h, int group, const float *scales,
                          const float *biases, const float *x, int lanes, float *out, long v,
                          int b, long j0, long j1, int parts, float zmul)
{
    if (refused(bits, h, group, lanes, v, b, j0, j1, zmul))
        return -1;
    rows_args args = {q, scales, biases, x, out, h, v, bits, group, lanes, b, zmul};
    rows_in_parts(rows_job, &args, j0, j1, parts);
    return 0;
}

/* One row times a 4- or 8-bit weight in groups of 32 whose scales and biases come in
 * super-blocks of SUPER_GROUPS groups (runner/quant_kernel.py `SuperScales`, a Q4_K or Q5_K
 * import's own form): codes (v, 2 * groups) bytes, each row's scale codes then its bias codes;
 * factors (v, 2 * supers) float32, each row's scale factors then its bias factors. Group g's
 * scale is factors[g / 8] * codes[g], its bias factors[supers + g / 8] * codes[groups + g].
 * x (1, h), for 4 bits in QROW4's order; out[j] for j0 <= j < j1, split as
 * `mlxr_quant_rows_parts` splits. Returns 0, or -1 for arguments it does not take (h not a
 * multiple of 256, bits not 4 or 8). */
typedef struct {
    const uint8_t *q, *codes;
    const float *factors, *x;
    float *out;
    long h;
    int bits;
} super_args;

typedef void (*super_kernel)(const uint8_t *q, long h, const uint8_t *codes,
                             const float *factors, const float *x, float *out, long j0, long j1);

static void super_job(const void *args, long j0, long j1)
{
    const super_args *p = args;
    super_kernel fn = p->bits == 8 ? super8_w4 : super_w4;
#if X86
    int copy = mlxr_quant_width();
    if (copy == 16)
        fn = p->bits == 8 ? super8_w16 : super_w16;
    else if (copy == 8)
        fn = p->bits == 8 ? super8_w8 : super_w8;
#endif
    fn(p->q, p->h, p->codes, p->factors, p->x, p->out, j0, j1);
}

int mlxr_quant_super_parts(const uint8_t *q, int bits, long h, const uint8_t *codes,
                           const float *factors, const float *x, float *out, long v, long j0,
                           long j1, int parts)
{
    if ((bits != 4 && bits != 8) || h < 32 * SUPER_GROUPS || h % (32 * SUPER_GROUPS) ||
        j0 < 0 || j1 > v || j0 > j1)
        return -1;
    super_args args = {q, codes, factors, x, out, h, bits};
    rows_in_parts(super_job, &args, j0, j1, parts);
    return 0;
}

/* Several one-row products in one call, split across the workers as one range of rows: a
 * mixture of experts' chosen experts for one token (runner/host_moe.py), each product of under
 * a megabyte, where a call and a hand-off each (8-11 us) were a tenth of a decode step. Item i
 * is x_i times weight i's rows [0, v_i), as `mlxr_quant_rows` makes it with one lane (kind 0:
 * scales, biases, zmul) or `mlxr_quant_super_parts` (kind 1: scales holds the codes, biases
 * the factors); each x_i in the order that product reads. The fields are 64-bit, as
 * runner/quant_kernel.py `QuantKernel.many` fills them. Returns 0, or -1 (and computes
 * nothing) where any item is one those functions refuse. */
#define MANY_MAX 256
typedef struct {
    int64_t q, scales, biases, x, out; /* addresses */
    int64_t h, v, bits, group, kind, zmul;
} many_item;

typedef struct {
    const many_item *items;
    const long *starts; /* item i's rows are [starts[i], starts[i] + v_i) of the whole range */
    int n;
} many_args;

static void many_job(const void *args, long a, long z)
{
    const many_args *p = args;
    for (int i = 0; i < p->n; i++) {
        const many_item *it = &p->items[i];
        const long s = p->starts[i], e = s + it->v;
        if (e <= a || s >= z)
            continue;
        const long j0 = (a > s ? a : s) - s, j1 = (z < e ? z : e) - s;
        if (it->kind == 1) {
            super_args sa = {(const uint8_t *)it->q, (const uint8_t *)it->scales,
                             (const float *)it->biases, (const float *)it->x,
                             (float *)it->out, it->h, (int)it->bits};
            super_job(&sa, j0, j1);
        } else {
            mlxr_quant_rows((const uint8_t *)it->q, (int)it->bits, it->h, (int)it->group,
                            (const float *)it->scales, (const float *)it->biases,
                            (const float *)it->x, 1, (float *)it->out, it->v, 1, j0, j1,
                            (float)it->zmul);
        }
    }
}

int mlxr_quant_many(const many_item *items, int n, int parts)
{
    long starts[MANY_MAX + 1];
    if (n < 1 || n > MANY_MAX)
        return -1;
    starts[0] = 0;
    for (int i = 0; i < n; i++) {
        const many_item *it = &items[i];
        const int bits = (int)it->bits;
        if (it->kind == 1 ? (bits != 4 && bits != 8) || it->h < 32 * SUPER_GROUPS ||
                                it->h % (32 * SUPER_GROUPS) || it->v < 1
                          : it->kind != 0 || refused(bits, it->h, (int)it->group, 1, it->v, 1,
                                                     0, it->v, (float)it->zmul))
            return -1;
        starts[i + 1] = starts[i] + (it->v + 7) / 8 * 8; /* each item's rows from a tile on */
    }
    many_args args = {items, starts, n};
    rows_in_parts(many_job, &args, 0, starts[n], parts);
    return 0;
}

/* fn(args, a, z) over [0, n) in up to `parts` nearly equal ranges, on these workers and the
 * calling thread: for another library's kernel to share this pool (runner/kv/attend_kernel.py
 * splits a layer's key heads so). Where another thread has the workers, the caller runs
 * fn(args, 0, n) alone. */
void mlxr_parts(job_fn fn, const void *args, long n, int parts)
{
    if (parts > n)
        parts = (int)n;
    if ((parts = take_workers(parts)) <= 1) {
        fn(args, 0, n);
        return;
    }
    long bounds[MAX_WORKERS + 2];
    for (int i = 0; i <= parts; i++)
        bounds[i] = n * i / parts;
    run_parts(fn, args, bounds, parts);
    pthread_mutex_unlock(&caller_mu);
}

/* Rows j0 <= j < j1 of the weight dequantized into out, (v, h) float32, in MLX's order and
 * with MLX's arithmetic (scale * q, then + bias): for a prefill chunk's many rows, whose
 * products go to BLAS. Returns 0, or -1 for arguments it does not take. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off"))) /* two roundings, as MLX's: never fused */
#endif
int mlxr_quant_dequantize(const uint8_t *q, int bits, long h, int group, const float *scales,
                          const float *biases, float *out, long j0, long j1)
{
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
    if ((bits != 4 && bits != 8) || group < 2 || group % 2 || h % group || j0 < 0 || j0 > j1)
        return -1;
    const long rowbytes = h * bits / 8, groups = h / group;
    for (long j = j0; j < j1; j++) {
        const uint8_t *row = q + j * rowbytes;
        float *o = out + j * h;
        for (long g = 0; g < groups; g++) {
            const float s = scales[j * groups + g], z = biases[j * groups + g];
            if (bits == 8) {
                for (long k = g * group; k < (g + 1) * group; k++) {
                    float w = row[k] * s;
                    o[k] = w + z;
                }
            } else {
                for (long k = g * group / 2; k < (g + 1) * group / 2; k++) {
                    float lo = (row[k] & 15) * s, hi = (row[k] >> 4) * s;
                    o[2 * k] = lo + z;
                    o[2 * k + 1] = hi + z;
                }
            }
        }
    }
    return 0;
}

/* Codes c (0..63) with c[k] * factor == v[k] exactly for a block v of SUPER_GROUPS floats,
 * factor not 0: 1 and c written, or 0. In float32 as numpy's would be, rounding as rintf
 * without a libm call. */
static int exact_codes(const float *v, float factor, uint8_t *c)
{
    float r[SUPER_GROUPS];
    int ok = 1;
    for (int k = 0; k < SUPER_GROUPS; k++) {
        const float f = v[k] / factor;
        r[k] = (f + 0x1p23f) - 0x1p23f; /* to nearest, ties to even, for 0 <= f < 2^23 */
        ok &= (f >= 0.0f) & (f <= 63.5f) & (r[k] <= 63.0f) & (r[k] * factor == v[k]);
    }
    if (!ok) /* also a NaN, or f out of range */
        return 0;
    for (int k = 0; k < SUPER_GROUPS; k++)
        c[k] = (uint8_t)r[k];
    return 1;
}

/* `mlxr_quant_factored` for blocks [a, z): 0, or -1 at the first block with no such form. */
static int factored_range(const float *values, long a, long z, float *factors, uint8_t *codes)
{
    for (long i = a; i < z; i++) {
        const float *v = values + i * SUPER_GROUPS;
        uint8_t *c = codes + i * SUPER_GROUPS;
        float most = 0.0f, top = 0.0f; /* without branches: the largest's place is random */
        for (int k = 0; k < SUPER_GROUPS; k++)
            most = __builtin_fabsf(v[k]) > most ? __builtin_fabsf(v[k]) : most;
        for (int k = SUPER_GROUPS - 1; k >= 0; k--)
            top = __builtin_fabsf(v[k]) == most ? v[k] : top;
        if (top == 0.0f) {
            for (int k = 0; k < SUPER_GROUPS; k++)
                if (!(v[k] == 0.0f)) /* a NaN is not */
                    return -1;
            memset(c, 0, SUPER_GROUPS);
            factors[i] = 0.0f;
            continue;
        }
        int code = 63;
        while (!exact_codes(v, top / (float)code, c))
            if (--code < 1)
                return -1;
        factors[i] = top / (float)code;
    }
    return 0;
}

typedef struct {
    const float *values;
    float *factors;
    uint8_t *codes;
    atomic_int failed;
} factored_args;

static void factored_job(const void *args, long a, long z)
{
    factored_args *p = (factored_args *)args;
    if (factored_range(p->values, a, z, p->factors, p->codes) != 0)
        atomic_store(&p->failed, 1);
}

/* n blocks of SUPER_GROUPS floats (a Q4_K import's scales or biases, each row's in order) as
 * factors[i] * codes[i * SUPER_GROUPS + k], codes in 0..63, equal to the floats exactly
 * (runner/quant_kernel.py `SuperScales`), in up to `parts` ranges on the workers. The factor
 * is the block's value of largest magnitude (the first such) over its code: 63 from
 * llama.cpp's plain quantizer, lower ones (an importance-weighted quantizer's) tried down to
 * 1. An all-zero block is factor 0, codes 0. Returns 0, or -1 where some block has no such
 * form (the outputs then partly written). */
int mlxr_quant_factored(const float *values, long n, float *factors, uint8_t *codes, int parts)
{
    if (n < 0)
        return -1;
    factored_args args = {values, factors, codes, 0};
    rows_in_parts(factored_job, &args, 0, n, parts);
    return atomic_load(&args.failed) ? -1 : 0;
}

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    long depth;
    int bits, wide;
} repack_args;

/* One row of REPACK's: every 8 fields of `bits` bits fill `bits` bytes, read as one
 * little-endian word (MLX's layout, and these hosts' byte order); a constant `bits` makes
 * the copy and the shifts plain loads and immediates. */
#define REPACK_ROW(BITS, WIDE, s, d, depth)                                                   \
    for (long i = 0; i < (depth) / 8; i++) {                                                  \
        uint64_t w = 0;                                                                       \
        memcpy(&w, (s) + i * (BITS), BITS);                                                   \
        uint8_t v[8];                                                                         \
        for (int k = 0; k < 8; k++)                                                           \
            v[k] = (uint8_t)((w >> ((BITS) * k)) & ((1u << (BITS)) - 1));                     \
        if ((WIDE) == 8)                                                                      \
            memcpy((d) + 8 * i, v, 8);                                                        \
        else                                                                                  \
            for (int k = 0; k < 4; k++)                                                       \
                (d)[4 * i + k] = (uint8_t)(v[2 * k] | (v[2 * k + 1] << 4));                   \
    }

static void repack_job(const void *args, long j0, long j1)
{
    const repack_args *p = args;
    const long from = p->depth * p->bits / 8, to = p->depth * p->wide / 8;
    for (long j = j0; j < j1; j++) {
        const uint8_t *s = p->src + j * from;
        uint8_t *d = p->dst + j * to;
        switch (p->bits) {
        case 2: REPACK_ROW(2, 4, s, d, p->depth); break;
        case 3: REPACK_ROW(3, 4, s, d, p->depth); break;
        case 5: REPACK_ROW(5, 8, s, d, p->depth); break;
        default: REPACK_ROW(6, 8, s, d, p->depth); break;
        }
    }
}

/* v rows of an MLX `bits`-bit weight (2, 3, 5 or 6; depth a multiple of 8) into `wide`-bit
 * fields (4 for 2 or 3 bits, 8 for 5 or 6), the same values: runner/repack.py. In up to
 * `parts` ranges on the workers. Returns 0, or -1 for arguments it does not take. */
int mlxr_quant_repack(const uint8_t *src, int bits, long v, long depth, uint8_t *dst, int wide,
                      int parts)
{
    if (v < 0 || depth < 8 || depth % 8 || !((wide == 4 && (bits == 2 || bits == 3)) ||
                                             (wide == 8 && (bits == 5 || bits == 6))))
        return -1;
    repack_args args = {src, dst, depth, bits, wide};
    rows_in_parts(repack_job, &args, 0, v, parts);
    return 0;
}
