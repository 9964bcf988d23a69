/* The plain cblas_* entry points MLX's CPU backend calls (and the sgemv the runner's host
 * head calls), forwarding to an OpenBLAS built with the `scipy_` symbol prefix: the
 * DYNAMIC_ARCH library of the scipy-openblas32 wheel, which picks its kernels for the CPU
 * it runs on. Built on demand by shared/blas.py, linked to that library by path.
 * CBLAS enums are passed as int, as in OpenBLAS's cblas.h; blasint is 32-bit (LP64). */
typedef int blasint;

extern void scipy_cblas_sgemm(int, int, int, blasint, blasint, blasint, float, const float *,
                              blasint, const float *, blasint, float, float *, blasint);
extern void scipy_cblas_dgemm(int, int, int, blasint, blasint, blasint, double, const double *,
                              blasint, const double *, blasint, double, double *, blasint);
extern void scipy_cblas_cgemm(int, int, int, blasint, blasint, blasint, const void *,
                              const void *, blasint, const void *, blasint, const void *,
                              void *, blasint);
extern void scipy_cblas_sgemv(int, int, blasint, blasint, float, const float *, blasint,
                              const float *, blasint, float, float *, blasint);
extern char *scipy_openblas_get_config(void);
extern char *scipy_openblas_get_corename(void);

void cblas_sgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, float alpha,
                 const float *a, blasint lda, const float *b, blasint ldb, float beta,
                 float *c, blasint ldc)
{
    scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, blasint m, blasint n, blasint k, double alpha,
                 const double *a, blasint lda, const double *b, blasint ldb, double beta,
                 double *c, blasint ldc)
{
    scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, blasint m, blasint n, blasint k,
                 const void *alpha, const void *a, blasint lda, const void *b, blasint ldb,
                 const void *beta, void *c, blasint ldc)
{
    scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_sgemv(int order, int trans, blasint m, blasint n, float alpha, const float *a,
                 blasint lda, const float *x, blasint incx, float beta, float *y, blasint incy)
{
    scipy_cblas_sgemv(order, trans, m, n, alpha, a, lda, x, incx, beta, y, incy);
}

char *openblas_get_config(void) { return scipy_openblas_get_config(); }
char *openblas_get_corename(void) { return scipy_openblas_get_corename(); }
