/* Sequential Mamba-2 SSD scan, forward and backward, fp32, for bench/bench_scan_alternatives.py only (not
 * used by remodel). The recurrence s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T, y_t = s_t C_t + D x_t is run
 * head by head over chunks of Q steps: every [1 x 64] tile of a head's state stays in registers while it
 * runs through the chunk's B and C (packed contiguous, they stay in cache); per-step dot products are
 * kept as 8-lane partials and reduced after the tile. The backward recomputes a chunk's states per tile
 * from the state saved at the chunk's start (ckpt) and runs the adjoint recurrence in reverse.
 * Layout: time-major; x, y, dy rows [H, P], B and C rows [G, N] with the given row strides (floats);
 * N must be a multiple of 8. Built by the bench with `cc -O3 -march=native -shared -fPIC`. */
#include <math.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
#define LD(p) (*(const v8u *)(p))
#define ST(p, v) (*(v8u *)(p) = (v))
#define INL static inline __attribute__((always_inline))

INL void pack(int n, int N, const float *src, long stride, float *dst) {
    for (int t = 0; t < n; t++) memcpy(dst + (long)t * N, src + t * stride, sizeof(float) * N);
}
INL float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
INL v8 bc(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* Forward of one state tile (row i, columns j0 .. j0 + 8*VW) of one head over n steps: the tile lives in
 * registers; B and C columns stream from cache. pv[t] (8 lanes) gets the tile's partial dot with C_t
 * (added when add != 0); the caller reduces it to y after the row's last tile. */
INL void fwd_tile(const int VW, int n, const float *aT, const float *xd, const float *B, long bs,
                  const float *C, long cs, float *pv, int add, float *s) {
    v8 st[8];
#pragma GCC unroll 8
    for (int v = 0; v < VW; v++) st[v] = LD(s + 8 * v);
    for (int t = 0; t < n; t++) {
        v8 a = bc(aT[t]), x = bc(xd[t]);
        const float *Bt = B + t * bs, *Ct = C + t * cs;
        v8 acc0 = bc(0.0f), acc1 = bc(0.0f);
#pragma GCC unroll 8
        for (int v = 0; v < VW; v++) {
            st[v] = a * st[v] + x * LD(Bt + 8 * v);
            if (v & 1) acc1 += st[v] * LD(Ct + 8 * v); else acc0 += st[v] * LD(Ct + 8 * v);
        }
        if (add) ST(pv + 8 * t, LD(pv + 8 * t) + acc0 + acc1); else ST(pv + 8 * t, acc0 + acc1);
    }
#pragma GCC unroll 8
    for (int v = 0; v < VW; v++) ST(s + 8 * v, st[v]);
}

/* Heads h0..h1-1 over steps 0..T-1, chunk by chunk (Q steps: their B, C, x stay in cache while every row
 * tile of the state runs through them). ckpt [ceil(T/Q), H, P, N] gets the state entering each chunk.
 * work: 2Q + 2QN + 8Q floats (aT, xd, packed B/C, partials). */
void ssd_fwd(int T, int H, int P, int G, int N, int Q, const float *x, long xs, const float *dt, long dts,
             const float *A, const float *D, const float *B, long bs, const float *C, long cs, float *y, long ys,
             float *state, float *ckpt, float *work, int h0, int h1) {
    int r = H / G, nck = (T + Q - 1) / Q;
    long PN = (long)P * N;
    float *aT = work, *xd = work + Q, *Bp = xd + Q, *Cp = Bp + (long)Q * N, *pv = Cp + (long)Q * N;
    for (int hh = h0; hh < h1; hh++) {
        int gi = hh / r;
        float Dh = D ? D[hh] : 0.0f;
        for (int k = 0; k < nck; k++) {
            int t0 = k * Q, n = (t0 + Q < T ? Q : T - t0);
            if (ckpt) memcpy(ckpt + ((long)k * H + hh) * PN, state + hh * PN, sizeof(float) * PN);
            pack(n, N, B + t0 * bs + (long)gi * N, bs, Bp);
            pack(n, N, C + t0 * cs + (long)gi * N, cs, Cp);
            for (int t = 0; t < n; t++) aT[t] = expf(dt[(t0 + t) * dts + hh] * A[hh]);
            for (int i = 0; i < P; i++) {
                const float *xi = x + t0 * xs + (long)hh * P + i;
                for (int t = 0; t < n; t++) xd[t] = dt[(t0 + t) * dts + hh] * xi[t * xs];
                float *yi = y + t0 * ys + (long)hh * P + i, *si = state + hh * PN + (long)i * N;
                int j = 0;
                for (; j + 64 <= N; j += 64) fwd_tile(8, n, aT, xd, Bp + j, N, Cp + j, N, pv, j > 0, si + j);
                for (; j + 8 <= N; j += 8) fwd_tile(1, n, aT, xd, Bp + j, N, Cp + j, N, pv, j > 0, si + j);
                for (int t = 0; t < n; t++) yi[t * ys] = hsum(LD(pv + 8 * t)) + Dh * xi[t * xs];
            }
        }
    }
}

/* Backward of one state tile over the n steps of one chunk (in reverse), starting from the tile's
 * checkpoint (state entering the chunk). g: the adjoint tile (in: of the state after the chunk; out:
 * before it). Accumulates dB, dC rows (per step, this head) and 8-lane partials of the per-step dot
 * products: pvx[t] for d(dt x)[t] of row i (written when add == 0), pva[t] for d(decay)[t]. */
INL void bwd_tile(const int VW, int n, const float *aT, const float *xd, const float *B, long bs, const float *C,
                  long cs, const float *dyi, long dys, const float *ck, float *g, float *dB, float *dC, long dn,
                  float *pvx, float *pva, int add, float *S) {
    v8 st[8], gt[8];
#pragma GCC unroll 8
    for (int v = 0; v < VW; v++) st[v] = LD(ck + 8 * v);
#pragma GCC unroll 8
    for (int v = 0; v < VW; v++) ST(S + 8 * v, st[v]);
    for (int t = 0; t < n; t++) {  /* recompute the states after each step: S[t+1] */
        v8 a = bc(aT[t]), x = bc(xd[t]);
        const float *Bt = B + t * bs;
#pragma GCC unroll 8
        for (int v = 0; v < VW; v++) {
            st[v] = a * st[v] + x * LD(Bt + 8 * v);
            ST(S + (t + 1) * 64 + 8 * v, st[v]);
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < VW; v++) gt[v] = LD(g + 8 * v);
    for (int t = n - 1; t >= 0; t--) {
        v8 dy = bc(dyi[t * dys]), x = bc(xd[t]), a = bc(aT[t]);
        const float *Bt = B + t * bs, *Ct = C + t * cs, *s1 = S + (t + 1) * 64, *s0 = S + t * 64;
        float *dBt = dB + t * dn, *dCt = dC + t * dn;
        v8 ax0 = bc(0.0f), ax1 = bc(0.0f), aa0 = bc(0.0f), aa1 = bc(0.0f);
#pragma GCC unroll 8
        for (int v = 0; v < VW; v++) {
            v8 gv = gt[v] + dy * LD(Ct + 8 * v);
            ST(dCt + 8 * v, LD(dCt + 8 * v) + LD(s1 + 8 * v) * dy);
            ST(dBt + 8 * v, LD(dBt + 8 * v) + gv * x);
            if (v & 1) { ax1 += gv * LD(Bt + 8 * v); aa1 += gv * LD(s0 + 8 * v); }
            else { ax0 += gv * LD(Bt + 8 * v); aa0 += gv * LD(s0 + 8 * v); }
            gt[v] = gv * a;
        }
        if (add) ST(pvx + 8 * t, LD(pvx + 8 * t) + ax0 + ax1); else ST(pvx + 8 * t, ax0 + ax1);
        ST(pva + 8 * t, LD(pva + 8 * t) + aa0 + aa1);
    }
#pragma GCC unroll 8
    for (int v = 0; v < VW; v++) ST(g + 8 * v, gt[v]);
}

/* work: 3Q + QP + 64(Q+1) + 4QN + 16Q floats (aT, xd, da, dxd, S, dB/dC chunk sums, packed B/C, partials) */
void ssd_bwd(int T, int H, int P, int G, int N, int Q, const float *x, long xs, const float *dt, long dts,
             const float *A, const float *D, const float *B, long bs, const float *C, long cs, const float *dy,
             long dys, const float *ckpt, float *gstate, float *dx, long dxs, float *ddt, long ddts, float *dBh,
             long dbs, long dbh, float *dCh, long dcs, long dch, float *dA, float *dD, float *work, int h0, int h1) {
    int r = H / G, nck = (T + Q - 1) / Q;
    long PN = (long)P * N;
    float *aT = work, *xd = aT + Q, *dxd = xd + Q, *da = dxd + (long)Q * P, *S = da + Q;
    float *dBc = S + (long)(Q + 1) * 64, *dCc = dBc + (long)Q * N, *Bp = dCc + (long)Q * N, *Cp = Bp + (long)Q * N;
    float *pvx = Cp + (long)Q * N, *pva = pvx + 8L * Q;
    for (int hh = h0; hh < h1; hh++) {
        int gi = hh / r;
        float Ah = A[hh], Dh = D ? D[hh] : 0.0f, dAh = 0.0f, dDh = 0.0f;
        for (int k = nck - 1; k >= 0; k--) {
            int t0 = k * Q, n = (t0 + Q < T ? Q : T - t0);
            pack(n, N, B + t0 * bs + (long)gi * N, bs, Bp);
            pack(n, N, C + t0 * cs + (long)gi * N, cs, Cp);
            for (int t = 0; t < n; t++) aT[t] = expf(dt[(t0 + t) * dts + hh] * Ah);
            memset(pva, 0, sizeof(float) * 8L * n);
            memset(dBc, 0, sizeof(float) * (long)n * N);
            memset(dCc, 0, sizeof(float) * (long)n * N);
            for (int i = 0; i < P; i++) {
                const float *xi = x + t0 * xs + (long)hh * P + i, *dyi = dy + t0 * dys + (long)hh * P + i;
                for (int t = 0; t < n; t++) xd[t] = dt[(t0 + t) * dts + hh] * xi[t * xs];
                const float *ci = ckpt + ((long)k * H + hh) * PN + (long)i * N;
                float *gsi = gstate + hh * PN + (long)i * N, *dxi = dxd + (long)i * Q;
                int j = 0;
                for (; j + 64 <= N; j += 64)
                    bwd_tile(8, n, aT, xd, Bp + j, N, Cp + j, N, dyi, dys, ci + j, gsi + j, dBc + j, dCc + j, N, pvx, pva, j > 0, S);
                for (; j + 8 <= N; j += 8)
                    bwd_tile(1, n, aT, xd, Bp + j, N, Cp + j, N, dyi, dys, ci + j, gsi + j, dBc + j, dCc + j, N, pvx, pva, j > 0, S);
                for (int t = 0; t < n; t++) dxi[t] = hsum(LD(pvx + 8 * t));
            }
            for (int t = 0; t < n; t++) da[t] = hsum(LD(pva + 8 * t));
            for (int t = 0; t < n; t++) {
                long tt = t0 + t;
                float d = dt[tt * dts + hh], dd = 0.0f;
                const float *xt = x + tt * xs + (long)hh * P, *dyt = dy + tt * dys + (long)hh * P;
                float *dxt = dx + tt * dxs + (long)hh * P;
                for (int i = 0; i < P; i++) {
                    float v = dxd[(long)i * Q + t];
                    dxt[i] = v * d + Dh * dyt[i];
                    dd += v * xt[i];
                    dDh += dyt[i] * xt[i];
                }
                ddt[tt * ddts + hh] = dd + da[t] * aT[t] * Ah;
                dAh += da[t] * aT[t] * d;
                memcpy(dBh + tt * dbs + (long)hh * dbh, dBc + (long)t * N, sizeof(float) * N);
                memcpy(dCh + tt * dcs + (long)hh * dch, dCc + (long)t * N, sizeof(float) * N);
            }
        }
        dA[hh] += dAh;
        if (dD) dD[hh] += dDh;
    }
}
