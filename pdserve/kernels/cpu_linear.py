"""A decode step's float32 linears on CPU, as one C++ op: `x @ Wt (+ bias)` for up to 16 rows.

Why: a decode step multiplies a handful of rows (the batch) by every weight of the model, so its
linears are bound by how fast the GEMM streams the weights. PyTorch's float32 paths do that
poorly at these shapes on the machines we test on: MKL's GEMM on an AMD EPYC (Zen 3) streamed the
tiny model's small layers at ~2-4 GB/s (a 256 x 384 layer at one row: ~80 us for 393 KB, two
threads), and PyTorch's call into oneDNN's packed GEMM costs ~40 us whatever the size. This op
streams each [in, out] weight once per step. One or two rows: each thread takes a run of columns
and reads the weight four rows at a time along them (sequential streams), adding into the outputs
in place. Three to 16 rows: the output columns are cut into panels of 48 (six 8-float vectors),
split between the threads, and each panel's rows of the weight are read in order while two input
rows at a time accumulate in registers (a 16-row batch re-reads the panel from L1/L2, not memory),
with software prefetches for the strided rows: the first pass asks for rows 8 ahead, the second for
the next panel. docs/engine.md ("A decode step's float32 linears") has the figures
(`python bench/cpu_linears.py --own`).

It takes the layout the unpacked float32 linears already have (loader.py stores each weight as the
transpose of a contiguous [in, out] matrix, MKL's fast layout): no second copy of the model. More
than MAX_ROWS rows (a prefill) go to MKL as before, inside the same op, so a compiled graph keeps
one call for every row count.

Numerics: float32 products summed in input order per output (MKL's blocked sums differ from it
by float32 rounding); tests/kernels/test_cpu_linear.py holds it to float64.

Built on first use (pdserve/kernels/cpp_build.py); PDSERVE_CPU_LINEAR_KERNEL=0 turns it off.
"""

from __future__ import annotations

import threading

import torch

from pdserve.kernels.cpp_build import InlineOp, Op

ENV = "PDSERVE_CPU_LINEAR_KERNEL"
MAX_ROWS = 16  # beyond it MKL's blocked GEMM is compute-bound and ahead

