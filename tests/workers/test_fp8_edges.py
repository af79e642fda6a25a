"""Edges of fp8 weights and the fp8 KV cache that tests/workers/test_fp8.py does not reach.

Oracles: the PyTorch reference attention (kernels/reference.py) and float64 attention over the
cache's contents; for checkpoints, the weights they hold dequantized (float64) against what the
engine loaded, and the unquantized engine's logits."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny_spec
from safetensors.torch import load_file, save_file

from pdserve import LLM
from pdserve.kernels import reference
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.workers.model import fp8
from pdserve.workers.tiny.builder import TinyModelSpec

SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


def _llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64, progress=False, **kw)


# -- calibrated KV scales with a 16/32-bit cache ----------------------------------------------------


def _float_cache_case(seed: int = 0) -> dict:
    """A mixed batch (two decode rows, then chunks with and without context) over a float32
    cache whose context slots hold each sequence's earlier K/V as they are."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    seqs = [(5, 1), (12, 1), (9, 3), (0, 6)]
    num_blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 1
    k_cache = torch.zeros(num_blocks, bs, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    max_blocks = max(-(-(c + n) // bs) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    qs, ks, vs, slots = [], [], [], []
    nxt = 0
    for i, (c, n) in enumerate(seqs):
        nb = -(-(c + n) // bs)
        tables[i, :nb] = torch.arange(nxt, nxt + nb, dtype=torch.int32)
        nxt += nb
        keys = torch.randn(c + n, kv_heads, dim, generator=gen)
        values = torch.randn(c + n, kv_heads, dim, generator=gen)
        pos = torch.arange(c + n)
        blk, off = tables[i, pos // bs].long(), pos % bs
        k_cache[blk[:c], off[:c]] = keys[:c]
        v_cache[blk[:c], off[:c]] = values[:c]
        qs.append(torch.randn(n, heads, dim, generator=gen))
        ks.append(keys[c:])
        vs.append(values[c:])
        slots.append(blk[c:] * bs + off[c:])
    lens = np.array([c + n for c, n in seqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=tables, seq_lens=torch.from_numpy(lens),
                             query_start_loc=torch.from_numpy(qsl), num_decode_seqs=2, seq_lens_np=lens,
                             query_start_loc_np=qsl, block_size=bs)
    return dict(q=torch.cat(qs), k=torch.cat(ks), v=torch.cat(vs), k_cache=k_cache, v_cache=v_cache, meta=meta,
                scale=dim**-0.5)


def test_triton_attention_ignores_kv_scales_over_a_float_cache() -> None:
    """A checkpoint's calibrated k_scale / v_scale (loader.py sets them on every attention layer
    whatever the cache) belong to an fp8 cache only: a 16/32-bit cache stores K and V as they
    are, and the reference reads them so. The Triton decode and prefill kernels multiplied the
    scores by k_scale and the output by v_scale anyway, so a calibrated fp8 checkpoint served
    with `kv_cache_dtype="auto"` on the Triton backend (the CUDA default) attended wrongly."""
    pytest.importorskip("triton")
    from pdserve.kernels import triton_attention

    case = _float_cache_case()
    scales = (0.25, 4.0)
    want = reference.paged_attention(case["q"], case["k"], case["v"], case["k_cache"].clone(),
                                     case["v_cache"].clone(), case["meta"], case["scale"], kv_scales=(1.0, 1.0))
    ref_scaled = reference.paged_attention(case["q"], case["k"], case["v"], case["k_cache"].clone(),
                                           case["v_cache"].clone(), case["meta"], case["scale"], kv_scales=scales)
    torch.testing.assert_close(ref_scaled, want)  # the reference: scales do not touch a float cache
    got = triton_attention.paged_attention(case["q"], case["k"], case["v"], case["k_cache"].clone(),
                                           case["v_cache"].clone(), case["meta"], case["scale"], kv_scales=scales)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)



def test_a_calibrated_checkpoint_on_the_triton_backend_with_a_float_cache_decodes_as_torch(
        model_dir: Path, tmp_path: Path) -> None:
    """The engine-level face of the test above: a checkpoint carrying k_scale / v_scale (0.05,
    as a calibrated fp8 checkpoint's), served with the model's dtype in the cache on the Triton
    backend, must give the tokens the PyTorch backend gives for the same weights."""
    pytest.importorskip("triton")
    from pdserve import SamplingParams

    shutil.copytree(model_dir, tmp_path / "m")
    tensors = load_file(str(model_dir / "model.safetensors"))
    for i in range(SPEC.num_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.05)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 40, 41], [12, 13, 14]]
    want = [o.outputs[0].token_ids for o in _llm(model_dir).generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in _llm(tmp_path / "m", attention_backend="triton").generate(prompts, params)]
    assert got == want


# -- fp8 checkpoints ---------------------------------------------------------------------------------


def _channel_checkpoint(src: Path, dst: Path, ignore: tuple[str, ...] = (),
                        quantization_config: dict | None = None) -> dict[str, torch.Tensor]:
    """Copy the float32 model at `src` to `dst` as an llm-compressor (compressed-tensors) fp8
    checkpoint with per-channel scales, leaving the projections named in `ignore` (checkpoint
    module names) in float32 as llm-compressor's `ignore` list does. Returns every projection
    weight as it holds it, dequantized."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        proj = name.split(".")[-2] if name.endswith(".weight") else ""
        stem = name[: -len(".weight")]
        if proj not in PROJECTIONS or stem in ignore:
            out[name] = t
            held[name] = t.double()
            continue
        w = t.float()
        scale = w.abs().amax(dim=1, keepdim=True) / fp8.E4M3_MAX
        q = (w / scale).clamp(-448, 448).to(fp8.E4M3)
        out[name], out[f"{stem}.weight_scale"] = q, scale
        held[name] = (q.float() * scale).double()  # as the engine dequantizes: in float32
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config or {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", *ignore],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(config))
    return held


def test_layers_an_fp8_checkpoint_ignores_load_unquantized(model_dir: Path, tmp_path: Path) -> None:
    """llm-compressor's `ignore` (vLLM's `ignored_layers`) keeps some decoder projections in
    16/32 bits besides the LM head (sensitive layers: a first layer's MLP, an attention block).
    vLLM loads them as plain linears. They were loaded into e4m3 parameters with no scale and
    the engine refused the checkpoint ("lacks weights for ...weight_scale")."""
    ignore = ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
              "model.layers.1.self_attn.v_proj")
    held = _channel_checkpoint(model_dir, tmp_path / "m", ignore)
    llm = _llm(tmp_path / "m")
    layers = llm.engine.model.model.layers
    down0, qkv1 = layers[0].mlp.down_proj, layers[1].self_attn.qkv_proj
    assert not isinstance(down0, fp8.Fp8Linear) and not isinstance(qkv1, fp8.Fp8Linear)
    assert isinstance(layers[1].mlp.down_proj, fp8.Fp8Linear)  # the others stay e4m3

    def weight(m: torch.nn.Module) -> torch.Tensor:
        if isinstance(m, fp8.Fp8Linear):
            return fp8.dequantize(m.weight, m.weight_scale).double()
        dense = getattr(m, "dense_weight", None)
        return (dense() if dense is not None else m.weight).double()

    torch.testing.assert_close(weight(down0), held["model.layers.0.mlp.down_proj.weight"], rtol=0, atol=0)
    want_qkv = torch.cat([held[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(weight(qkv1), want_qkv, rtol=0, atol=0)
    torch.testing.assert_close(weight(layers[1].mlp.down_proj), held["model.layers.1.mlp.down_proj.weight"],
                               rtol=1e-12, atol=1e-12)
    # A fused layer must be all e4m3 or all not (vLLM refuses it too): a clear error at load.
    _channel_checkpoint(model_dir, tmp_path / "mixed", ("model.layers.0.self_attn.q_proj",))
    with pytest.raises(ValueError, match="some parts in e4m3"):
        _llm(tmp_path / "mixed")


def test_a_block_scaled_layer_one_block_wide_loads_its_blocks(model_dir: Path, tmp_path: Path) -> None:
    """A block-scaled checkpoint (`weight_block_size` [bn, bk]) whose layer is no wider than one
    block (in_features <= bk) has scales [ceil(out / bn), 1]: one column, like a per-channel
    scale, but one per block of rows. They were read as per-channel and the load failed ("neither
    per tensor nor per channel"). Oracle: the weights the checkpoint holds, dequantized per block."""
    bn, bk = 32, 128  # the tiny model's hidden size is 128: q/k/v and gate/up are one block wide
    shutil.copytree(model_dir, tmp_path / "m")
    tensors = load_file(str(model_dir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        proj = name.split(".")[-2] if name.endswith(".weight") else ""
        if proj not in PROJECTIONS:
            out[name] = t
            continue
        w = t.float()
        rows, cols = -(-w.shape[0] // bn), -(-w.shape[1] // bk)
        scale = torch.stack([torch.stack([w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
                                          for j in range(cols)]) for i in range(rows)]) / fp8.E4M3_MAX
        full = scale.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
        q = (w / full).clamp(-448, 448).to(fp8.E4M3)
        out[name], out[f"{name[: -len('.weight')]}.weight_scale_inv"] = q, scale
        held[name] = q.double() * full.double()
    save_file(out, str(tmp_path / "m" / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [bn, bk]}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    llm = _llm(tmp_path / "m")
    attn = llm.engine.model.model.layers[0].self_attn
    got = fp8.dequantize(attn.qkv_proj.weight, attn.qkv_proj.weight_scale).double()
    want = torch.cat([held[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    # Quantized again per row (fp8.requantize_blocks): within e4m3 rounding of what it holds.
    row_scale = attn.qkv_proj.weight_scale.double()[:, None]
    assert ((got - want).abs() <= want.abs() * 2**-4 + row_scale * 2**-9 + 1e-12).all()


# -- KV handed from a prefill worker to a decode worker ----------------------------------------------


def test_fp8_kv_sent_to_a_decode_worker_with_a_16_32_bit_cache_is_refused_not_read(model_dir: Path) -> None:
    """A prefill worker with `kv_cache_dtype="fp8"` and a decode worker with the model's dtype:
    the e4m3 bytes must not land in the float cache as if they were its own. With the recompute
    policy the decode worker computes the prompt itself, so its tokens equal its own offline
    engine's (the oracle); read as float32, the bytes would give other tokens or fail."""
    import asyncio

    from factories import handoff_deltas

    from pdserve import SamplingParams
    from pdserve.workers.decode_worker import DecodeWorker
    from pdserve.workers.handoff import KVFailurePolicy
    from pdserve.workers.prefill_worker import PrefillWorker
    from pdserve.workers.transfer.inprocess import InProcessReceiver, InProcessSender

    def engine(**kw: object):  # noqa: ANN202
        return LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32, progress=False,
                   **kw).engine

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(5, 4000, (40,), generator=g).tolist()
    p_engine, d_engine = engine(kv_cache_dtype="fp8"), engine()
    receiver = InProcessReceiver(d_engine.kv_caches)
    sender = InProcessSender(p_engine.kv_caches, receiver)
    decode = DecodeWorker(d_engine, receiver, KVFailurePolicy.RECOMPUTE, prefill_timeout_s=2.0).start()
    prefill = PrefillWorker(p_engine, lambda addr: sender).start()
    try:
        async def main() -> list[int]:
            outs = await handoff_deltas(prefill, decode, "r0", prompt, params)
            return [t for o in outs for t in o.outputs[0].token_ids]

        got = asyncio.run(main())
    finally:
        prefill.close()
        decode.close()
    want = _llm(model_dir).generate([prompt], params)[0].outputs[0].token_ids
    assert got == want
