"""Decode (and draft-verification) attention over the paged KV cache on CPU, as one C++ op.

Why: the PyTorch reference (pdserve/kernels/reference.py) runs a decode step's attention as some twenty
small tensor calls per layer (the cache write, two block gathers into fresh buffers, a mask, SDPA,
views). For a small model at small batch their Python dispatch costs more than their arithmetic
(~92 us per layer at batch 1, of which ~35 us is the work), and at batch 16 the gathers copy every
sequence's whole context twice per layer. This op writes the step's new K/V into their slots and
attends each sequence's one query straight out of its blocks: no gathered copy, no mask, one call.
It is what vLLM's CPU backend does with its own C++ kernels; this one is small and plain.

Numerics: scores, softmax and the weighted sum in float32 whatever the cache dtype (as SDPA does on
CPU), max-subtracted softmax. Compared with the reference in tests/kernels/test_cpu_decode.py.

It is built with torch.utils.cpp_extension the first time a process needs it (pdserve/kernels/cpp_build.py:
a C++ compiler and ninja, as Inductor needs; seconds once, then cached under
~/.cache/torch_extensions). Anything that stops the build leaves `load()` returning None and the
reference in use, with one warning.
PDSERVE_CPU_DECODE_KERNEL=0 turns it off.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels.cpp_build import FLAGS, InlineOp, Op
from pdserve.kernels.metadata import AttentionMetadata

ENV = "PDSERVE_CPU_DECODE_KERNEL"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_SOURCE = r"""
// ATen's headers of what is used, not torch/extension.h (pdserve/kernels/cpp_build.py says why).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// One cache row of D values as float32 into `out`: a plain loop over the raw bits, which the
// compiler turns into vector widening/shifts (bfloat16 is the top half of a float32).
template <typename T>
static inline void to_float(const T* __restrict row, float* __restrict out, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, row, D * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t u = static_cast<uint32_t>(bits[d]) << 16;
      float f;
      std::memcpy(&f, &u, sizeof(f));
      out[d] = f;
    }
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(row[d]);
  }
}

// Ask the memory system for `bytes` from `p` onwards, one cache line at a time.
static inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// DC: the head dim when known at compile time (32, 64, 128: loops fully unrolled into vector code),
// else 0 and the runtime D.
template <int DC>
static inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  const int64_t n = DC ? DC : D;
  float s = 0.f;  // -ffast-math: the compiler may split this into vector partial sums
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// out[j] = dot(q, rows + j * stride) over D values for j < m (m <= 16). With DC known at compile time and
// AVX-512, the 16 dot vectors are summed across lanes together (a transpose-add tree: ~45
// instructions for 16 sums, against ~8 each one by one).
template <int DC>
static inline void dots16(const float* __restrict q, const float* __restrict rows, int64_t stride, int64_t m,
                          float* __restrict out, int64_t D) {
#if defined(__AVX512F__)
  if constexpr (DC % 16 == 0 && DC > 0) {
    __m512 v[16];
    for (int64_t j = 0; j < 16; ++j) {
      __m512 a = _mm512_setzero_ps();
      if (j < m) {
        const float* r = rows + j * stride;
        __m512 b = _mm512_setzero_ps();
        for (int c = 0; c < DC / 16; c += 2) {
          a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * 16), _mm512_loadu_ps(r + c * 16), a);
          if (c + 1 < DC / 16)
            b = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * 16 + 16), _mm512_loadu_ps(r + c * 16 + 16), b);
        }
        a = _mm512_add_ps(a, b);
      }
      v[j] = a;
    }
    __m512 s2[8];  // per 128-bit block: [v2i, v2i+1, v2i, v2i+1] pair sums
    for (int i = 0; i < 8; ++i)
      s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    __m512 s4[4];  // per 128-bit block: [v4i, v4i+1, v4i+2, v4i+3]
    for (int i = 0; i < 4; ++i)
      s4[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 s8[2];  // blocks: [v8i..+3 (b0+b1), (b2+b3), v8i+4..+7 (b0+b1), (b2+b3)]
    for (int i = 0; i < 2; ++i)
      s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 s16 = _mm512_add_ps(_mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(3, 1, 3, 1)));
    if (m == 16) {
      _mm512_storeu_ps(out, s16);
    } else {
      _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << m) - 1u), s16);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < m; ++j) out[j] = dot<DC>(q, rows + j * stride, D);
}

static inline void axpy(float p, const float* __restrict x, float* __restrict y, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] += p * x[d];
}