_SOURCE = r"""
// ATen's headers of what is used, not torch/extension.h (pdserve/kernels/cpp_build.py says why).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Eight floats as one vector (GCC/Clang vector extension: AVX's ymm on x86, two NEON registers on
// ARM); `s * v` broadcasts the scalar, and -ffast-math contracts `acc += s * v` into an FMA.
typedef float v8 __attribute__((vector_size(32)));
static inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

constexpr int PANEL_VECS = 6;  // a panel: 48 output columns; with two rows, 12 accumulators in registers
constexpr int64_t PANEL = PANEL_VECS * 8;

// How a tile helps the memory system along (a panel's rows lie N floats apart: a strided stream
// that the hardware prefetchers follow late, if at all):
enum Prefetch { NONE, AHEAD, NEXT_PANEL };
constexpr int64_t AHEAD_ROWS = 8;  // AHEAD: this panel's row k + 8 while row k is used

// y[r, 0:8*NV] = x[r, :] @ w[:, 0:8*NV] (+ bias) for r < MB; w row k at w + k * N. AHEAD asks for
// this panel's rows AHEAD_ROWS on (the tile that reads the panel from memory); NEXT_PANEL for
// the next panel's row k (a tile that re-reads this panel from cache keeps memory busy meanwhile).
template <int MB, int NV, Prefetch PF>
static inline void tile(const float* __restrict x, int64_t K, const float* __restrict w, int64_t N,
                        const float* __restrict bias, float* __restrict y) {
  v8 acc[MB][NV];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = bias ? load8(bias + 8 * j) : v8{};
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * N;
    if constexpr (PF != NONE) {  // past the matrix's end near its last rows/panel: a prefetch never faults
      const char* p = reinterpret_cast<const char*>(PF == AHEAD ? wk + AHEAD_ROWS * N : wk + 8 * NV);
      for (int c = 0; c < NV * 32; c += 64) __builtin_prefetch(p + c);
    }
    v8 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = load8(wk + 8 * j);
    for (int r = 0; r < MB; ++r) {
      const float s = x[r * K + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += s * wv[j];
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NV; ++j) store8(y + r * N + 8 * j, acc[r][j]);
}

// Every row of columns [n0, n0 + 8 * NV): rows two at a time, the first pair reading the panel
// from memory (prefetching ahead), the second prefetching the next panel, the rest from cache.
template <int NV>
static void columns(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias,
                    float* y, int64_t n0) {
  const float* b = bias ? bias + n0 : nullptr;
  w += n0;
  y += n0;
  if (M == 1) return tile<1, NV, AHEAD>(x, K, w, N, b, y);
  tile<2, NV, AHEAD>(x, K, w, N, b, y);
  int64_t r = 2;
  if (r + 2 <= M) {
    tile<2, NV, NEXT_PANEL>(x + r * K, K, w, N, b, y + r * N);
    r += 2;
  }
  for (; r + 2 <= M; r += 2) tile<2, NV, NONE>(x + r * K, K, w, N, b, y + r * N);
  if (r < M) tile<1, NV, NONE>(x + r * K, K, w, N, b, y + r * N);
}

// One or two rows (batch-1 and batch-2 decode): y[r, n0:n1] = x[r, :] @ w[:, n0:n1] (+ bias), the
// weight read four rows at a time along each row's columns (four sequential streams the hardware
// prefetchers follow), the outputs accumulated in place (n1 - n0 floats a row: L1/L2).
template <int MR>
static void row_stream(const float* __restrict x, int64_t K, const float* __restrict w, int64_t N,
                       const float* __restrict bias, float* __restrict y, int64_t n0, int64_t n1) {
  for (int r = 0; r < MR; ++r)
    for (int64_t n = n0; n < n1; ++n) y[r * N + n] = bias ? bias[n] : 0.f;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float* w0 = w + k * N;
    const float* w1 = w0 + N;
    const float* w2 = w1 + N;
    const float* w3 = w2 + N;
    float xs[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) xs[r][j] = x[r * K + k + j];
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) {
      const v8 a = load8(w0 + n), b = load8(w1 + n), c = load8(w2 + n), d = load8(w3 + n);
      for (int r = 0; r < MR; ++r) {
        v8 acc = load8(y + r * N + n);
        acc += xs[r][0] * a;
        acc += xs[r][1] * b;
        acc += xs[r][2] * c;
        acc += xs[r][3] * d;
        store8(y + r * N + n, acc);
      }
    }
    for (; n < n1; ++n)
      for (int r = 0; r < MR; ++r)
        y[r * N + n] += xs[r][0] * w0[n] + xs[r][1] * w1[n] + xs[r][2] * w2[n] + xs[r][3] * w3[n];
  }
  for (; k < K; ++k)
    for (int r = 0; r < MR; ++r)
      for (int64_t n = n0; n < n1; ++n) y[r * N + n] += x[r * K + k] * w[k * N + n];
}

// The last panel's columns past its whole vectors (N % 8 of them): plain dot products.
static void scalar_columns(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias,
                           float* y, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = n0; n < n1; ++n) {
      float s = bias ? bias[n] : 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * w[k * N + n];
      y[r * N + n] = s;
    }
}

// A short panel (the last one, when N is not a multiple of 48): its whole vectors, then the rest.
static void short_panel(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias,
                        float* y, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) columns<1>(x, M, K, w, N, bias, y, n);
  if (n < n1) scalar_columns(x, M, K, w, N, bias, y, n, n1);
}

static at::Tensor few_rows(const at::Tensor& x_in, const at::Tensor& wt, const c10::optional<at::Tensor>& bias) {
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wt.size(1);
  auto y = at::empty({M, N}, x.options());
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "bias: float32 [N]");
    bp = b.data_ptr<float>();
  }
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = wt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= 2) {  // threads take runs of 8 columns, at least ~64 KB of weight each
    const int64_t groups = (N + 7) / 8;
    at::parallel_for(0, groups, std::max<int64_t>(1, (64 << 10) / (K * 32)), [&](int64_t begin, int64_t end) {
      const int64_t n0 = begin * 8, n1 = std::min(N, end * 8);
      if (M == 1) {
        row_stream<1>(xp, K, wp, N, bp, yp, n0, n1);
      } else {
        row_stream<2>(xp, K, wp, N, bp, yp, n0, n1);
      }
    });
    return y;
  }
  const int64_t panels = (N + PANEL - 1) / PANEL;
  // At least ~64 KB of weight a thread: waking a thread costs more than streaming less
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (K * PANEL * 4));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * PANEL, n1 = std::min(N, n0 + PANEL);
      if (n1 - n0 == PANEL) {
        columns<PANEL_VECS>(xp, M, K, wp, N, bp, yp, n0);
      } else {
        short_panel(xp, M, K, wp, N, bp, yp, n0, n1);
      }
    }
  });
  return y;
}

// x [..., K] @ wt [K, N] (+ bias): this file's loops for up to MAX_ROWS rows, MKL's GEMM beyond.
at::Tensor linear(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && wt.dim() == 2 && x.size(-1) == wt.size(0), "x [..., K] and wt [K, N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wt.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(wt.is_contiguous(), "wt must be a contiguous [in, out] matrix");
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor out;
  if (rows.size(0) > @MAX_ROWS@) {
    out = has_bias ? at::addmm(*bias, rows, wt) : at::mm(rows, wt);
  } else {
    out = few_rows(rows, wt, bias);
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = wt.size(1);
  return out.view(shape);
}

// Registered with the dispatcher straight from C++: a compiled graph's call reaches this kernel
// without a Python frame (a Python kernel cost ~18 us a call more; the op runs 12-150 times a step).
TORCH_LIBRARY_FRAGMENT(pdserve, m) { m.def("cpu_linear(Tensor x, Tensor weight_t, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("cpu_linear", &linear); }
"""

