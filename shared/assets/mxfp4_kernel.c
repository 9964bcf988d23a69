/* One row times MLX mxfp4 weights (runner/mxfp4_kernel.py): a decode step's product with the
 * experts a token chose, read as stored (4.25 bits a weight).
 *
 * A weight row is `cols` E2M1 codes, two a byte, the even element in the low nibble (MLX's
 * packing), and one exponent byte e a group of 32: value = E2M1[code] * 2^(e - 127).
 * `mlxr_mxfp4_rows` computes out[r] = sum_c W[r][c] * x[c] for rows [begin, end) of each of
 * `n` weights (one call for a token's experts and projections).
 *
 * The row's x is split once into its even and odd elements (`xs`, 2 x cols floats, given by
 * the caller), so a group's 16 code bytes become its even values (low nibbles) and odd values
 * (high nibbles) through a 16-entry table, each multiplied with its half of x. AVX-512: the
 * table is one register (vpermps); AVX2: two, blended on the code's top bit; elsewhere plain C.
 * The variant is chosen at run time from what the CPU reports, so one build runs on every
 * x86-64 machine.
 */
#include <stdint.h>
#include <string.h>

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static float scale_of(uint8_t e) {
    /* 2^(e - 127): the float with that exponent field; e = 0 is the subnormal 2^-127 */
    if (e == 0) return 0x1p-127f;
    uint32_t bits = (uint32_t)e << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void rows_generic(const uint8_t *q, const uint8_t *e, const float *xs, float *out,
                         int begin, int end, int cols) {
    const float *xe = xs, *xo = xs + cols / 2;
    for (int r = begin; r < end; r++) {
        const uint8_t *qr = q + (size_t)r * (cols / 2);
        const uint8_t *er = e + (size_t)r * (cols / 32);
        float acc = 0.0f;
        for (int g = 0; g < cols / 32; g++) {
            float sum = 0.0f;
            for (int i = 0; i < 16; i++) {
                uint8_t b = qr[g * 16 + i];
                sum += E2M1[b & 15] * xe[g * 16 + i] + E2M1[b >> 4] * xo[g * 16 + i];
            }
            acc += sum * scale_of(er[g]);
        }
        out[r] = acc;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define X86 1

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
static void rows_avx512(const uint8_t *q, const uint8_t *e, const float *xs, float *out,
                        int begin, int end, int cols) {
    const float *xe = xs, *xo = xs + cols / 2;
    const __m512 table = _mm512_loadu_ps(E2M1);
    const __m512i low = _mm512_set1_epi32(15);
    const int groups = cols / 32;
    for (int r = begin; r < end; r++) {
        const uint8_t *qr = q + (size_t)r * (cols / 2);
        const uint8_t *er = e + (size_t)r * groups;
        __m512 acc = _mm512_setzero_ps();
        for (int g = 0; g < groups; g++) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qr + g * 16)));
            __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(b, low), table);
            __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
            __m512 sum = _mm512_mul_ps(even, _mm512_loadu_ps(xe + g * 16));
            sum = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xo + g * 16), sum);
            acc = _mm512_fmadd_ps(sum, _mm512_set1_ps(scale_of(er[g])), acc);
        }
        out[r] = _mm512_reduce_add_ps(acc);
    }
}

__attribute__((target("avx2,fma")))
static __m256 lookup8(__m256i codes, __m256 lo, __m256 hi) {
    /* codes 0..15: the table's first 8 entries or its last 8, by bit 3 */
    __m256 a = _mm256_permutevar8x32_ps(lo, codes);
    __m256 b = _mm256_permutevar8x32_ps(hi, codes);
    __m256 top = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)); /* bit 3 -> sign bit */
    return _mm256_blendv_ps(a, b, top);
}

__attribute__((target("avx2,fma")))
static void rows_avx2(const uint8_t *q, const uint8_t *e, const float *xs, float *out,
                      int begin, int end, int cols) {
    const float *xe = xs, *xo = xs + cols / 2;
    const __m256 lo = _mm256_loadu_ps(E2M1), hi = _mm256_loadu_ps(E2M1 + 8);
    const __m256i low = _mm256_set1_epi32(15);
    const int groups = cols / 32;
    for (int r = begin; r < end; r++) {
        const uint8_t *qr = q + (size_t)r * (cols / 2);
        const uint8_t *er = e + (size_t)r * groups;
        __m256 acc = _mm256_setzero_ps();
        for (int g = 0; g < groups; g++) {
            __m256 sum = _mm256_setzero_ps();
            for (int h = 0; h < 2; h++) {
                __m256i b = _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(qr + g * 16 + h * 8)));
                __m256 even = lookup8(_mm256_and_si256(b, low), lo, hi);
                __m256 odd = lookup8(_mm256_srli_epi32(b, 4), lo, hi);
                sum = _mm256_fmadd_ps(even, _mm256_loadu_ps(xe + g * 16 + h * 8), sum);
                sum = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xo + g * 16 + h * 8), sum);
            }
            acc = _mm256_fmadd_ps(sum, _mm256_set1_ps(scale_of(er[g])), acc);
        }
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        out[r] = _mm_cvtss_f32(s);
    }
}
#else
#define X86 0
#endif

typedef void (*rows_fn)(const uint8_t *, const uint8_t *, const float *, float *, int, int, int);

static rows_fn pick(int want) {
#if X86
    if (want >= 16 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return rows_avx512;
    if (want >= 8 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return rows_avx2;
#endif
    (void)want;
    return rows_generic;
}

/* The widest variant this CPU runs, at most `want` lanes (16, 8, or 1 for plain C). */
int mlxr_mxfp4_width(int want) {
    rows_fn f = pick(want);
#if X86
    if (f == rows_avx512) return 16;
    if (f == rows_avx2) return 8;
#endif
    return 1;
}

/* For each job j: out_j[r] = W_j[r] . x_j for r in [begins[j], ends[j]), W_j = (q_j, e_j) of
 * `cols[j]` columns, x_j given split (`xs_j`: its even elements, then its odd ones). */
void mlxr_mxfp4_rows(int n, const uint8_t *const *q, const uint8_t *const *e,
                     const float *const *xs, float *const *out, const int *begins,
                     const int *ends, const int *cols, int want) {
    rows_fn f = pick(want);
    for (int j = 0; j < n; j++) f(q[j], e[j], xs[j], out[j], begins[j], ends[j], cols[j]);
}