// y += sum_j p[j] * x[j * stride ...] over m rows, the partial sum kept in registers (DC known).
template <int DC>
static inline void wsum(const float* __restrict p, const float* __restrict x, int64_t stride, int64_t m,
                        float* __restrict y, int64_t D) {
  if constexpr (DC > 0) {
    float a[DC];
    for (int d = 0; d < DC; ++d) a[d] = y[d];
    for (int64_t j = 0; j < m; ++j) {
      const float pj = p[j];
      const float* xj = x + j * stride;
      for (int d = 0; d < DC; ++d) a[d] += pj * xj[d];
    }
    for (int d = 0; d < DC; ++d) y[d] = a[d];
  } else {
    for (int64_t j = 0; j < m; ++j) axpy(p[j], x + j * stride, y, D);
  }
}

template <typename T, int DC>
static void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc,
                const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts,
                double scale, at::Tensor& out) {
  const int64_t T_new = k.size(0), n = lens.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), KVH = kc.size(2), G = H / KVH, row = KVH * D;
  const int64_t max_blocks = tables.size(1);
  T* kcp = kc.data_ptr<T>();
  T* vcp = vc.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < T_new; ++i) {  // the new tokens first: each query sees its own key
    if (slot[i] < 0) continue;  // a padding row of a CUDA-graph bucket: writes nothing
    std::memcpy(kcp + slot[i] * row, kp + i * row, row * sizeof(T));
    std::memcpy(vcp + slot[i] * row, vp + i * row, row * sizeof(T));
  }
  const T* qp = q.data_ptr<T>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float s = static_cast<float>(scale);
  const int32_t* qsl = starts.data_ptr<int32_t>();
  // Tasks: one per sequence, reading each of its blocks front to back for every KV head at once
  // (a block's rows interleave the heads: per-head tasks read 2 of every 6 cache lines and the
  // hardware prefetcher falls behind on a scattered pool), unless there are fewer sequences than
  // threads, when each KV head of a sequence is a task of its own.
  const int64_t split = n < at::get_num_threads() ? KVH : 1, per_task = KVH / split;
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), kf(bs * row), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / split, g0 = (task % split) * per_task;
      const int64_t hq = per_task * G;  // query heads of this task: g0 * G onwards
      const int64_t first = qsl[b], rows = qsl[b + 1] - qsl[b], context = len[b] - rows;
      const int32_t* btab = tab + b * max_blocks;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = first + r, L = context + r + 1;
        T* orow = op + (i * H + g0 * G) * D;
        if (L <= 0) {  // a padding row (seq_len 0): no keys, a zero output
          for (int64_t x = 0; x < hq * D; ++x) orow[x] = static_cast<T>(0.f);
          continue;
        }
        to_float(qp + (i * H + g0 * G) * D, qf.data(), hq * D);
        for (int64_t x = 0; x < hq * D; ++x) qf[x] *= s;
        scores.resize(hq * L);
        // Block by block (one table lookup each; the next block prefetched: it is elsewhere in the
        // pool): this task's KV heads of the block's rows as float32 (converted into kf unless the
        // cache is float32), then every query head's scores (QK) or weighted sum (PV) over those rows.
        auto each_block = [&](const T* cache, auto&& use) {
          for (int64_t t0 = 0, bi = 0; t0 < L; t0 += bs, ++bi) {
            const T* base = cache + static_cast<int64_t>(btab[bi]) * bs * row;
            if (t0 + bs < L) prefetch(cache + static_cast<int64_t>(btab[bi + 1]) * bs * row, bs * row * sizeof(T));
            const int64_t m = std::min(bs, L - t0);
            if constexpr (std::is_same_v<T, float>) {  // float32 rows are read where they lie: no copy
              use(t0, m, static_cast<const float*>(base + g0 * D), row);
            } else {
              for (int64_t j = 0; j < m; ++j)
                to_float(base + j * row + g0 * D, kf.data() + j * per_task * D, per_task * D);
              use(t0, m, static_cast<const float*>(kf.data()), per_task * D);
            }
          }
        };
        // KV head h serves query heads h * G .. h * G + G - 1; rows: the block's rows, `stride` floats apart
        each_block(kcp, [&](int64_t t0, int64_t m, const float* rows, int64_t stride) {
          for (int64_t c = 0; c < m; c += 16)
            for (int64_t h = 0, qh = 0; h < per_task; ++h)
              for (int64_t g = 0; g < G; ++g, ++qh)
                dots16<DC>(qf.data() + qh * D, rows + c * stride + h * D, stride,
                           std::min<int64_t>(16, m - c), scores.data() + qh * L + t0 + c, D);
        });
        for (int64_t h = 0; h < hq; ++h) {
          float* sc = scores.data() + h * L;
          float mx = sc[0];  // no infinities anywhere: the build may assume finite math
          for (int64_t t = 1; t < L; ++t) mx = std::max(mx, sc[t]);
          float sum = 0.f;
          for (int64_t t = 0; t < L; ++t) { sc[t] = std::exp(sc[t] - mx); sum += sc[t]; }
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
        }
        std::fill(acc.begin(), acc.begin() + hq * D, 0.f);
        each_block(vcp, [&](int64_t t0, int64_t m, const float* rows, int64_t stride) {
          for (int64_t h = 0, qh = 0; h < per_task; ++h)
            for (int64_t g = 0; g < G; ++g, ++qh)  // the block's rows summed in registers, then added once
              wsum<DC>(scores.data() + qh * L + t0, rows + h * D, stride, m, acc.data() + qh * D, D);
        });
        for (int64_t x = 0; x < hq * D; ++x) orow[x] = static_cast<T>(acc[x]);
      }
    }
  });
}