_op = InlineOp("pdserve_cpu_linear", _SOURCE.replace("@MAX_ROWS@", str(MAX_ROWS)), ENV, "CPU decode linear op",
               "cpu_linear")
_fake_lock = threading.Lock()
_fake_registered = False


def _fake(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight_t.shape[1])


def enabled() -> bool:
    return _op.enabled()


def load() -> Op | None:
    """`torch.ops.pdserve.cpu_linear`, building it on first use; None if it cannot be built (or is
    turned off). Loading it defines the op (C++), then its shape function for the compiler (here)."""
    global _fake_registered
    op = _op.load()
    if op is not None and not _fake_registered:
        with _fake_lock:
            if not _fake_registered:
                torch.library.register_fake("pdserve::cpu_linear", _fake)
                _fake_registered = True
    return op


def usable(weight: torch.Tensor) -> bool:
    """Whether a linear with this [out, in] weight can take the op: float32 on CPU, stored as the
    transpose of a contiguous [in, out] matrix (loader.py's layout), and the op built."""
    return (weight.device.type == "cpu" and weight.dtype is torch.float32 and weight.dim() == 2
            and weight.t().is_contiguous() and load() is not None)


def linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight_t [in, out] (+ bias): the op's loops for up to MAX_ROWS rows, MKL
    beyond. Callers check `usable` first; a compiled graph calls torch.ops.pdserve.cpu_linear.
    Decided at load: turning the switch off later does not take the op from a layer that has it."""
    op = _op.built()
    assert op is not None, "cpu_linear.linear called without the op (check usable() first)"
    out: torch.Tensor = op(x, weight_t, bias)
    return out


__all__ = ["ENV", "MAX_ROWS", "enabled", "linear", "load", "usable"]