at::Tensor decode(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor slots, at::Tensor tables, at::Tensor lens, at::Tensor starts, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt
              && starts.scalar_type() == at::kInt, "slot_mapping int64; block_tables, seq_lens, query_start_loc int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  slots = slots.contiguous(); tables = tables.contiguous(); lens = lens.contiguous(); starts = starts.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "pdserve_cpu_decode", [&] {
    switch (q.size(2)) {  // the common head dims get loops unrolled at compile time
      case 32: run<scalar_t, 32>(q, k, v, k_cache, v_cache, slots, tables, lens, starts, scale, out); break;
      case 64: run<scalar_t, 64>(q, k, v, k_cache, v_cache, slots, tables, lens, starts, scale, out); break;
      case 128: run<scalar_t, 128>(q, k, v, k_cache, v_cache, slots, tables, lens, starts, scale, out); break;
      default: run<scalar_t, 0>(q, k, v, k_cache, v_cache, slots, tables, lens, starts, scale, out);
    }
  });
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

// Registered with the dispatcher from C++ (no Python binding module to compile): called as
// torch.ops.pdserve.cpu_decode. It writes the step's K/V into both caches.
TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("cpu_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor tables, Tensor lens, Tensor starts, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("cpu_decode", &decode); }
"""

# The build's flags (pdserve/kernels/cpp_build.py says why each). What the op gains over the reference and
# over its earlier versions: docs/engine.md ("the decode attention op"); `python
# bench/cpu_decode_op.py --against REV` times it against another revision.
_FLAGS = FLAGS
_op = InlineOp("pdserve_cpu_decode", _SOURCE, ENV, "CPU decode attention op", "cpu_decode")


def enabled() -> bool:
    return _op.enabled()


def load() -> Op | None:
    """`torch.ops.pdserve.cpu_decode`, building it on first use; None if it cannot be built (or is
    turned off)."""
    return _op.load()


# Rows (new tokens) a sequence may have in a step the op takes: decode (1) and verifying k drafts (k + 1).
# Each row reads its sequence's keys once: for a prefill chunk the reference's one SDPA per chunk wins.
MAX_ROWS = 8


def usable(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this call takes the op: every sequence with at most MAX_ROWS new tokens (a decode or
    verification step), on CPU, in a dtype it has."""
    if q.device.type != "cpu" or q.dtype not in DTYPES or k_cache.dtype != q.dtype:
        return False
    short = meta.scratch.get("cpu_decode_rows")  # the same for every layer of the step: decided once
    if short is None:
        short = meta.scratch["cpu_decode_rows"] = (
            meta.num_decode_seqs == meta.num_seqs or int(np.diff(meta.query_start_loc_np).max()) <= MAX_ROWS)
    return bool(short) and k_cache.is_contiguous() and load() is not None


def usable_for_decode_rows(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether a mixed step's one-token rows (the first `num_decode_seqs`) take the op while its
    longer chunks go to the reference: served steps mix them most of the time (requests arrive
    while others decode), and the reference gathers each sequence's whole cache per layer."""
    return (meta.num_decode_seqs > 0 and not meta.padded and q.device.type == "cpu" and q.dtype in DTYPES
            and k_cache.dtype == q.dtype and k_cache.is_contiguous() and load() is not None)


def decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """[num_decode_seqs, H * D]: the attention of a step's one-token rows, by the op over their
    sequences alone (it writes their K/V again: the same values, already in place)."""
    op = load()
    assert op is not None, "decode_rows called without the op (check usable_for_decode_rows() first)"
    nd = meta.num_decode_seqs
    out: torch.Tensor = op(q[:nd], k[:nd], v[:nd], k_cache, v_cache, meta.slot_mapping[:nd],
                           meta.block_tables[:nd], meta.seq_lens[:nd], meta.query_start_loc[: nd + 1], float(scale))
    return out


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write the step's new K/V [T, KVH, D] into their slots and attend each query row [T, H, D]
    causally over its sequence (row j of a sequence with n new tokens sees keys up to its own
    position): [T, H * D]. Callers check `usable` first."""
    op = load()
    assert op is not None, "paged_decode called without the op (check usable() first)"
    out: torch.Tensor = op(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, float(scale))
    return out
